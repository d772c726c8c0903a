"""The delta-rule recurrence of a KDA verify block (1 to 8 tokens) as one CUDA launch, with the states
stock records for rollback.

On CUDA (and the CPU) mlx-vlm's ``gated_delta_update`` runs ``gated_delta_ops``:
a Python loop over the block's tokens, each ``_gated_delta_step_ops`` (decay,
two row sums, the update, the cast), then ``mx.stack`` of the outputs and of
the first ``state_steps`` states. At L = 4 that is 32 launches and 76 views a
KDA layer (8 and 13 at L = 1), which a verify block's 34 KDA layers pay in
graph building and encoding.

Here one block per (batch row, head) runs every token, the state row in
registers, with the arithmetic of fused_kda_kernel's CUDA recurrence (the
one ``verify fused_kda_kernel`` found bit for bit stock's on an H200 and an
H100): per state row (value dim) a warp, each lane 4 consecutive key-dim
values; the decay and the products rounded apart (``__fmul_rn``), each row sum
4 values per lane in order from 0 and then the warp tree (MLX's
``row_reduce_simple``), ``state + k * delta`` one fma (``FMA_STATE``; verify
tries the other), y rounded to bf16, and a masked token's state put back to
what it was before the decay (stock's ``mx.where``; its y is still written).
The inputs are stock's own: q, k, v as the mixer made them, and the gate and
beta from stock's ``compute_g_safe`` / ``compute_g`` and ``mx.sigmoid``.

``mixer_block`` goes further: a block's whole mixer after the projections, as
fused_kda_kernel does it for one token (the depthwise conv, SiLU, the q/k
norms and scales, beta, the gate, the recurrence, the gated output norm), in
one launch. Its per-token arithmetic is fused_kda_kernel's CUDA text, which
``verify fused_kda_kernel`` found bit for bit stock's; a block of L tokens is
that token run L times (``checks/host_check.py`` checks this bit for bit).
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.patches.fused_kda_kernel.kernel import CUDA_HEADER, CUDA_HELPERS, DEFAULT_FMA

MAX_TOKENS = 8  # mlx-vlm's DECODE_BLOCK_SIZE: a verify block's longest
MAX_HEAD_DIM = 128  # a lane holds 4 of a state row's values
FMA_STATE = 1  # fused_kda_kernel's CUDA default: stock's fused `state + k * delta` is an fma there

# The recurrence, shared by both kernels: per state row (value dim) a warp, over the block's tokens. What it reads
# and writes per token goes through KV_* macros: global arrays (``SOURCE``) or the block kernel's shared ones.
# Template constants: H, D, TOKENS, STEPS (states recorded, 0 for none), FMA_STATE, HAS_MASK.
RECURRENCE = r"""
  constexpr int W = D / 4;  // warps per block; each takes every W-th state row
  for (int dv = warp; dv < D; dv += W) {
    const size_t row = ((size_t)bh * D + dv) * D;
    float s[4];
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * lane + i;
      s[i] = e < D ? state[row + e] : 0.0f;
    }
    for (int t = 0; t < TOKENS; ++t) {
      float kv[4], qv[4], old[4];
      float kv_mem = 0.0f;
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * lane + i;
        const bool in = e < D;
        kv[i] = in ? KV_K(t, e) : 0.0f;
        qv[i] = in ? KV_Q(t, e) : 0.0f;
        old[i] = s[i];
        s[i] = __fmul_rn(s[i], in ? KV_G(t, e) : 0.0f);  // the decay
        kv_mem = __fadd_rn(kv_mem, __fmul_rn(s[i], kv[i]));
      }
      kv_mem = kd_warp_tree(kv_mem);
      const float delta = __fmul_rn(__fsub_rn(KV_V(t, dv), kv_mem), KV_BETA(t));
      float y = 0.0f;
      for (int i = 0; i < 4; ++i) {
        s[i] = FMA_STATE ? __fmaf_rn(kv[i], delta, s[i]) : __fadd_rn(s[i], __fmul_rn(kv[i], delta));
        y = __fadd_rn(y, __fmul_rn(s[i], qv[i]));
      }
      y = kd_warp_tree(y);
      if (lane == 0) {
        KV_Y(t, dv, static_cast<__nv_bfloat16>(y));
      }
      if (HAS_MASK && !mask[(size_t)b * TOKENS + t]) {
        for (int i = 0; i < 4; ++i) {
          s[i] = old[i];
        }
      }
      if (t < STEPS) {
        const size_t at = ((((size_t)b * STEPS + t) * H + h) * D + dv) * D;
        for (int i = 0; i < 4; ++i) {
          if (4 * lane + i < D) {
            states[at + 4 * lane + i] = s[i];
          }
        }
      }
    }
    for (int i = 0; i < 4; ++i) {
      if (4 * lane + i < D) {
        state_out[row + 4 * lane + i] = s[i];
      }
    }
  }
"""

_BLOCK_HEAD = r"""
  const int bh = (int)blockIdx.x;
  const int b = bh / H;
  const int h = bh % H;
  const int lane = (int)threadIdx.x % 32;
  const int warp = (int)threadIdx.x / 32;
"""

# The recurrence alone: q, k, v, g, beta as stock's gated_delta_update hands them to gated_delta_ops.
SOURCE = _BLOCK_HEAD + r"""
#define KV_AT(t) (((size_t)b * TOKENS + (t)) * H + h)  // (row b, token t, head h)
#define KV_Q(t, e) static_cast<float>(q[KV_AT(t) * D + (e)])
#define KV_K(t, e) static_cast<float>(k[KV_AT(t) * D + (e)])
#define KV_G(t, e) g[KV_AT(t) * D + (e)]
#define KV_V(t, dv) static_cast<float>(v[KV_AT(t) * D + (dv)])
#define KV_BETA(t) static_cast<float>(beta[KV_AT(t)])
#define KV_Y(t, dv, y) (y_out[KV_AT(t) * D + (dv)] = (y))
""" + RECURRENCE

# The whole mixer after the projections: fused_kda_kernel's step (its kernel.py, CUDA text) per token, the conv over
# the block's conv input (the window, then the block: [B, KC - 1 + TOKENS, C]). Template constants: the recurrence's
# and KC, FMA_NORM. Per token, one warp makes q, k (normed, scaled), v, the gate and beta into shared memory
# (fused_kda_kernel's expressions, in its order); the recurrence; then one warp per token norms and gates y.
MIXER_SOURCE = _BLOCK_HEAD + r"""
  constexpr int C = 3 * H * D;  // conv channels: q, k, v of every head
  __shared__ float q_s[TOKENS][D], k_s[TOKENS][D], g_s[TOKENS][D], v_s[TOKENS][D], y_s[TOKENS][D];
  __shared__ float beta_s[TOKENS];
  const __nv_bfloat16 one = __float2bfloat16(1.0f);
  const float decay_rate = Exp{}(A_log[h]);
  for (int t = warp; t < TOKENS; t += D / 4) {
    // The depthwise conv at token t: its taps in order from 0, then rounded to bf16; SiLU.
    auto silu_conv = [&](int ch) {
      float acc = 0.0f;
      for (int j = 0; j < KC; ++j) {
        const float x = static_cast<float>(conv_input[((size_t)b * (KC - 1 + TOKENS) + t + j) * C + ch]);
        acc = __fadd_rn(acc, __fmul_rn(x, static_cast<float>(conv_w[(size_t)ch * KC + j])));
      }
      const __nv_bfloat16 c = static_cast<__nv_bfloat16>(acc);
      return Multiply{}(c, Sigmoid{}(c));
    };
    float sq = 0.0f, sk = 0.0f;  // rms_norm_small: 8 values a lane, then the warp tree
    if (lane * 8 < D) {
      for (int i = 0; i < 8; ++i) {
        const float xq = static_cast<float>(silu_conv(h * D + lane * 8 + i));
        const float xk = static_cast<float>(silu_conv((H + h) * D + lane * 8 + i));
        sq = FMA_NORM ? __fmaf_rn(xq, xq, sq) : __fadd_rn(sq, __fmul_rn(xq, xq));
        sk = FMA_NORM ? __fmaf_rn(xk, xk, sk) : __fadd_rn(sk, __fmul_rn(xk, xk));
      }
    }
    const float nq = rsqrtf(__fadd_rn(__fdiv_rn(kd_warp_tree(sq), (float)D), consts[0]));
    const float nk = rsqrtf(__fadd_rn(__fdiv_rn(kd_warp_tree(sk), (float)D), consts[0]));
    const size_t at = ((size_t)b * TOKENS + t) * H + h;  // (row b, token t, head h)
    for (int e = lane; e < D; e += 32) {
      const float xq = static_cast<float>(silu_conv(h * D + e));
      const float xk = static_cast<float>(silu_conv((H + h) * D + e));
      const __nv_bfloat16 qn = Multiply{}(one, static_cast<__nv_bfloat16>(__fmul_rn(xq, nq)));
      const __nv_bfloat16 kn = Multiply{}(one, static_cast<__nv_bfloat16>(__fmul_rn(xk, nk)));
      q_s[t][e] = static_cast<float>(Multiply{}(scales[0], qn));
      k_s[t][e] = static_cast<float>(Multiply{}(scales[1], kn));
      v_s[t][e] = static_cast<float>(silu_conv((2 * H + h) * D + e));
      // compute_g_safe: exp(lower_bound * sigmoid(exp(A_log) * (a + dt_bias))).
      const float x = __fadd_rn(static_cast<float>(a[at * D + e]), dt_bias[h * D + e]);
      g_s[t][e] = Exp{}(__fmul_rn(consts[2], Sigmoid{}(__fmul_rn(decay_rate, x))));
    }
    if (lane == 0) {
      beta_s[t] = static_cast<float>(Sigmoid{}(beta_logit[at]));
    }
  }
  __syncthreads();
#define KV_Q(t, e) q_s[t][e]
#define KV_K(t, e) k_s[t][e]
#define KV_G(t, e) g_s[t][e]
#define KV_V(t, dv) v_s[t][dv]
#define KV_BETA(t) beta_s[t]
#define KV_Y(t, dv, y) (y_s[t][dv] = static_cast<float>(y))
""" + RECURRENCE + r"""
  __syncthreads();
  for (int t = warp; t < TOKENS; t += D / 4) {  // o_norm(y) * sigmoid(gate)
    float so = 0.0f;
    if (lane * 8 < D) {
      for (int i = 0; i < 8; ++i) {
        const float y = y_s[t][lane * 8 + i];
        so = FMA_NORM ? __fmaf_rn(y, y, so) : __fadd_rn(so, __fmul_rn(y, y));
      }
    }
    const float no = rsqrtf(__fadd_rn(__fdiv_rn(kd_warp_tree(so), (float)D), consts[1]));
    const size_t at = ((size_t)b * TOKENS + t) * H + h;
    for (int e = lane; e < D; e += 32) {
      const __nv_bfloat16 normed = Multiply{}(o_weight[e], static_cast<__nv_bfloat16>(__fmul_rn(y_s[t][e], no)));
      out[at * D + e] = Multiply{}(normed, Sigmoid{}(gate[at * D + e]));
    }
  }
"""

KERNEL = dict(name="glm53_kda_verify", inputs=["q", "k", "v", "g", "beta", "state", "mask"],
              outputs=["y_out", "state_out", "states"], cuda=(SOURCE, CUDA_HELPERS))
MIXER_KERNEL = dict(name="glm53_kda_verify_mixer",
                    inputs=["conv_input", "conv_w", "a", "beta_logit", "gate", "state", "A_log", "dt_bias", "o_weight",
                            "scales", "consts", "mask"],
                    outputs=["out", "state_out", "states"], cuda=(MIXER_SOURCE, CUDA_HEADER + CUDA_HELPERS))


def unsupported(q, k, v, a, b, A_log, dt_bias, state, mask) -> Optional[str]:
    """Why stock's ``gated_delta_update`` on these arrays is not a call the kernel reproduces, or None."""
    if any(x.dtype != mx.bfloat16 for x in (q, k, v, a, b)):
        return "dtype"
    if state.dtype != mx.float32 or A_log.dtype != mx.float32 or dt_bias.dtype != mx.float32:
        return "dtype"  # the gate and the state in float32, as a converted checkpoint keeps them
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape or a.shape != q.shape:
        return "shape"  # one head count for q, k and v (no repeat), Dk = Dv, a gate per key dim (KDA)
    batch, length, heads, head_dim = q.shape
    if b.shape != (batch, length, heads) or state.shape != (batch, heads, head_dim, head_dim):
        return "shape"
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return "head dim"
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape != (batch, length)):
        return "mask"
    return None


def delta_block(q, k, v, g, beta, state, mask=None, state_steps=None, *, fma_state=None):
    """``gated_delta_ops(q, k, v, g, beta, state, mask, state_steps)`` on CUDA: ``(y, state)``, or ``(y, state,
    states)`` with ``state_steps``. q, k, v, g: ``[B, T, H, D]`` (g float32), beta ``[B, T, H]``, state ``[B, H, D,
    D]``, mask ``[B, T]`` or None; check ``unsupported`` first. ``fma_state`` overrides ``FMA_STATE`` (verify)."""
    batch, length, heads, head_dim = q.shape
    steps = state_steps or 0
    warps = head_dim // 4
    y, new_state, states = gpu_kernel(backend="cuda", **KERNEL)(
        inputs=[q, k, v, g, beta, state, mx.ones((1,), dtype=mx.bool_) if mask is None else mask],
        template=[("H", heads), ("D", head_dim), ("TOKENS", length), ("STEPS", steps),
                  ("FMA_STATE", int(FMA_STATE if fma_state is None else fma_state)), ("HAS_MASK", mask is not None)],
        grid=(batch * heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[q.shape, state.shape, (batch, steps, heads, head_dim, head_dim) if steps else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32],
    )
    return (y, new_state, states) if steps else (y, new_state)


def mixer_block(conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales, mask=None,
                state_steps=None, *, fma=None):
    """A KDA verify block after the projections: ``(out [B, L, H*D] bf16, state[, states])``, as stock's mixer
    makes ``o_proj``'s input and the recurrence's results. conv_input: the cache's window then the block's masked
    qkv, ``[B, KC-1+L, 3*H*D]``; conv_w ``[3*H*D, KC]``; a, gate ``[B, L, H*D]``; beta_logit ``[B, L, H]`` (all
    bf16); state ``[B, H, D, D]``, A_log ``[H]``, dt_bias ``[H*D]`` float32; o_weight ``[D]`` bf16; consts, scales:
    fused_kda_kernel's ``constants``; mask ``[B, L]`` bool or None. The caller checks fused_kda_kernel's
    ``unsupported``. ``fma``: (FMA_NORM, FMA_STATE), default fused_kda_kernel's FMA_NORM and ``FMA_STATE``."""
    batch, heads, head_dim = state.shape[0], state.shape[1], state.shape[-1]
    taps = conv_w.shape[1]
    length = conv_input.shape[1] - taps + 1
    steps = state_steps or 0
    fma_norm, fma_state = (DEFAULT_FMA["cuda"][0], FMA_STATE) if fma is None else fma
    warps = head_dim // 4
    out, new_state, states = gpu_kernel(backend="cuda", **MIXER_KERNEL)(
        inputs=[conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, scales, consts,
                mx.ones((1,), dtype=mx.bool_) if mask is None else mask],
        template=[("H", heads), ("D", head_dim), ("TOKENS", length), ("STEPS", steps), ("KC", taps),
                  ("FMA_NORM", int(fma_norm)), ("FMA_STATE", int(fma_state)), ("HAS_MASK", mask is not None)],
        grid=(batch * heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(batch, length, heads * head_dim), state.shape,
                       (batch, steps, heads, head_dim, head_dim) if steps else (1,)],
        output_dtypes=[mx.bfloat16, mx.float32, mx.float32],
    )
    return (out, new_state, states) if steps else (out, new_state)

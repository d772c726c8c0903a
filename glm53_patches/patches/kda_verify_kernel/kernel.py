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
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.patches.fused_kda_kernel.kernel import CUDA_HELPERS

MAX_TOKENS = 8  # mlx-vlm's DECODE_BLOCK_SIZE: a verify block's longest
MAX_HEAD_DIM = 128  # a lane holds 4 of a state row's values
FMA_STATE = 1  # fused_kda_kernel's CUDA default: stock's fused `state + k * delta` is an fma there

# Template constants: H, D, TOKENS, STEPS (states recorded, 0 for none), FMA_STATE, HAS_MASK.
SOURCE = r"""
  constexpr int W = D / 4;  // warps per block; each takes every W-th state row
  const int bh = (int)blockIdx.x;
  const int b = bh / H;
  const int h = bh % H;
  const int lane = (int)threadIdx.x % 32;
  const int warp = (int)threadIdx.x / 32;
  for (int dv = warp; dv < D; dv += W) {
    const size_t row = ((size_t)bh * D + dv) * D;
    float s[4];
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * lane + i;
      s[i] = e < D ? state[row + e] : 0.0f;
    }
    for (int t = 0; t < TOKENS; ++t) {
      const size_t th = ((size_t)b * TOKENS + t) * H + h;  // (row b, token t, head h)
      float kv[4], qv[4], old[4];
      float kv_mem = 0.0f;
      for (int i = 0; i < 4; ++i) {
        const int e = 4 * lane + i;
        const bool in = e < D;
        kv[i] = in ? static_cast<float>(k[th * D + e]) : 0.0f;
        qv[i] = in ? static_cast<float>(q[th * D + e]) : 0.0f;
        old[i] = s[i];
        s[i] = __fmul_rn(s[i], in ? g[th * D + e] : 0.0f);  // the decay
        kv_mem = __fadd_rn(kv_mem, __fmul_rn(s[i], kv[i]));
      }
      kv_mem = kd_warp_tree(kv_mem);
      const float delta = __fmul_rn(__fsub_rn(static_cast<float>(v[th * D + dv]), kv_mem),
                                    static_cast<float>(beta[th]));
      float y = 0.0f;
      for (int i = 0; i < 4; ++i) {
        s[i] = FMA_STATE ? __fmaf_rn(kv[i], delta, s[i]) : __fadd_rn(s[i], __fmul_rn(kv[i], delta));
        y = __fadd_rn(y, __fmul_rn(s[i], qv[i]));
      }
      y = kd_warp_tree(y);
      if (lane == 0) {
        y_out[th * D + dv] = static_cast<__nv_bfloat16>(y);
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

KERNEL = dict(name="glm53_kda_verify", inputs=["q", "k", "v", "g", "beta", "state", "mask"],
              outputs=["y_out", "state_out", "states"], cuda=(SOURCE, CUDA_HELPERS))


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

"""A KDA decode step after the projections, as one GPU launch: CUDA and Metal twins.

For one token, stock turns the projections ``qkv``, ``a``, ``b``, ``gate``
into the mixer's output, the new conv window and the new recurrent state in
about 25 kernels: the window concatenation and depthwise conv, SiLU, two
``rms_norm``s and their scales, ``sigmoid(b)``,
``compute_g_safe``, the delta-rule step (decay, two row sums, the update),
the cast, the output ``rms_norm``, ``sigmoid(gate)`` and the product. Here one
block per (batch row, head) does all of it, each value rounded where stock
rounds it:

* the conv adds its (exact) bf16 products in tap order from 0 in float32
  and rounds to bf16, as cuDNN does on the H200 (``CUDA_HELPERS``);
* bf16 ops (SiLU, the norms' outputs and scales, the gate) call MLX's own
  functors on ``__nv_bfloat16`` (CUDA), so they are stock's code;
* ``rms_norm`` sums squares as MLX's ``rms_norm_small`` does: 8 values per
  lane (16-byte loads), then the warp tree; ``FMA_NORM`` says whether those
  partial sums are fma chains (nvcc contracts ``normalizer += t * t``);
* the delta rule is stock's CUDA/CPU ops path (``_gated_delta_step_ops``):
  each row sum of 128 float32 products is MLX's ``row_reduce_simple``:
  4 values per lane added in order from 0, then the warp tree (offsets 16
  down to 1). Products and sums use ``__fmul_rn`` / ``__fadd_rn`` because
  stock materialises the products before summing them; NVRTC would
  otherwise fuse them into fmas (the expert_combine lesson). ``FMA_STATE``
  says whether stock's fused ``state + k * delta`` kernel is an fma.

Which FMA_* values reproduce stock on a machine is what ``verify`` checks
(it tries the others when the default fails and says which matched).

Metal: each step follows the stock Metal kernel that computes it (the
comment above ``METAL_SOURCE`` names them): the recurrence mlx-vlm's
``_make_gated_delta_kernel`` statement by statement, ``Dk / 32`` values per
lane (so head dims that are multiples of 32, where stock uses that kernel),
the norms MLX's ``rms_single_row``, the conv ``depthwise_conv_1d``, the
functors with ``metal::precise::exp``. ``glm53_patches/checks/metal``
type-checks the source MLX generates and runs it, emulated, against those
stock texts; it has not run on any Mac, and runs only where ``glm53-patches
verify fused_kda_kernel`` passed there.
"""

import functools
from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import compiled_constant, gpu_kernel


ROWS_PER_WARP = 4  # a head's D state rows are spread over D / 4 warps
MAX_HEAD_DIM = 128  # one lane holds at most 4 of a row's values (CUDA: 8 of a norm's)

# FMA_NORM, FMA_STATE (see the module doc); verify tries the others.
DEFAULT_FMA = {"cuda": (1, 1), "metal": (0, 0)}

# One body for CUDA, Metal and the host check; KD_* macros are the backend's
# primitives. Template constants: H, D, FMA_NORM, FMA_STATE, HAS_MASK.
# @PER@ is how many of a row's key-dim values a lane holds (contiguous, from
# @PER@ * lane): CUDA keeps main's 4 (the H200-verified text); Metal's is
# Dk / 32, as stock's Metal recurrence (mlx-vlm's gated-delta kernel) has it.
_BODY = r"""
  constexpr int W = D / 4;  // warps per block, 4 state rows each
  const int bh = (int)KD_BLOCK;
  const int b = bh / H;
  const int h = bh % H;
  const int lane = (int)KD_THREAD % 32;
  const int warp = (int)KD_THREAD / 32;
  KD_SHARED float y_row[D];

  constexpr int C = 3 * H * D;  // conv channels: q, k, v of every head
  const int q_ch = h * D;
  const int k_ch = q_ch + H * D;
  const int v_ch = k_ch + H * D;
  const bool live = HAS_MASK ? mask[b] : true;

  // The conv window moves by one token: this head's q, k and v channels.
  for (int i = (int)KD_THREAD; i < 3 * D * (KC - 1); i += W * 32) {
    const int j = i / (3 * D);  // window row
    const int ch = q_ch + (i % (3 * D)) / D * H * D + i % D;
    const size_t at = ((size_t)b * (KC - 1) + j) * C + ch;
    window_out[at] = j + 1 < KC - 1 ? window[at + C] : qkv[(size_t)b * C + ch];
  }
#define KD_CONV_AT(ch) kd_conv<KC>(qkv, window, conv_w, b, (ch), C)

  // rms_norm's normalizer of q and of k (the conv and SiLU first, as stock).
  float sq = 0.0f;
  float sk = 0.0f;
  if (lane * NORM_READS < D) {
    for (int i = 0; i < NORM_READS; ++i) {
      const float xq = KD_TO_F(KD_SILU(KD_CONV_AT(q_ch + lane * NORM_READS + i)));
      const float xk = KD_TO_F(KD_SILU(KD_CONV_AT(k_ch + lane * NORM_READS + i)));
      sq = KD_NORM_ACC(sq, xq);
      sk = KD_NORM_ACC(sk, xk);
    }
  }
  sq = KD_LANE_SUM(sq);
  sk = KD_LANE_SUM(sk);
  const float nq = KD_RSQRT(KD_ADD(KD_DIV(sq, (float)D), consts[0]));
  const float nk = KD_RSQRT(KD_ADD(KD_DIV(sk, (float)D), consts[0]));

  // This lane's 4 key-dim values of q, k (normed, scaled) and the gate g.
  float qv[4], kv[4], gv[4];
  const float decay_rate = KD_EXP_F(A_log[h]);
  for (int i = 0; i < @PER@; ++i) {
    const int e = @PER@ * lane + i;
    if (e < D) {
      const KD_BF16 qn = KD_BF_MUL(KD_ONE, KD_TO_BF(KD_MUL(KD_TO_F(KD_SILU(KD_CONV_AT(q_ch + e))), nq)));
      const KD_BF16 kn = KD_BF_MUL(KD_ONE, KD_TO_BF(KD_MUL(KD_TO_F(KD_SILU(KD_CONV_AT(k_ch + e))), nk)));
      qv[i] = KD_TO_F(KD_BF_MUL(scales[0], qn));
      kv[i] = KD_TO_F(KD_BF_MUL(scales[1], kn));
      // compute_g_safe: exp(lower_bound * sigmoid(exp(A_log) * (a + dt_bias))).
      const float x = KD_ADD(KD_TO_F(a[((size_t)b * H + h) * D + e]), dt_bias[h * D + e]);
      gv[i] = KD_EXP_F(KD_MUL(consts[2], KD_SIGMOID_F(KD_MUL(decay_rate, x))));
    } else {
      qv[i] = kv[i] = gv[i] = 0.0f;
    }
  }
  const float beta = KD_TO_F(KD_SIGMOID_BF(beta_logit[bh]));

  // The delta rule, one state row (value dim) at a time per warp.
  for (int dv = warp; dv < D; dv += W) {
    const size_t row = ((size_t)bh * D + dv) * D;
    float s[4];
    float kv_mem = 0.0f;
    for (int i = 0; i < @PER@; ++i) {
      const int e = @PER@ * lane + i;
      s[i] = e < D ? state[row + e] : 0.0f;
      s[i] = KD_MUL(s[i], gv[i]);
      kv_mem = KD_MAC(kv_mem, s[i], kv[i]);
    }
    kv_mem = KD_LANE_SUM(kv_mem);
    const float delta = KD_MUL(KD_SUB(KD_TO_F(KD_SILU(KD_CONV_AT(v_ch + dv))), kv_mem), beta);
    float y = 0.0f;
    for (int i = 0; i < @PER@; ++i) {
      const int e = @PER@ * lane + i;
      s[i] = KD_STATE_UPDATE(s[i], kv[i], delta);
      y = KD_MAC(y, s[i], qv[i]);
      if (e < D) {
        state_out[row + e] = live ? s[i] : state[row + e];
      }
    }
    y = KD_LANE_SUM(y);
    if (lane == 0) {
      y_row[dv] = KD_TO_F(KD_Y_CAST(live, y));
    }
  }
  KD_BARRIER;

  // o_norm(y) * sigmoid(gate), by the first warp.
  if (warp == 0) {
    float so = 0.0f;
    if (lane * NORM_READS < D) {
      for (int i = 0; i < NORM_READS; ++i) {
        so = KD_NORM_ACC(so, y_row[lane * NORM_READS + i]);
      }
    }
    so = KD_LANE_SUM(so);
    const float no = KD_RSQRT(KD_ADD(KD_DIV(so, (float)D), consts[1]));
    for (int e = lane; e < D; e += 32) {
      const KD_BF16 normed = KD_BF_MUL(o_weight[e], KD_TO_BF(KD_MUL(y_row[e], no)));
      const size_t at = ((size_t)b * H + h) * D + e;
      out[at] = KD_BF_MUL(normed, KD_SIGMOID_BF(gate[at]));
    }
  }
"""

BODY = _BODY.replace("@PER@", "4")  # CUDA and the host check
METAL_BODY = _BODY.replace("@PER@", "KD_PER")

CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""

# MLX's functors and the rounding points of its kernels (module doc).
CUDA_SOURCE = (
    r"""
#define KD_BLOCK blockIdx.x
#define KD_THREAD threadIdx.x
#define KD_SHARED __shared__
#define KD_BARRIER __syncthreads()
#define KD_BF16 __nv_bfloat16
#define KD_ONE __float2bfloat16(1.0f)
#define KD_TO_F(x) static_cast<float>(x)
#define KD_TO_BF(x) static_cast<__nv_bfloat16>(x)
#define KD_SILU(x) Multiply{}((x), Sigmoid{}(x))
#define KD_SIGMOID_BF(x) Sigmoid{}(x)
#define KD_SIGMOID_F(x) Sigmoid{}(x)
#define KD_EXP_F(x) Exp{}(x)
#define KD_BF_MUL(a, b) Multiply{}((a), (b))
#define KD_MUL(a, b) __fmul_rn((a), (b))
#define KD_ADD(a, b) __fadd_rn((a), (b))
#define KD_SUB(a, b) __fsub_rn((a), (b))
#define KD_DIV(a, b) __fdiv_rn((a), (b))
#define KD_RSQRT(x) rsqrtf(x)
#define KD_MAC(acc, a, b) __fadd_rn((acc), __fmul_rn((a), (b)))
#define KD_NORM_ACC(acc, x) (FMA_NORM ? __fmaf_rn((x), (x), (acc)) : __fadd_rn((acc), __fmul_rn((x), (x))))
#define KD_STATE_UPDATE(s, k, d) (FMA_STATE ? __fmaf_rn((k), (d), (s)) : __fadd_rn((s), __fmul_rn((k), (d))))
#define KD_Y_CAST(live, y) static_cast<__nv_bfloat16>(y)
#define NORM_READS 8
"""
    + r"""
#define KD_LANE_SUM(v) kd_warp_tree(v)
"""
    + BODY
)

# Warp tree of MLX's cg::reduce: partner at offsets 16, 8, 4, 2, 1. The
# depthwise conv as MLX's CUDA conv (cuDNN) computes it on the H200: the
# (exact) bf16 products added in tap order from 0 in float32, then rounded
# to bf16 (benchmarks/h200/probe_conv_order.py tells the orders apart).
CUDA_HELPERS = r"""
template <int KC>
__device__ __forceinline__ __nv_bfloat16 kd_conv(const __nv_bfloat16* qkv, const __nv_bfloat16* window,
                                                 const __nv_bfloat16* w, int b, int ch, int C) {
  float acc = 0.0f;
  for (int j = 0; j < KC - 1; ++j) {
    const float x = static_cast<float>(window[((size_t)b * (KC - 1) + j) * C + ch]);
    acc = __fadd_rn(acc, __fmul_rn(x, static_cast<float>(w[(size_t)ch * KC + j])));
  }
  const float x = static_cast<float>(qkv[(size_t)b * C + ch]);
  acc = __fadd_rn(acc, __fmul_rn(x, static_cast<float>(w[(size_t)ch * KC + KC - 1])));
  return static_cast<__nv_bfloat16>(acc);
}
__device__ __forceinline__ float kd_warp_tree(float v) {
  for (int off = 16; off > 0; off >>= 1) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  }
  return v;
}
"""

# Metal: stock's kernels for the same step, MLX 0.32.4 and mlx-vlm 0.7.10:
# the compiled SiLU and compute_g_safe and the eager sigmoid / multiplies use
# MLX's functors (kernels/unary_ops.h Sigmoid and Exp with metal::precise::exp,
# binary_ops.h Multiply) on the arrays' own types (bf16 math through
# kernels/bf16_math.h: computed in float, rounded to bf16 each step); the norms
# follow rms_norm.metal's rms_single_row (4 values per lane, simd_sum, precise
# rsqrt); the recurrence is mlx-vlm's _make_gated_delta_kernel
# (models/gated_delta.py: Dk / 32 values per lane, simd_sum; a masked row keeps
# its state and outputs 0). FMA_NORM / FMA_STATE: 0 writes stock's expressions
# (acc + a * b), which the Metal compiler contracts as it contracts stock's;
# 1 forces metal::fma, for verify to try when 0 fails.
METAL_SOURCE = (
    r"""
#define KD_BLOCK threadgroup_position_in_grid.x
#define KD_THREAD thread_position_in_threadgroup.x
#define KD_SHARED threadgroup
#define KD_BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)
#define KD_BF16 bfloat16_t
#define KD_ONE static_cast<bfloat16_t>(1.0f)
#define KD_TO_F(x) static_cast<float>(x)
#define KD_TO_BF(x) static_cast<bfloat16_t>(x)
#define KD_SILU(x) kd_bf_mul((x), kd_sigmoid(x))
#define KD_SIGMOID_BF(x) kd_sigmoid(x)
#define KD_SIGMOID_F(x) kd_sigmoid(x)
#define KD_EXP_F(x) metal::precise::exp(x)
#define KD_BF_MUL(a, b) kd_bf_mul((a), (b))
#define KD_MUL(a, b) ((a) * (b))
#define KD_ADD(a, b) ((a) + (b))
#define KD_SUB(a, b) ((a) - (b))
#define KD_DIV(a, b) ((a) / (b))
#define KD_RSQRT(x) metal::precise::rsqrt(x)
#define KD_MAC(acc, a, b) (FMA_STATE ? metal::fma((a), (b), (acc)) : ((acc) + (a) * (b)))
#define KD_NORM_ACC(acc, x) (FMA_NORM ? metal::fma((x), (x), (acc)) : ((acc) + (x) * (x)))
#define KD_STATE_UPDATE(s, k, d) (FMA_STATE ? metal::fma((k), (d), (s)) : ((s) + (k) * (d)))
#define KD_Y_CAST(live, y) static_cast<bfloat16_t>((live) ? (y) : 0.0f)
#define KD_LANE_SUM(v) simd_sum(v)
#define KD_PER (D / 32)
#define NORM_READS 4
"""
    + METAL_BODY
)

METAL_HEADER = r"""
// MLX's kernels/conv.metal, depthwise_conv_1d: taps in order into a float.
template <int KC, typename P, typename Q, typename W>
inline bfloat16_t kd_conv(P qkv, Q window, W w, int b, int ch, int C) {
  float acc = 0.0;
  for (int j = 0; j < KC - 1; ++j) {
    acc += static_cast<float>(window[((size_t)b * (KC - 1) + j) * C + ch]) * w[(size_t)ch * KC + j];
  }
  acc += static_cast<float>(qkv[(size_t)b * C + ch]) * w[(size_t)ch * KC + KC - 1];
  return static_cast<bfloat16_t>(acc);
}
// binary_ops.h, struct Multiply.
template <typename T>
inline T kd_bf_mul(T x, T y) {
  return x * y;
}
// unary_ops.h, struct Sigmoid, on T = float or bfloat16_t.
template <typename T>
inline T kd_sigmoid(T x) {
  auto y = 1 / (1 + metal::precise::exp(metal::abs(x)));
  return (x < 0) ? y : 1 - y;
}
"""

INPUTS = ["qkv", "window", "conv_w", "a", "beta_logit", "gate", "state", "A_log", "dt_bias", "o_weight", "scales", "consts", "mask"]
OUTPUTS = ["out", "state_out", "window_out"]

KERNEL = dict(name="glm53_fused_kda", inputs=INPUTS, outputs=OUTPUTS, cuda=(CUDA_SOURCE, CUDA_HEADER + CUDA_HELPERS),
              metal=(METAL_SOURCE, METAL_HEADER))


def unsupported(dtype, state, heads, head_dim, lower_bound, gate_params, conv_weight, backend=None) -> Optional[str]:
    """Why the kernel does not cover a decode step, or None when it does.

    dtype: the activations'; state: the recurrent state; gate_params: the
    layer's A_log and dt_bias (stock's float32 path is the one reproduced);
    conv_weight: the short conv's, [channels, taps, 1].
    """
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if dtype != mx.bfloat16 or state.dtype != mx.float32 or conv_weight.dtype != mx.bfloat16:
        return "dtype"
    if any(p.dtype != mx.float32 for p in gate_params):
        return "A_log / dt_bias not float32"
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return "head dim"
    if backend == "metal" and head_dim % 32:
        return "head dim (stock's Metal recurrence kernel needs a multiple of 32)"
    if lower_bound is None:
        return "no lower bound (compute_g)"
    if state.shape[1:] != (heads, head_dim, head_dim) or conv_weight.shape[::2] != (3 * heads * head_dim, 1):
        return "shape"
    return None


@functools.lru_cache(maxsize=16)
def constants(eps_qk, eps_out, lower_bound, scale):
    """(float32 [eps q/k norms, eps output norm, lower bound], bf16 [scale**2, scale]) as stock rounds them.

    rms_norm's eps is a C++ float; compute_g_safe reads ``lower_bound`` as a
    compiled constant; stock multiplies bf16 arrays by the Python floats
    ``scale**2`` and ``scale``, which MLX rounds float64 -> float32 -> bf16.
    Made once, outside any trace (``compiled_constant`` evaluates).
    """
    consts = mx.array([eps_qk, eps_out, compiled_constant(lower_bound)], dtype=mx.float32)
    scales = mx.array([scale**2, scale], dtype=mx.float32).astype(mx.bfloat16)
    mx.eval(consts, scales)
    return consts, scales


def fused_kda_step(qkv, window, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales,
                   mask=None, *, backend=None, fma=None):
    """``(out [B, H*D] bf16, new state [B, H, D, D] float32, new conv window)``; check ``unsupported`` first.

    qkv: the qkv projection (masked), [B, 3*H*D]; window: the conv window
    [B, KC-1, 3*H*D]; conv_w: the depthwise conv's weight [3*H*D, KC]; a,
    gate: [B, H*D]; beta_logit: [B, H] (all bf16); A_log [H], dt_bias [H*D]
    float32; o_weight [D] bf16; mask: [B] bool or None.
    """
    backend = gpu_backend() if backend is None else backend
    fma_norm, fma_state = DEFAULT_FMA[backend] if fma is None else fma
    batch, heads, head_dim = state.shape[0], state.shape[1], state.shape[-1]
    has_mask = mask is not None
    warps = head_dim // ROWS_PER_WARP
    return gpu_kernel(backend=backend, **KERNEL)(
        inputs=[qkv, window, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, scales, consts,
                mask if has_mask else mx.ones((1,), dtype=mx.bool_)],
        template=[("H", heads), ("D", head_dim), ("KC", conv_w.shape[1]), ("FMA_NORM", int(fma_norm)),
                  ("FMA_STATE", int(fma_state)), ("HAS_MASK", has_mask)],
        grid=(batch * heads * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(batch, heads * head_dim), state.shape, window.shape],
        output_dtypes=[mx.bfloat16, mx.float32, window.dtype],
    )

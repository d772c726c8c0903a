"""One launch for a hyper-connection's Sinkhorn collapse at decode: CUDA and Metal.

Computes, for every row (batch x position) of a hyper-connection with
``hc_mult == 4`` streams, what mlx-vlm's ``HyperConnection.__call__`` computes
after its mix matmul::

    pre, post, comb = _hc_split_sinkhorn_ops(mixes, scale, base, 4, iters, eps)
    collapsed = (pre[..., None] * x.astype(float32)).sum(axis=2).astype(x.dtype)

Inputs ``x [B, L, 4, D]`` (float32, bfloat16 or float16), ``mixes [B, L, 24]``,
``scale [3]``, ``base [24]`` (float32). Outputs ``collapsed [B, L, D]`` (x's
dtype), ``post [B, L, 4]`` and ``comb [B, L, 4, 4]`` (float32). One thread
block (threadgroup) per row of 256 threads:

* warp (simdgroup) 0 runs ``post`` and the Sinkhorn iterations of ``comb``;
* warps 1..7 compute ``pre`` (4 values, recomputed per thread: identical bits
  everywhere) and the weighted sum of the 4 streams over ``D``,

so the Sinkhorn chain and the stream read overlap instead of running as ~80
kernels one after the other (MLX's CUDA backend does not fuse reductions:
each of the 39 ``sum`` calls of the compiled Sinkhorn is its own launch).

Both bodies reproduce *the stock path of their own backend* bit for bit, so
they are not the same arithmetic:

CUDA (stock = ``_hc_ops``: the ``mx.compile``d ``_hc_split_sinkhorn_ops`` run
as NVRTC-compiled fused kernels plus MLX's prebuilt softmax/reduce kernels,
then an eager multiply, ``sum`` and ``astype``):

* fused elementwise chains are written with MLX's own functors
  (``Multiply``, ``Add``, ``Sigmoid``, ``Divide`` from
  ``mlx/backend/cuda/device/*_ops.cuh``), so NVRTC sees the same expression
  and makes the same fused-multiply-add contraction decision as it does for
  MLX's JIT kernels (``mixes * scale + base`` -> one fma; ``Sigmoid`` uses the
  precise ``expf``, not ``__expf``);
* values that stock writes to memory between kernels are combined with
  ``__fadd_rn``/``__fmul_rn``/``__fdiv_rn``, which the compiler never
  contracts;
* ``softmax`` follows ``mlx/backend/cuda/softmax.cu`` for a 4-wide row: one
  thread holds the row, running max from ``-FLT_MAX``, ``__expf``,
  normaliser ``0 * exp(-FLT_MAX - m) + e0 + e1 + e2 + e3`` in order, two
  rescalings by ``exp(m - m)`` for the warp and block stages, then
  ``exp(v - m) * (1 / s)``;
* every 4-element ``sum`` (``row_reduce_simple``, ``col_reduce_small``) is
  ``((((0 + a) + b) + c) + d)``, and the collapse is the eager product
  rounded, then summed over the streams in order from 0;
* the scalar ``eps`` is the float32 that MLX's compiled kernels read for the
  captured Python float (``compiled_constant``: older MLX printed captured
  constants with 7 significant digits, 0.32.4 prints 9; 1e-6 survives both).

Metal (stock = upstream's own ``_hc_kernel`` from
``mlx_vlm/models/deepseek_v4/hyper_connection.py``, a fused Sinkhorn-collapse
kernel already): the Metal body keeps that kernel's statements verbatim
(``metal::fast::exp`` sigmoids and softmax, ``simd_sum`` column sums,
reciprocal-multiply normalisation, the ``fma`` collapse chain), only
regrouped into the layout above. It is not verified on any Mac yet.

``variant`` (CUDA only) selects alternative arithmetic for diagnosis by
``glm53_patches.patches.hc_decode.checks.device_check``: ``(affine, softmax,
collapse)`` with affine 0 = MLX functors, 1 = explicit fma, 2 = explicit
multiply then add; softmax 0 = as ``softmax.cu``, 1 = precise ``expf``,
2 = ``exp / s``; collapse 0 = rounded products summed, 1 = fma chain.
"""

from typing import Optional, Tuple

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import compiled_constant, gpu_kernel

HC = 4  # the kernels are written for 4 streams (hc_mult of GLM-5.3-Flash)
THREADS = 256  # one block per row: warp 0 Sinkhorn, warps 1..7 the collapse
DEFAULT_VARIANT = (0, 0, 0)

CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

namespace mlx::core::cu {

// mixes * scale + base as stock computes it inside its compiled kernel.
template <int AFFINE>
__device__ __forceinline__ float hc_affine(float m, float s, float b) {
  if constexpr (AFFINE == 1) {
    return __fmaf_rn(m, s, b);
  } else if constexpr (AFFINE == 2) {
    return __fadd_rn(__fmul_rn(m, s), b);
  } else {
    return Add{}(Multiply{}(m, s), b);
  }
}

// The exponential of mlx/backend/cuda/softmax.cu (softmax_exp).
template <int SMX>
__device__ __forceinline__ float hc_softmax_exp(float x) {
  if constexpr (SMX == 1) {
    return expf(x);
  } else {
    return __expf(x);
  }
}

} // namespace mlx::core::cu
"""

CUDA_SOURCE = r"""
  // Template constants: T (x dtype), HC, D, ITERS, AFFINE, SMX, COLL.
  constexpr int MIX = (2 + HC) * HC;
  constexpr int NC = HC * HC;
  constexpr unsigned FULL = 0xffffffffu;
  static_assert(NC <= 32, "one warp holds the HC x HC comb matrix");

  const unsigned row = blockIdx.x;
  const unsigned tid = threadIdx.x;
  const float* mix = mixes + (size_t)row * MIX;
  const float eps = hc_eps[0];

  if (tid < 32) {
    // ---- warp 0: post, and comb = softmax + Sinkhorn, one lane per entry.
    const int lane = (int)tid;
    const int k = lane < NC ? lane : NC - 1;  // lanes >= NC shadow the last entry
    const int r = k / HC;
    const int c = k - r * HC;

    if (lane < HC) {
      // _hc_split_sinkhorn_ops: 2 * sigmoid(mixes * post_scale + base), fused.
      float z = hc_affine<AFFINE>(mix[HC + lane], scale[1], base[HC + lane]);
      post[(size_t)row * HC + lane] = Multiply{}(2.0f, Sigmoid{}(z));
    }

    // comb logits (fused kernel), then softmax.cu for a row of HC values held
    // by one thread: running max, online normaliser, two rescaling stages.
    float v = hc_affine<AFFINE>(mix[2 * HC + k], scale[2], base[2 * HC + k]);
    float vr[HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      vr[j] = __shfl_sync(FULL, v, r * HC + j);
    }
    const float lowest = Limits<float>::finite_min();
    float m = lowest;
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      m = (m < vr[j]) ? vr[j] : m;
    }
    float s = __fmul_rn(0.0f, hc_softmax_exp<SMX>(__fsub_rn(lowest, m)));
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      s = __fadd_rn(s, hc_softmax_exp<SMX>(__fsub_rn(vr[j], m)));
    }
    s = __fmul_rn(s, hc_softmax_exp<SMX>(__fsub_rn(m, m)));
    s = __fmul_rn(s, hc_softmax_exp<SMX>(__fsub_rn(m, m)));
    float e = hc_softmax_exp<SMX>(__fsub_rn(v, m));
    float x;
    if constexpr (SMX == 2) {
      x = __fdiv_rn(e, s);
    } else {
      x = __fmul_rn(e, __fdiv_rn(1.0f, s));
    }
    x = Add{}(x, eps);  // softmax(...) + eps: its own fused kernel

    // comb / (comb.sum(axis=-2) + eps): col_reduce_small, in order from 0.
    float t = 0.0f;
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      t = __fadd_rn(t, __shfl_sync(FULL, x, j * HC + c));
    }
    x = Divide{}(x, Add{}(t, eps));
    for (int it = 1; it < ITERS; ++it) {
      // comb / (comb.sum(axis=-1) + eps): row_reduce_simple, in order from 0.
      t = 0.0f;
#pragma unroll
      for (int j = 0; j < HC; ++j) {
        t = __fadd_rn(t, __shfl_sync(FULL, x, r * HC + j));
      }
      x = Divide{}(x, Add{}(t, eps));
      t = 0.0f;
#pragma unroll
      for (int j = 0; j < HC; ++j) {
        t = __fadd_rn(t, __shfl_sync(FULL, x, j * HC + c));
      }
      x = Divide{}(x, Add{}(t, eps));
    }
    if (lane < NC) {
      comb[(size_t)row * NC + lane] = x;
    }
  } else {
    // ---- warps 1..: pre (fused sigmoid + eps), then the eager weighted sum
    // (pre[..., None] * y).sum(axis=2) and astype(x.dtype).
    float p[HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
      p[i] = Add{}(Sigmoid{}(hc_affine<AFFINE>(mix[i], scale[0], base[i])), eps);
    }
    const T* xr = x_in + (size_t)row * HC * D;
    T* out = collapsed + (size_t)row * D;
    const unsigned step = blockDim.x - 32;
    for (unsigned d = tid - 32; d < (unsigned)D; d += step) {
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < HC; ++i) {
        float y = static_cast<float>(xr[i * D + d]);
        if constexpr (COLL == 1) {
          acc = __fmaf_rn(p[i], y, acc);
        } else {
          acc = __fadd_rn(acc, __fmul_rn(p[i], y));
        }
      }
      out[d] = static_cast<T>(acc);
    }
  }
"""

METAL_SOURCE = r"""
  // Template constants: T, U, HC, ITERS, D, EPS_INT (as upstream's _hc_kernel).
  uint tid  = thread_position_in_threadgroup.x;
  uint row  = threadgroup_position_in_grid.x;
  uint lane = tid % 32;
  uint sg   = tid / 32;

  constexpr int MIX      = (2 + HC) * HC;
  constexpr int BASE_OFF = 2 * HC;
  constexpr float EPS = EPS_INT * 1e-9;

  const device float* mix      = (const device float*)mixes + row * MIX;
  device float*       post_out = (device float*)post + row * HC;
  device float*       comb_out = (device float*)comb + row * HC * HC;

  const float pre_scale  = scale[0];
  const float post_scale = scale[1];
  const float comb_scale = scale[2];

  if (sg == 0) {
    // ---- simdgroup 0: upstream phase 1, statement for statement.
    const float active = (lane < (uint)HC) ? 1.0f : 0.0f;
    const uint  llane  = metal::min(lane, (uint)(HC - 1));

    float post_z = mix[HC + llane] * post_scale + base[HC + llane];
    float post_v = 2.0f / (1.0f + metal::fast::exp(-post_z));
    if (lane < (uint)HC) {
      post_out[lane] = post_v;
    }

    float4 v = (*(const device float4*)(mix  + BASE_OFF + llane * HC)
                    * comb_scale
              + *(const device float4*)(base + BASE_OFF + llane * HC))
             * active;

    float row_max = metal::max(metal::max(v.x, v.y),
                               metal::max(v.z, v.w));
    float4 e = metal::fast::exp(v - row_max) * active;
    float4 r = e * (1.0f / (e.x + e.y + e.z + e.w + EPS))
             + EPS * active;

    float4 col_inv = 1.0f / (float4(
        simd_sum(r.x), simd_sum(r.y),
        simd_sum(r.z), simd_sum(r.w)
    ) + EPS);
    r *= col_inv;

    for (int iter = 1; iter < ITERS; ++iter) {
      r *= (1.0f / (r.x + r.y + r.z + r.w + EPS)) * active;
      col_inv = 1.0f / (float4(
          simd_sum(r.x), simd_sum(r.y),
          simd_sum(r.z), simd_sum(r.w)
      ) + EPS);
      r *= col_inv;
    }

    if (lane < (uint)HC) {
      *(device float4*)(comb_out + lane * HC) = r;
    }
  } else {
    // ---- simdgroups 1..: pre (upstream's expression), then the collapse.
    float pv[HC];
    for (int i = 0; i < HC; ++i) {
      float pre_z = mix[i] * pre_scale + base[i];
      pv[i] = 1.0f / (1.0f + metal::fast::exp(-pre_z)) + EPS;
    }
    const float p0 = pv[0];
    const float p1 = pv[1];
    const float p2 = pv[2];
    const float p3 = pv[3];

    const device T* x_row  = (const device T*)x_in + row * (HC * D);
    device U*       out_row = (device U*)collapsed + row * D;

    using T4 = vec<T, 4>;
    using U4 = vec<U, 4>;
    const device T4* x_row0 = (const device T4*)(x_row + 0*D);
    const device T4* x_row1 = (const device T4*)(x_row + 1*D);
    const device T4* x_row2 = (const device T4*)(x_row + 2*D);
    const device T4* x_row3 = (const device T4*)(x_row + 3*D);
    device U4*       out4   = (device U4*)out_row;

    constexpr uint D4 = (uint)D / 4;
    const uint first = tid - 32;
    const uint step = threads_per_threadgroup.x - 32;

    for (uint d4 = first; d4 < D4; d4 += step) {
      float4 x0 = float4(x_row0[d4]);
      float4 x1 = float4(x_row1[d4]);
      float4 x2 = float4(x_row2[d4]);
      float4 x3 = float4(x_row3[d4]);

      float4 result = fma(float4(p0), x0,
                      fma(float4(p1), x1,
                      fma(float4(p2), x2, float4(p3) * x3)));

      out4[d4] = U4(result);
    }

    #if (D % 4) != 0
    for (uint d = D4 * 4 + first; d < (uint)D; d += step) {
      float val = p0*(float)x_row[0*D+d] + p1*(float)x_row[1*D+d]
                + p2*(float)x_row[2*D+d] + p3*(float)x_row[3*D+d];
      out_row[d] = (U)val;
    }
    #endif
  }
"""

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


KERNEL = dict(name="glm53_hc_sinkhorn_collapse", inputs=["x_in", "mixes", "scale", "base", "hc_eps"],
              outputs=["collapsed", "post", "comb"], cuda=(CUDA_SOURCE, CUDA_HEADER),
              metal=(METAL_SOURCE, "", ["x_in", "mixes", "scale", "base"]))


def unsupported(x, hc_mult, backend=None) -> Optional[str]:
    """Why the kernel does not cover a hyper-connection input ``x``, or None when it does."""
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if hc_mult != HC:
        return "hc_mult"
    if x.ndim != 4 or x.shape[2] != HC:
        return "shape"
    if x.dtype not in _FLOATS:
        return "dtype"
    if x.shape[0] * x.shape[1] == 0 or x.shape[3] == 0:
        return "empty"
    if backend == "metal" and x.shape[3] % 4:
        # upstream's Metal body (kept verbatim) vectorises by 4; its scalar tail
        # sits behind `#if (D % 4)`, which the preprocessor never enables.
        return "hidden size not a multiple of 4"
    return None


def hc_sinkhorn_collapse(
    x: mx.array,
    mixes: mx.array,
    scale: mx.array,
    base: mx.array,
    hc_mult: int,
    sinkhorn_iters: int,
    eps: float,
    *,
    backend: Optional[str] = None,
    variant: Tuple[int, int, int] = DEFAULT_VARIANT,
):
    """``[collapsed, post, comb]`` in one launch; check ``unsupported`` first."""
    backend = gpu_backend() if backend is None else backend
    reason = unsupported(x, hc_mult, backend)
    batch, length, _, hidden = x.shape
    if reason is None and mixes.shape != (batch, length, (2 + HC) * HC):
        reason = "mixes shape"
    if reason is None and (scale.shape != (3,) or base.shape != ((2 + HC) * HC,)):
        reason = "parameter shape"
    if reason is not None:
        raise ValueError(f"hc_sinkhorn kernel does not cover this call: {reason}")
    rows = batch * length
    output_shapes = [(batch, length, hidden), (batch, length, HC), (batch, length, HC, HC)]
    output_dtypes = [x.dtype, mx.float32, mx.float32]
    mixes, scale, base = (a.astype(mx.float32) for a in (mixes, scale, base))
    if backend == "cuda":
        affine, softmax, collapse = variant
        return gpu_kernel(backend="cuda", **KERNEL)(
            inputs=[x, mixes, scale, base, mx.array([compiled_constant(eps)], dtype=mx.float32)],
            template=[
                ("T", x.dtype),
                ("HC", HC),
                ("D", hidden),
                ("ITERS", sinkhorn_iters),
                ("AFFINE", affine),
                ("SMX", softmax),
                ("COLL", collapse),
            ],
            grid=(rows * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
        )
    if tuple(variant) != DEFAULT_VARIANT:
        raise ValueError("variants exist for the CUDA body only")
    return gpu_kernel(backend="metal", **KERNEL)(
        inputs=[x, mixes, scale, base],
        template=[
            ("T", x.dtype),
            ("U", x.dtype),
            ("HC", HC),
            ("ITERS", sinkhorn_iters),
            ("D", hidden),
            ("EPS_INT", round(eps / 1e-9)),
        ],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
    )

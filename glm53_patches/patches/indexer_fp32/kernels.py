"""The lightning-indexer score as one GPU launch: CUDA and Metal twins.

For every (batch, query, pool) the kernel computes, in float32,

    out = candidate ? sum_h max(q_h . k, 0) * ws_h : finfo(float32).min

with ``q [B, L, H, D]`` and ``keys [B, P, D]`` in the model dtype (float32,
bfloat16 or float16, converted to float32 in registers), ``ws = weights *
scale`` (float32 ``[B, L, H]``, computed by the caller exactly as stock does)
and the optional ``candidates [B, L, P]`` (bool). No ``[B, L, H, P]``
temporary, no float32 copies of q and keys, no separate mask kernel.

Layout: one warp (Metal: simdgroup) of 32 threads per (b, l, p); lane ``i``
owns heads ``i, i + 32, ...``: it accumulates ``q_h . k`` over D in order with
fused multiply-adds, applies the relu and the head weight, and the 32 lane
partials are summed by a butterfly (CUDA ``__shfl_xor_sync``) or ``simd_sum``
(Metal). All lanes read the same key element at a time (one broadcast load);
each lane walks its own q row, which L1 keeps for the warps of a block.

Numerics differ from stock's (cuBLAS / MPS float32 matmul, then a
reduction over heads): a different summation order and FMA contraction, so
scores move by a few float32 ulps and near-ties in the top-k can flip. The
patch therefore declares ``numerics="changing"``. ``quality.py`` emulates this
kernel's arithmetic on the CPU (``kernel_order_scores``) for the quality
figures; the kernels themselves have not been compiled or run anywhere yet
(no GPU, no Mac in the session that wrote them). They stay off unless
GLM53_INDEXER_FP32_KERNEL=1.
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend  # noqa: F401 (score.py and tests look it up here)
from glm53_patches.kernels.build import forget_kernels, gpu_kernel


LANES = 32  # threads per (query, pool): one warp / simdgroup
THREADS = 256  # per block / threadgroup: 8 (query, pool) pairs
_MAX_THREADS = 2**31 - 1  # MLX takes the grid as int
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

# Offsets are formed in 64 bits: B * L * P * 32 threads stays below 2^31
# (checked by `unsupported`), but element offsets into q grow as L * H * D.
CUDA_SOURCE = r"""
  // Template constants: T (q/keys dtype), H, D, HAS_MASK.
  const long long L = sizes[0];
  const long long P = sizes[1];
  const long long pairs = sizes[2];
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long pair = thread / 32;  // (b * L + l) * P + p
  const int lane = (int)(threadIdx.x % 32);
  // Whole warps leave together: the grid is a multiple of 32 threads and
  // MLX rounds it up to whole blocks, so the shuffles below see 32 lanes.
  if (pair >= pairs) {
    return;
  }
  const long long p = pair % P;
  const long long bl = pair / P;
  const long long b = bl / L;
  const T* krow = keys + (size_t)(b * P + p) * D;
  const T* qrow = q + (size_t)bl * (H * D);
  const float* w = ws + (size_t)bl * H;

  float partial = 0.0f;
  for (int h = lane; h < H; h += 32) {
    const T* qh = qrow + (size_t)h * D;
    float dot = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      dot = __fmaf_rn(static_cast<float>(qh[d]), static_cast<float>(krow[d]), dot);
    }
    // mx.maximum(x, 0) keeps a NaN; so does this (NaN < 0 is false).
    const float r = (dot < 0.0f) ? 0.0f : dot;
    partial = __fmaf_rn(r, w[h], partial);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    partial += __shfl_xor_sync(0xffffffffu, partial, offset);
  }
  if (lane == 0) {
    float value = partial;
    if constexpr (HAS_MASK) {
      if (!candidates[pair]) {
        value = -3.40282347e+38f;  // mx.finfo(mx.float32).min
      }
    }
    out[pair] = value;
  }
"""

METAL_SOURCE = r"""
  // Template constants: T (q/keys dtype), H, D, HAS_MASK.
  const ulong L = (ulong)sizes[0];
  const ulong P = (ulong)sizes[1];
  const ulong pairs = (ulong)sizes[2];
  const ulong pair = (ulong)thread_position_in_grid.x / 32;
  const uint lane = thread_index_in_simdgroup;
  // Whole simdgroups leave together (the grid is a multiple of 32 threads
  // and the threadgroup size too), so simd_sum below sees all 32 lanes.
  if (pair >= pairs) {
    return;
  }
  const ulong p = pair % P;
  const ulong bl = pair / P;
  const ulong b = bl / L;
  // `auto`: MLX passes inputs of fewer than 8 elements in the constant
  // address space, others in device; the pointers keep whichever it chose.
  auto krow = keys + (b * P + p) * D;
  auto qrow = q + bl * (ulong)(H * D);
  auto w = ws + bl * (ulong)H;

  float partial = 0.0f;
  for (int h = (int)lane; h < H; h += 32) {
    auto qh = qrow + (ulong)h * D;
    float dot = 0.0f;
    for (int d = 0; d < D; ++d) {
      dot = metal::fma(static_cast<float>(qh[d]), static_cast<float>(krow[d]), dot);
    }
    const float r = (dot < 0.0f) ? 0.0f : dot;  // keeps a NaN, as mx.maximum
    partial = metal::fma(r, w[h], partial);
  }
  partial = metal::simd_sum(partial);
  if (lane == 0) {
    float value = partial;
    if (HAS_MASK && !candidates[pair]) {
      value = -3.40282347e+38f;  // mx.finfo(mx.float32).min
    }
    out[pair] = value;
  }
"""

KERNEL = dict(name="glm53_indexer_fp32_scores", inputs=["q", "keys", "ws", "candidates", "sizes"], outputs=["out"],
              cuda=(CUDA_SOURCE, ""), metal=(METAL_SOURCE, ""))


def unsupported(q, keys, ws, candidates, max_queries) -> Optional[str]:
    """Why the kernel does not cover these inputs (shapes already checked), or None."""
    if q.dtype not in _FLOATS or keys.dtype != q.dtype:
        return "kernel dtype"
    if ws.dtype != mx.float32:
        return "kernel weights dtype"
    batch, length, _, _ = q.shape
    if length > max_queries:
        # Long chunks are a matmul's job: the kernel runs on CUDA cores without
        # tiling, while stock's cuBLAS/MPS matmul amortises loads (unmeasured).
        return "kernel queries"
    if batch * length * keys.shape[1] * LANES > _MAX_THREADS:
        return "kernel grid"
    return None


def scores(backend, q, keys, ws, candidates=None):
    """``[B, L, P]`` float32 scores (masked when ``candidates`` is given), one launch."""
    batch, length, heads, dim = q.shape
    pools = keys.shape[1]
    pairs = batch * length * pools
    has_mask = candidates is not None
    if not has_mask:
        candidates = mx.zeros((1,), dtype=mx.bool_)  # unread placeholder
    grid = pairs * LANES
    return gpu_kernel(backend=backend, **KERNEL)(
        inputs=[q, keys, ws, candidates, mx.array([length, pools, pairs], dtype=mx.int64)],
        template=[("T", q.dtype), ("H", heads), ("D", dim), ("HAS_MASK", has_mask)],
        grid=(grid, 1, 1),
        threadgroup=(min(THREADS, grid), 1, 1),
        output_shapes=[(batch, length, pools)],
        output_dtypes=[mx.float32],
    )[0]


def clear():
    forget_kernels(KERNEL["name"])

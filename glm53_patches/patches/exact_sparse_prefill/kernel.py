"""Two CUDA kernels for DSA sparse prefill attention, each bit for bit the stock ops it replaces.

Stock ``_sparse_prefill_attention`` off Metal, per 16-query chunk, gathers
each query's selected keys and values for every head into
``[B*chunk, H, topk, D]`` tensors and calls SDPA with a boolean mask. On CUDA
that SDPA is MLX's unfused fallback (the fused kernels take no array mask at
one query per row): ``q * scale``, ``matmul(q, k^T)``, ``where(mask, s,
finfo.min)``, ``softmax(precise=True)``, ``matmul(p, v)``.

* ``scores``: the gather of K and ``matmul(q, k^T)`` in one launch. With one
  query row that matmul is MLX's ``gemv`` (``mlx/backend/cuda/gemms/gemv.cu``):
  one warp per output, lane ``l`` accumulates columns ``NPT*l .. NPT*l+NPT-1``,
  then ``+32*NPT``, ..., as ``sum += float(k) * float(q)`` in float32 (an fma,
  as nvcc contracts it; ``FMA=0`` is the other reading, tried by ``verify``),
  then ``cg::reduce``'s xor tree from offset 16 down to 1; cast to the dtype.
  ``NPT`` is gemv's: 4 where D % 128 == 0, 2 where D % 64 == 0, else 1. The
  mask's ``where`` is applied to the same value. The K rows are read where
  they lie: nothing is gathered.
* ``gathered_values``: ``_sparse_head_gather(v, clip(idx))``, a copy. The
  ``matmul(p, v)`` after it is cuBLAS, whose algorithm depends on the shapes,
  so it stays stock's call on stock's shapes.
"""

import mlx.core as mx

from glm53_patches.kernels.build import gpu_kernel

DEFAULT_FMA = 1  # nvcc contracts gemv's `sum += a * b` into an fma; `verify` tries the other
SLOTS = 8  # selected keys one warp scores, so that several rows' loads are in flight
THREADS = 256
_FLOATS = (mx.bfloat16, mx.float16, mx.float32)

# Template constants: T (the dtype), H (heads), D (key dim), NPT, FMA.
SCORES_SOURCE = r"""
  constexpr unsigned FULL = 0xffffffffu;
  constexpr int COLS = 32 * NPT;  // the columns one pass of the warp covers
  constexpr int PASSES = (D + COLS - 1) / COLS;
  struct alignas(sizeof(T) * NPT) Pack { T v[NPT]; };
  const long long L = sizes[0], N = sizes[1], K = sizes[2], groups = sizes[3], warps = sizes[4];
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x % 32);
  if (warp >= warps) {  // whole warps leave: the grid is rounded up to whole blocks
    return;
  }
  const long long group = warp % groups;
  const long long row = warp / groups;  // (b L + i) H + h
  const int h = (int)(row % H);
  const long long bi = row / H;  // b L + i
  const long long b = bi / L, i = bi % L;

  // This lane's query values, as gemv's vector loads hold them.
  float qv[PASSES][NPT];
  const T* qrow = qs + (((size_t)b * H + h) * L + i) * D;
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    const int col = p * COLS + NPT * lane;
#pragma unroll
    for (int j = 0; j < NPT; ++j) {
      qv[p][j] = col < D ? static_cast<float>(qrow[col + j]) : 0.0f;
    }
  }
  const T* kbase = k + ((size_t)b * H + h) * N * D;
  const int* irow = idx + (size_t)bi * K;
  T* orow = scores + (size_t)row * K;
#pragma unroll
  for (int s = 0; s < SLOTS; ++s) {
    const long long j = group * SLOTS + s;
    if (j >= K) {
      break;
    }
    const int id = irow[j];
    float sum = 0.0f;
    const bool valid = id >= 0 && id < N;  // the same for the whole warp
    if (valid) {
      const T* krow = kbase + (size_t)id * D;
#pragma unroll
      for (int p = 0; p < PASSES; ++p) {
        const int col = p * COLS + NPT * lane;
        if (col < D) {
          const Pack kv = *reinterpret_cast<const Pack*>(krow + col);
#pragma unroll
          for (int jj = 0; jj < NPT; ++jj) {
            const float kf = static_cast<float>(kv.v[jj]);
            sum = FMA ? __fmaf_rn(kf, qv[p][jj], sum) : __fadd_rn(sum, __fmul_rn(kf, qv[p][jj]));
          }
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        sum = __fadd_rn(sum, __shfl_xor_sync(FULL, sum, off));
      }
    }
    if (lane == 0) {
      orow[j] = valid ? static_cast<T>(sum) : lowest[0];
    }
  }
"""

# Template constants: T, H, DV (value dim), VEC (elements per thread).
GATHER_SOURCE = r"""
  struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };
  const long long C = sizes[0], N = sizes[1], K = sizes[2], total = sizes[3];
  const long long at = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // one Pack of the output
  if (at >= total) {
    return;
  }
  constexpr int PER_ROW = DV / VEC;
  const long long slot = at / PER_ROW;  // ((b C + i) H + h) K + j
  const int d = (int)(at % PER_ROW) * VEC;
  const long long j = slot % K;
  const long long row = slot / K;
  const int h = (int)(row % H);
  const long long bi = row / H;  // b C + i
  const long long b = bi / C;
  int id = idx[(size_t)bi * K + j];
  id = id < 0 ? 0 : (id > N - 1 ? (int)(N - 1) : id);  // stock's clip(idx, 0, N - 1)
  const T* src = v + (((size_t)b * H + h) * N + id) * DV + d;
  *reinterpret_cast<Pack*>(out + (size_t)slot * DV + d) = *reinterpret_cast<const Pack*>(src);
"""

SCORES = dict(name="glm53_exact_sparse_scores", inputs=["qs", "k", "idx", "lowest", "sizes"], outputs=["scores"],
              cuda=(SCORES_SOURCE, ""))
GATHER = dict(name="glm53_exact_sparse_gather", inputs=["v", "idx", "sizes"], outputs=["out"],
              cuda=(GATHER_SOURCE, ""))


def gemv_per_thread(dim: int) -> int:
    """MLX gemv's values per lane and pass for a reduction of ``dim`` (its pointers are aligned here)."""
    return 4 if dim % 128 == 0 else 2 if dim % 64 == 0 else 1


def scores(qs, k, idx, *, fma=None):
    """``where(valid, matmul(qs_row, gather(k, idx)^T), finfo.min)`` for every query row and head.

    qs: [B, H, L, D] (the scaled queries), k: [B, H, N, D], idx: [B, L, topk]
    int32; returns [B, L, H, topk] in qs's dtype. Contiguous inputs (MLX copies
    others when it launches).
    """
    B, H, L, D = qs.shape
    N, K = k.shape[2], idx.shape[-1]
    groups = -(-K // SLOTS)
    warps = B * L * H * groups
    return gpu_kernel(backend="cuda", **SCORES)(
        inputs=[qs, k, idx, mx.array(mx.finfo(qs.dtype).min, dtype=qs.dtype), mx.array([L, N, K, groups, warps], dtype=mx.int64)],
        template=[("T", qs.dtype), ("H", H), ("D", D), ("NPT", gemv_per_thread(D)), ("FMA", int(DEFAULT_FMA if fma is None else fma)), ("SLOTS", SLOTS)],
        grid=(warps * 32, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, L, H, K)],
        output_dtypes=[qs.dtype],
    )[0]


def gathered_values(v, idx):
    """Stock's ``_sparse_head_gather(v, clip(idx, 0, N - 1))``: [B*C, H, topk, Dv] from v [B, H, N, Dv], idx [B, C, topk]."""
    B, H, N, Dv = v.shape
    C, K = idx.shape[1:]
    width = 16 // v.dtype.size
    vec = width if Dv % width == 0 else 1
    total = B * C * H * K * Dv // vec
    return gpu_kernel(backend="cuda", **GATHER)(
        inputs=[v, idx, mx.array([C, N, K, total], dtype=mx.int64)],
        template=[("T", v.dtype), ("H", H), ("DV", Dv), ("VEC", vec)],
        grid=(total, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B * C, H, K, Dv)],
        output_dtypes=[v.dtype],
    )[0]

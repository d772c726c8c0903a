"""The indexer's decode selection as one GPU launch: pools -> top-k key positions, with the tail.

After the pool scores of one decode token exist, stock (and ``decode_topk``'s
compiled path) still runs about 25 small kernels per row: the first valid
key and the visible count over the key-validity row, the candidate mask, a
full sort of the pools standing in for ``argpartition``, the chronological
re-sort, the expansion to key positions, the ``-1`` padding and the tail.
Here one warp (simdgroup) per batch row does all of it:

1. first valid key and visible count: a pass over the key-validity row;
2. each pool's sort key: ``-(candidate ? score : finfo(float32).min)``, as a
   32-bit integer in MLX's ``LessThan`` order (NaN last, -0 == +0);
3. the ``select_k``-th smallest key by a 32-step bitwise search, each step a
   counting pass; the selected set is every pool below it plus the first
   pools equal to it in index order (the set a stable sort's first
   ``select_k`` hold; only the set matters, since stock re-sorts it by pool);
4. a ballot compaction writes the valid selected pools' key positions in
   pool order, then ``-1`` up to ``topk``, then the tail (``kpool - 1`` keys
   after the last whole pool, ``-1`` where not visible).

Integers and comparisons only: no rounding. The selected set equals stock's
where stock's argpartition is a stable sort (MLX 0.32.x CUDA; checked there
by ``glm53-patches verify dsa_decode``). The Metal twin has not run on any
Mac yet.
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.kernels import hc_sinkhorn

gpu_backend = hc_sinkhorn.gpu_backend

LANES = 32
# One warp per row makes 32 counting passes over the pools: on the H200 the
# kernel beat the compiled path at 1,024 pools (16k keys, 1.39x) and lost at
# 2,048 (32k keys, 0.80x), so longer contexts keep the compiled path.
MAX_POOLS = 1024

# One body for CUDA, Metal and the host check; SEL_* macros are the backend's primitives.
SELECT_BODY = r"""
  // Template constants: KPOOL, TOPK, TAIL. dims = [T (keys), P (pools), K (select_k)].
  const int b = (int)SEL_ROW;
  const int lane = (int)SEL_LANE;
  const int T = dims[0];
  const int P = dims[1];
  const int K = dims[2];
  SEL_DEVICE const bool* kv = key_valid + (size_t)b * T;
  SEL_DEVICE const float* sc = scores + (size_t)b * P;
  SEL_DEVICE int* out = topk + (size_t)b * (TOPK + TAIL);
  const unsigned below = (1u << lane) - 1u;

  // 1. first valid key (T if none) and the number of valid keys.
  int first = T;
  int count = 0;
  for (int t = lane; t < T; t += 32) {
    if (kv[t]) {
      first = t < first ? t : first;
      count += 1;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const int other = SEL_SHFL_XOR(first, off);
    first = other < first ? other : first;
    count += SEL_SHFL_XOR(count, off);
  }
  if (!query_valid[b]) {
    for (int s = lane; s < TOPK + TAIL; s += 32) {
      out[s] = -1;
    }
    return;
  }
  const int limit = pool_limit[b];
  const int last = T - 1 > 0 ? T - 1 : 0;

  // 3. the K-th smallest sort key: the largest r with #(key < r) < K.
  unsigned r = 0u;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned trial = r | (1u << bit);
    int c = 0;
    for (int p = lane; p < P; p += 32) {
      c += pool_sort_key(sc[p], pool_candidate(p, first, limit, T, last, KPOOL)) < trial ? 1 : 0;
    }
    for (int off = 16; off > 0; off >>= 1) {
      c += SEL_SHFL_XOR(c, off);
    }
    if (c < K) {
      r = trial;
    }
  }
  int less = 0;
  for (int p = lane; p < P; p += 32) {
    less += pool_sort_key(sc[p], pool_candidate(p, first, limit, T, last, KPOOL)) < r ? 1 : 0;
  }
  for (int off = 16; off > 0; off >>= 1) {
    less += SEL_SHFL_XOR(less, off);
  }
  const int equal_wanted = K - less;

  // 4. selected = key < r, or key == r among the first equal_wanted in pool
  // order; the valid ones' key positions in pool order, then -1, then the tail.
  int written = 0;
  int equal_seen = 0;
  for (int base = 0; base < P; base += 32) {
    const int p = base + lane;
    const bool inside = p < P;
    const bool cand = inside && pool_candidate(p, first, limit, T, last, KPOOL);
    const unsigned key = inside ? pool_sort_key(sc[p], cand) : 0xffffffffu;
    const bool is_less = inside && key < r;
    const bool is_equal = inside && key == r;
    const unsigned equal_mask = SEL_BALLOT(is_equal);
    const bool chosen = is_less || (is_equal && equal_seen + (int)SEL_POPC(equal_mask & below) < equal_wanted);
    equal_seen += (int)SEL_POPC(equal_mask);
    const bool valid = chosen && cand;
    const unsigned valid_mask = SEL_BALLOT(valid);
    if (valid) {
      const int slot = written + (int)SEL_POPC(valid_mask & below);
      for (int j = 0; j < KPOOL; ++j) {
        out[slot * KPOOL + j] = first + p * KPOOL + j;
      }
    }
    written += (int)SEL_POPC(valid_mask);
  }
  for (int s = written * KPOOL + lane; s < TOPK; s += 32) {
    out[s] = -1;
  }
  const int tail_count = count % KPOOL;
  for (int j = lane; j < TAIL; j += 32) {
    const int t = first + count - tail_count + j;
    const int safe = t < 0 ? 0 : (t > last ? last : t);
    out[TOPK + j] = (j < tail_count && t < T && kv[safe]) ? t : -1;
  }
"""

# Stock's candidate test and sort key, shared by the bodies.
HELPERS = r"""
// Pool p is a candidate if the pool cache holds it and its last key is visible.
SEL_INLINE bool pool_candidate(int p, int first, int limit, int T, int last, int kpool) {
  int end = first + p * kpool + kpool - 1;
  end = end < 0 ? 0 : (end > last ? last : end);
  return p < limit && end <= T - 1;
}

// -(candidate ? score : finfo(float32).min) as an unsigned key whose order is
// MLX's LessThan: ascending floats, -0 == +0, every NaN last (and equal).
SEL_INLINE unsigned pool_sort_key(float score, bool candidate) {
  const float v = -(candidate ? score : -3.40282346638528859811704183484516925e+38f);
  if (v != v) return 0xffffffffu;
  if (v == 0.0f) return 0x80000000u;
  const unsigned bits = SEL_AS_UINT(v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
"""

CUDA_SOURCE = (
    r"""
#define SEL_ROW blockIdx.x
#define SEL_LANE threadIdx.x
#define SEL_DEVICE
#define SEL_SHFL_XOR(v, off) __shfl_xor_sync(0xffffffffu, v, off)
#define SEL_BALLOT(x) __ballot_sync(0xffffffffu, x)
#define SEL_POPC(x) __popc(x)
"""
    + SELECT_BODY
)
CUDA_HEADER = "#define SEL_INLINE __device__ __forceinline__\n#define SEL_AS_UINT(v) __float_as_uint(v)\n" + HELPERS

METAL_SOURCE = (
    r"""
#define SEL_ROW threadgroup_position_in_grid.x
#define SEL_LANE thread_position_in_threadgroup.x
#define SEL_DEVICE device
#define SEL_SHFL_XOR(v, off) simd_shuffle_xor(v, (ushort)(off))
#define SEL_BALLOT(x) ((uint)(ulong)simd_ballot(x))
#define SEL_POPC(x) popcount(x)
"""
    + SELECT_BODY
)
METAL_HEADER = "#define SEL_INLINE inline\n#define SEL_AS_UINT(v) as_type<uint>(v)\n" + HELPERS

_kernels = {}


def _kernel(backend: str):
    kernel = _kernels.get(backend)
    if kernel is None:
        common = dict(
            name="glm53_dsa_select",
            input_names=["scores", "key_valid", "pool_limit", "query_valid", "dims"],
            output_names=["topk"],
            ensure_row_contiguous=True,
        )
        if backend == "cuda":
            kernel = mx.fast.cuda_kernel(source=CUDA_SOURCE, header=CUDA_HEADER, **common)
        elif backend == "metal":
            kernel = mx.fast.metal_kernel(source=METAL_SOURCE, header=METAL_HEADER, **common)
        else:
            raise ValueError(f"no dsa_select kernel for backend {backend!r}")
        _kernels[backend] = kernel
    return kernel


def unsupported(pool_count, key_count, score_dtype=mx.float32, backend=None) -> Optional[str]:
    """Why the kernel does not cover a selection over these pools and keys, or None when it does."""
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if score_dtype != mx.float32:
        return "score dtype"
    if key_count == 0 or pool_count == 0:
        return "empty"
    if pool_count > MAX_POOLS:
        return "more pools than the kernel is faster for"
    return None


def select_topk(scores, key_valid, pool_limit, query_valid, select_k, *, kpool, topk, tail_width, backend=None):
    """``[B, 1, topk + tail_width]`` int32 key positions, as stock's indexer returns them at decode.

    scores: [B, P] float32 (any values when ``select_k == P``: every pool is
    selected); key_valid: [B, T] bool; pool_limit: [B] int32 (pools the cache
    holds); query_valid: [B] bool.
    """
    backend = gpu_backend() if backend is None else backend
    batch, pools = scores.shape
    dims = mx.array([key_valid.shape[1], pools, select_k], dtype=mx.int32)
    return _kernel(backend)(
        inputs=[scores, key_valid, pool_limit, query_valid, dims],
        template=[("KPOOL", kpool), ("TOPK", topk), ("TAIL", tail_width)],
        grid=(batch * LANES, 1, 1),
        threadgroup=(LANES, 1, 1),
        output_shapes=[(batch, 1, topk + tail_width)],
        output_dtypes=[mx.int32],
    )[0]

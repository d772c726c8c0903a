"""The indexer's decode selection as one GPU launch: pools -> top-k key positions, with the tail.

After the pool scores of a decode token (or of each position of a short
speculative verify block) exist, stock (and ``decode_topk``'s compiled path)
still runs about 25 small kernels: the first valid key and the visible count
over the key-validity row, the candidate mask, a full sort of the pools
standing in for ``argpartition``, the chronological re-sort, the expansion to
key positions, the ``-1`` padding and the tail. Here one block (threadgroup)
of ``WARPS`` warps per (batch row, block position) does all of it. Position
``i`` of an ``L``-token block is key ``T - L + i``: a pool is a candidate only
where its last key (clipped to the row's last key, as stock clips it) is at
most that key, and the block's later valid keys are not visible to it
(``L = 1``, a decode token: every pool the cache holds, every valid key):

1. first valid key and visible count: one pass over the key-validity row,
   shared by the block's threads, then block reductions;
2. each pool's sort key, once, into shared memory:
   ``-(candidate ? score : finfo(float32).min)`` as a 32-bit integer in MLX's
   ``LessThan`` order (NaN last, -0 == +0);
3. the ``select_k``-th smallest key ``r`` by a 32-step bitwise search, each
   step a counting pass over the shared keys; the selected set is every pool
   below ``r`` plus the first pools equal to it in index order (the set a
   stable sort's first ``select_k`` hold; only the set matters, since stock
   re-sorts it by pool);
4. a compaction over chunks of one pool per thread (ballots within each
   warp, the warps' counts through shared memory, a running offset across
   chunks) writes the valid selected pools' key positions in pool order,
   then ``-1`` up to ``topk``, then the tail (``kpool - 1`` keys after the
   last whole pool, ``-1`` where not visible).

Integers and comparisons only: no rounding. The selected set equals stock's
where stock's argpartition is a stable sort (MLX 0.32.x CUDA).
``glm53-patches verify dsa_decode`` checks it on the machine it runs on; its
body also runs on the host (``checks/host_check.py``), and the Metal twin
has not run on any Mac.
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import gpu_kernel


# Warps per block, one block per batch row. At 32 warps (1,024 threads) nvcc
# needs more registers per thread than such a block may have.
WARPS = 8
# The sort keys live in shared memory, 4 bytes a pool: CUDA gives a block 48 KB
# of static shared memory; Apple GPUs 32 KB of threadgroup memory, which must
# also hold the reduction scratch. Longer contexts use the compiled path.
MAX_POOLS = 8192
METAL_MAX_POOLS = MAX_POOLS - 64

# One body for CUDA, Metal and the host check; SEL_* macros are the backend's
# primitives (the header's) and thread indices (the source's: Metal adds a
# thread attribute to the kernel's signature only where the source names it).
SELECT_BODY = r"""
  // Template constants: KPOOL, TOPK, TAIL, WARPS. dims = [T (keys), P (pools), K (select_k), L (positions)].
  constexpr int THREADS = 32 * WARPS;
  SEL_SHARED unsigned keys[SEL_KEYS];  // each pool's sort key
  SEL_SHARED int scratch[WARPS];       // one value per warp, for the block's reductions and prefixes
  const int row = (int)SEL_ROW;        // batch row b, block position i
  const int lane = (int)SEL_LANE;
  const int warp = (int)SEL_WARP;
  const int tid = warp * 32 + lane;    // pool order within a chunk is warp-major, as the ballots count it
  const int T = dims[0];
  const int P = dims[1];
  const int K = dims[2];
  const int L = dims[3];
  const int b = row / L;
  const int i = row - b * L;
  // auto: Metal passes an input of fewer than 8 elements in the constant address space, others in device.
  const auto kv = key_valid + (size_t)b * T;
  const auto sc = scores + (size_t)row * P;
  const auto out = topk + (size_t)row * (TOPK + TAIL);
  const unsigned below = (1u << lane) - 1u;

  if (!query_valid[row]) {  // the same in every thread: the block leaves together
    for (int s = tid; s < TOPK + TAIL; s += THREADS) {
      out[s] = -1;
    }
    return;
  }

  // 1. first valid key (T if none) and the number of valid keys. Eight loads
  // in flight per thread (unconditional: a clamped index), as one at a time a
  // 128k-key row would wait on memory latency.
  int first = T;
  int count = 0;
  for (int t0 = tid; t0 < T; t0 += 8 * THREADS) {
    bool v[8];
    for (int j = 0; j < 8; ++j) {
      const int t = t0 + j * THREADS;
      v[j] = kv[t < T ? t : T - 1];
    }
    for (int j = 0; j < 8; ++j) {
      const int t = t0 + j * THREADS;
      const bool valid = v[j] && t < T;
      first = valid && t < first ? t : first;
      count += valid ? 1 : 0;
    }
  }
  first = sel_block_min(first, scratch, lane, warp, WARPS);
  count = sel_block_sum(count, scratch, lane, warp, WARPS);
  for (int j = i + 1; j < L; ++j) {  // the block's valid keys after this position: not yet visible
    count -= query_valid[b * L + j] ? 1 : 0;
  }
  const int limit = pool_limit[b];
  const int last = T - 1 > 0 ? T - 1 : 0;
  const int position = T - L + i;      // this position's key

  // 2. each pool's sort key, once (the search below reads it 34 times); four
  // score loads in flight per thread.
  for (int p0 = tid; p0 < P; p0 += 4 * THREADS) {
    float s[4];
    for (int j = 0; j < 4; ++j) {
      const int p = p0 + j * THREADS;
      s[j] = sc[p < P ? p : P - 1];
    }
    for (int j = 0; j < 4; ++j) {
      const int p = p0 + j * THREADS;
      if (p < P) {
        keys[p] = pool_sort_key(s[j], pool_candidate(p, first, limit, position, last, KPOOL));
      }
    }
  }
  SEL_BARRIER();

  // 3. the K-th smallest sort key: the largest r with #(key < r) < K.
  unsigned r = 0u;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned trial = r | (1u << bit);
    int c = 0;
    for (int p = tid; p < P; p += THREADS) {
      c += keys[p] < trial ? 1 : 0;
    }
    if (sel_block_sum(c, scratch, lane, warp, WARPS) < K) {
      r = trial;
    }
  }
  int less = 0;
  int equal = 0;
  for (int p = tid; p < P; p += THREADS) {
    less += keys[p] < r ? 1 : 0;
    equal += keys[p] == r ? 1 : 0;
  }
  less = sel_block_sum(less, scratch, lane, warp, WARPS);
  equal = sel_block_sum(equal, scratch, lane, warp, WARPS);
  const int equal_wanted = K - less;
  // More pools equal r than are wanted: take the first equal_wanted in pool order.
  const bool ties = equal > equal_wanted;

  // 4. selected = key < r, or key == r among the first equal_wanted in pool
  // order; the valid ones' key positions in pool order, then -1, then the tail.
  // A chunk is one pool per thread; `written` and `equal_seen` carry the counts
  // of the chunks before, the same in every thread.
  int written = 0;
  int equal_seen = 0;
  for (int base = 0; base < P; base += THREADS) {
    const int p = base + tid;
    const bool inside = p < P;
    const unsigned key = inside ? keys[p] : 0xffffffffu;
    const bool is_less = inside && key < r;
    const bool is_equal = inside && key == r;
    bool chosen = is_less || is_equal;
    if (ties) {
      const unsigned equal_mask = SEL_BALLOT(is_equal);
      if (lane == 0) {
        scratch[warp] = (int)SEL_POPC(equal_mask);
      }
      SEL_BARRIER();
      int rank = equal_seen + (int)SEL_POPC(equal_mask & below);
      for (int w = 0; w < WARPS; ++w) {
        rank += w < warp ? scratch[w] : 0;
        equal_seen += scratch[w];
      }
      SEL_BARRIER();  // scratch is written again below
      chosen = is_less || (is_equal && rank < equal_wanted);
    }
    const bool valid = chosen && pool_candidate(p, first, limit, position, last, KPOOL);
    const unsigned valid_mask = SEL_BALLOT(valid);
    if (lane == 0) {
      scratch[warp] = (int)SEL_POPC(valid_mask);
    }
    SEL_BARRIER();
    int slot = written + (int)SEL_POPC(valid_mask & below);
    for (int w = 0; w < WARPS; ++w) {
      slot += w < warp ? scratch[w] : 0;
      written += scratch[w];
    }
    SEL_BARRIER();  // scratch is written again by the next chunk
    if (valid) {
      for (int j = 0; j < KPOOL; ++j) {
        out[slot * KPOOL + j] = first + p * KPOOL + j;
      }
    }
  }
  for (int s = written * KPOOL + tid; s < TOPK; s += THREADS) {
    out[s] = -1;
  }
  const int tail_count = count % KPOOL;
  for (int j = tid; j < TAIL; j += THREADS) {
    const int t = first + count - tail_count + j;
    const int safe = t < 0 ? 0 : (t > last ? last : t);
    out[TOPK + j] = (j < tail_count && t < T && kv[safe]) ? t : -1;
  }
"""

# Stock's candidate test and sort key, and the block reductions, shared by the bodies.
HELPERS = r"""
// Pool p is a candidate if the pool cache holds it and its last key, clipped
// to the row's last key, is at most the query's key.
SEL_INLINE bool pool_candidate(int p, int first, int limit, int position, int last, int kpool) {
  int end = first + p * kpool + kpool - 1;
  end = end < 0 ? 0 : (end > last ? last : end);
  return p < limit && end <= position;
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

// v summed (or the minimum) over the block, in every thread: shuffles within
// each warp, then the warps' results through scratch. Every thread calls it.
SEL_INLINE int sel_block_reduce(int v, bool minimum, SEL_SHARED_PTR int* scratch, int lane, int warp, int warps) {
  for (int off = 16; off > 0; off >>= 1) {
    const int other = SEL_SHFL_XOR(v, off);
    v = minimum ? (other < v ? other : v) : v + other;
  }
  if (lane == 0) {
    scratch[warp] = v;
  }
  SEL_BARRIER();
  int result = scratch[0];
  for (int w = 1; w < warps; ++w) {
    result = minimum ? (scratch[w] < result ? scratch[w] : result) : result + scratch[w];
  }
  SEL_BARRIER();  // scratch is written again by the next call
  return result;
}

SEL_INLINE int sel_block_sum(int v, SEL_SHARED_PTR int* scratch, int lane, int warp, int warps) {
  return sel_block_reduce(v, false, scratch, lane, warp, warps);
}

SEL_INLINE int sel_block_min(int v, SEL_SHARED_PTR int* scratch, int lane, int warp, int warps) {
  return sel_block_reduce(v, true, scratch, lane, warp, warps);
}
"""

CUDA_HEADER = (
    r"""
#define SEL_INLINE __device__ __forceinline__
#define SEL_AS_UINT(v) __float_as_uint(v)
#define SEL_SHFL_XOR(v, off) __shfl_xor_sync(0xffffffffu, v, off)
#define SEL_BALLOT(x) __ballot_sync(0xffffffffu, x)
#define SEL_POPC(x) __popc(x)
#define SEL_BARRIER() __syncthreads()
#define SEL_SHARED __shared__
#define SEL_SHARED_PTR
"""
    + f"#define SEL_KEYS {MAX_POOLS}\n"
    + HELPERS
)
CUDA_SOURCE = (
    r"""
#define SEL_ROW blockIdx.x
#define SEL_LANE (threadIdx.x & 31u)
#define SEL_WARP (threadIdx.x >> 5)
"""
    + SELECT_BODY
)

METAL_HEADER = (
    r"""
#define SEL_INLINE inline
#define SEL_AS_UINT(v) as_type<uint>(v)
#define SEL_SHFL_XOR(v, off) simd_shuffle_xor(v, (ushort)(off))
#define SEL_BALLOT(x) ((uint)(ulong)simd_ballot(x))
#define SEL_POPC(x) popcount(x)
#define SEL_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SEL_SHARED threadgroup
#define SEL_SHARED_PTR threadgroup
"""
    + f"#define SEL_KEYS {METAL_MAX_POOLS}\n"
    + HELPERS
)
METAL_SOURCE = (
    r"""
#define SEL_ROW threadgroup_position_in_grid.x
#define SEL_LANE thread_index_in_simdgroup
#define SEL_WARP simdgroup_index_in_threadgroup
"""
    + SELECT_BODY
)

KERNEL = dict(name="glm53_dsa_select", inputs=["scores", "key_valid", "pool_limit", "query_valid", "dims"],
              outputs=["topk"], cuda=(CUDA_SOURCE, CUDA_HEADER), metal=(METAL_SOURCE, METAL_HEADER))


def unsupported(pool_count, key_count, score_dtype=mx.float32, backend=None) -> Optional[str]:
    """Why the kernel does not cover a selection over these pools and keys, or None when it does."""
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if score_dtype != mx.float32:
        return "score dtype"
    if key_count == 0 or pool_count == 0:
        return "empty"
    if pool_count > (METAL_MAX_POOLS if backend == "metal" else MAX_POOLS):
        return "more pools than the kernel's shared memory holds"
    return None


def select_topk(scores, key_valid, pool_limit, query_valid, select_k, *, kpool, topk, tail_width, backend=None):
    """``[B, L, topk + tail_width]`` int32 key positions, as stock's indexer returns them for a decode token
    (L = 1) or each position of a short block, whose keys are the last L.

    scores: [B, L, P] float32 (any values when ``select_k == P``: every pool
    is selected); key_valid: [B, T] bool; pool_limit: [B] int32 (pools the
    cache holds); query_valid: [B, L] bool.
    """
    backend = gpu_backend() if backend is None else backend
    batch, length, pools = scores.shape
    dims = mx.array([key_valid.shape[1], pools, select_k, length], dtype=mx.int32)
    threads = 32 * WARPS
    return gpu_kernel(backend=backend, **KERNEL)(
        inputs=[scores, key_valid, pool_limit, query_valid, dims],
        template=[("KPOOL", kpool), ("TOPK", topk), ("TAIL", tail_width), ("WARPS", WARPS)],
        grid=(batch * length * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(batch, length, topk + tail_width)],
        output_dtypes=[mx.int32],
    )[0]

"""dsa_decode's Metal selection kernel against stock's decode selection on Metal, op by op.

After the pool scores, stock's indexer (``dsa_decode.decode``'s compiled
path repeats stock's calls in stock's order; tests/numerics/test_dsa_decode.py
checks it against the stock indexer) is a chain of MLX ops on integers and
one float comparison: the first valid key and the visible count (per
position of a short block: less the block's later keys), the candidate mask
(a block position's: pools whose clipped last key is at most its own key), ``where(candidates, scores, finfo(float32).min)``,
``argpartition(-scores)`` (the one step whose order a backend decides:
MLX's Metal backend runs it as its merge sort, sort.cpp ``ArgPartition``
-> ``gpu_merge_sort``, kernels/sort.h; one block up to 2,048 values, several
merged blocks above), the first ``select_k``, ``argsort`` of them by pool
(the same sort, on int32), the expansion to key positions, ``-1``, the tail.
Here the two sorts run sort.h's text, launched as sort.cpp launches it, and
the integer ops as loops; the twin's output is compared element for element.
"""

import numpy as np

import mlx.core as mx

from . import ARGSORT, PRELUDE, argsort_call, excerpt, execute, generated, launch, sort_text

PROGRAM = r"""
%(stock)s
%(argsort)s
%(twin)s
// argsort through the mlx_argsort instance sort.cpp picks for the row size (built for the sizes asked).
template <class T> void sort_rows(const T* in, uint* out, int rows, int size) {
%(dispatch)s
  std::fprintf(stderr, "no sort instance for %%d values\n", size);
  std::exit(3);
}

int main(int argc, char** argv) {
  constexpr int KPOOL = %(KPOOL)d, TOPK = %(TOPK)d, TAIL = %(TAIL)d, W = TOPK + TAIL;
  auto sizes = load<int>(argv[1], 5);  // B, L (positions), T (keys), P (pools), K (select_k)
  const int B = sizes[0], L = sizes[1], T = sizes[2], P = sizes[3], K = sizes[4];
  const int R = B * L;  // a row per (batch row, position)
  auto scores = load<float>(argv[2], R * P);
  auto kv_bytes = load<uint8_t>(argv[3], B * T);
  auto pool_limit = load<int>(argv[4], B);
  auto qv_bytes = load<uint8_t>(argv[5], R);
  auto dims = load<int>(argv[6], 4);  // the twin's: T, P, K, L
  const bool* key_valid = reinterpret_cast<const bool*>(kv_bytes.data());
  const bool* query_valid = reinterpret_cast<const bool*>(qv_bytes.data());
  auto stock = poisoned<int>(R * W, STOCK), twin = poisoned<int>(R * W, TWIN);

  // The first valid key (T if none); per position the visible count (all valid keys, less the block's
  // after it: sum - sum(block) + cumsum(block)) and the candidate pools (clipped end <= its key).
  std::vector<int> first(B), count(R);
  std::vector<char> candidate(R * P);
  const int last = T - 1 > 0 ? T - 1 : 0;
  for (int b = 0; b < B; ++b) {
    first[b] = T;
    int valid = 0;
    for (int t = T - 1; t >= 0; --t)
      if (key_valid[b * T + t]) first[b] = t, ++valid;
    for (int i = 0; i < L; ++i) {
      const int r = b * L + i;
      count[r] = valid;
      for (int j = i + 1; j < L; ++j) count[r] -= query_valid[b * L + j] ? 1 : 0;
      for (int p = 0; p < P; ++p) {
        int end = first[b] + p * KPOOL + (KPOOL - 1);
        end = end < 0 ? 0 : (end > last ? last : end);
        candidate[r * P + p] = p < pool_limit[b] && end <= T - L + i;
      }
    }
  }
  // argpartition(-where(candidates, scores, finfo.min), K - 1)[..., :K]: the sort's first K.
  std::vector<int> selected(R * K);
  if (K == P) {
    for (int i = 0; i < R * K; ++i) selected[i] = i %% K;
  } else {
    std::vector<float> keys(R * P);
    std::vector<uint> order(R * P);
    for (int i = 0; i < R * P; ++i) keys[i] = Negative()(candidate[i] ? scores[i] : -3.40282346638528859811704183484516925e+38f);
    sort_rows<float>(keys.data(), order.data(), R, P);
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < K; ++k) selected[r * K + k] = int(order[r * P + k]);
  }
  // Chronological order: argsort(where(valid, selected, P)); expansion, -1, tail; a padded query is -1.
  std::vector<int> by_pool(R * K);
  std::vector<uint> order(R * K);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) {
      const int s = selected[r * K + k];
      by_pool[r * K + k] = candidate[r * P + s] ? s : P;
    }
  if (K > 0) sort_rows<int>(by_pool.data(), order.data(), R, K);
  for (int r = 0; r < R; ++r) {
    const int b = r / L;
    int* out = stock.data() + r * W;
    for (int s = 0; s < W; ++s) out[s] = -1;
    if (!query_valid[r]) continue;
    for (int k = 0; k < K; ++k) {
      const int s = selected[r * K + order[r * K + k]];
      const int safe = s < 0 ? 0 : (s > (P - 1 > 0 ? P - 1 : 0) ? (P - 1 > 0 ? P - 1 : 0) : s);
      for (int j = 0; j < KPOOL && k * KPOOL + j < TOPK; ++j)
        out[k * KPOOL + j] = candidate[r * P + s] ? first[b] + safe * KPOOL + j : -1;
    }
    const int tail_count = count[r] %% KPOOL;
    for (int j = 0; j < TAIL; ++j) {
      const int t = first[b] + count[r] - tail_count + j;
      const int at = t < 0 ? 0 : (t > last ? last : t);
      out[TOPK + j] = j < tail_count && t < T && key_valid[b * T + at] ? t : -1;
    }
  }

  // The twin, as the patch launches it: one threadgroup of WARPS simdgroups per row and position.
  msl_run({uint(R) * %(THREADS)d, 1, 1}, {%(THREADS)d, 1, 1}, [&] { %(call)s; });
  save(argv[7], stock);
  save(argv[8], twin);
  return 0;
}
"""


def stock_text():
    return excerpt("unary_ops.h", "struct Negative {") + sort_text()


def run(tmp, scores, key_valid, pool_limit, query_valid, select_k, *, kpool, topk, tail, sort_sizes=(),
        twin_source=None, **build_options):
    """{"topk": (stock, twin)} for the decode selection of ``select_kernel.select_topk``, emulated.

    scores [B, L, P] float32, key_valid [B, T] bool, pool_limit [B] int32,
    query_valid [B, L] bool (numpy): L = 1 for a decode token, else a short
    block whose keys are the last L. sort_sizes: more row sizes to build sort
    instances for, so that cases of one width share a build.
    """
    from glm53_patches.patches.dsa_decode import select_kernel

    batch, length, pools = scores.shape
    keys = key_valid.shape[1]
    inputs = (mx.array(scores), mx.array(key_valid), mx.array(pool_limit.astype(np.int32)), mx.array(query_valid))
    if twin_source is None:
        twin_source = generated(lambda *a: select_kernel.select_topk(*a, select_k, kpool=kpool, topk=topk,
                                                                     tail_width=tail, backend="metal"), *inputs)
    sort_sizes = sorted({n for n in (pools, select_k, *sort_sizes) if n})
    threads = 32 * select_kernel.WARPS
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "argsort": ARGSORT, "twin": twin_source, "KPOOL": kpool, "TOPK": topk, "TAIL": tail,
        "THREADS": threads,
        "dispatch": "".join(f"  if (size == {n}) return {argsort_call('T', n, 'rows', 'in', 'out')};\n"
                            for n in sort_sizes),
        "call": launch(twin_source, {"scores": "scores.data()", "key_valid": "key_valid",
                                     "pool_limit": "pool_limit.data()", "query_valid": "query_valid",
                                     "dims": "dims.data()", "topk": "twin.data()"}),
    }
    sizes = np.array([batch, length, keys, pools, select_k], np.int32)
    dims = np.array([keys, pools, select_k, length], np.int32)
    found = execute(tmp, program, {"sizes": sizes, "scores": scores.astype(np.float32), "key_valid": key_valid,
                                   "pool_limit": pool_limit.astype(np.int32), "query_valid": query_valid,
                                   "dims": dims},
                    {"stock": np.int32, "twin": np.int32}, **build_options)
    return {"topk": (found["stock"], found["twin"])}

"""router_select's Metal twin against stock's ``_expert_select`` on Metal, op by op.

Stock (mlx-vlm 0.7.10 ``glm5_next.language._expert_select``, ``mx.compile``d,
one expert group) runs on Metal as:

1. the compiled head, one fused kernel: per element ``Sigmoid``, ``Add``
   (the bias), ``Negative`` (mlx/backend/metal/compiled.cpp writes one
   ``tmp = Op()(...)`` statement per node; the functors are kernels/unary_ops.h
   and binary_ops.h);
2. ``argpartition``, which MLX's Metal backend runs as its merge sort
   (sort.cpp ``ArgPartition::eval_gpu`` -> ``gpu_merge_sort``; kernels/sort.h);
3. ``[..., :K].astype(int32)`` and ``take_along_axis``: copies;
4. ``sum(-1)``: ``row_reduce_small`` (reduce.cpp: rows of at most 64, one
   thread per output when rows are at most 8 long or fewer than 9 non-row
   reductions; kernels/reduction/reduce_row.h);
5. the compiled tail: ``Add`` (1e-20), ``Divide``, ``Multiply`` (the scaling
   factor), with the float32 constants a compiled kernel reads
   (``hc_sinkhorn.compiled_constant``: MLX prints captured constants into the
   kernel's source in mlx/backend/common/compiled.cpp, which the CPU backend
   shares; the probe reads them there). Without normalisation, ``Multiply``
   alone.

Elementwise kernels and one-thread-per-output reductions are run as loops
(their threads never meet); the sort and the twin run as threadgroups.
Indices and weights are compared bit for bit.
"""

import numpy as np

import mlx.core as mx

from . import (ARGSORT, PRELUDE, argsort_call, excerpt, execute, generated, header, launch, macro, pairs,
               sort_text)


def stock_text():
    return (header("defines.h") + excerpt("unary_ops.h", "struct Sigmoid {") + excerpt("unary_ops.h", "struct Negative {")
            + excerpt("binary_ops.h", "struct Add {") + excerpt("binary_ops.h", "struct Divide {")
            + excerpt("binary_ops.h", "struct Multiply {") + sort_text()
            + "static constant constexpr const uint8_t simd_size = 32;\n" + macro("reduction/ops.h", "DEFINE_SIMD_REDUCE")
            + excerpt("reduction/ops.h", "struct Sum {")
            + excerpt("utils.h", "struct LoopedElemToLoc {")
            + excerpt("utils.h", "struct LoopedElemToLoc<1, OffsetT, false> {")
            + excerpt("reduction/reduce_row.h", "thread_reduce(thread U& total, const device T* row, int blocks, int extra) {")
            + excerpt("reduction/reduce_row.h", "[[kernel]] void row_reduce_small("))


PROGRAM = r"""
%(stock)s
%(argsort)s
%(twin)s
int main(int argc, char** argv) {
  constexpr int E = %(E)d, K = %(K)d;
  constexpr bool NORM = %(NORM)s;
  const int R = load<int>(argv[1], 1)[0];
  auto logits = load<float>(argv[2], R * E);
  auto bias = load<float>(argv[3], E);
  auto consts = load<float>(argv[4], 2);        // the twin's input
  auto stock_consts = load<float>(argv[5], 2);  // what stock's compiled tail reads
  auto stock_idx = poisoned<int>(R * K, STOCK), twin_idx = poisoned<int>(R * K, TWIN);
  auto stock_w = poisoned<float>(R * K, STOCK), twin_w = poisoned<float>(R * K, TWIN);

  // 1. The compiled head.
  std::vector<float> scores(R * E), keys(R * E);
  for (int i = 0; i < R * E; ++i) {
    const float s = Sigmoid()(logits[i]);
    scores[i] = s;
    keys[i] = Negative()(Add()(s, bias[i %% E]));
  }
  // 2. argpartition: the sort.
  std::vector<uint> order(R * E);
  %(sort)s;
  // 3. The first K, as int32; their scores.
  std::vector<float> w(R * K);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) {
      stock_idx[r * K + k] = int(order[r * E + k]);
      w[r * K + k] = scores[r * E + order[r * E + k]];
    }
  // 4, 5. The row sum (row_reduce_small: row_size K, no non-row reduction, rows of stride K) and the tail.
  std::vector<float> total(R);
  if (NORM && K > 1) {
    const int64_t row_size = K, non_row_reductions = 1;
    const int shape[1] = {R}, reduce_shape[1] = {0};
    const int64_t strides[1] = {K}, reduce_strides[1] = {0};
    const int ndim = 1, reduce_ndim = 0;
    msl_each({uint(R), 1, 1}, [&] {
      row_reduce_small<float, float, Sum<float>, int, 1>(w.data(), total.data(), row_size, non_row_reductions,
          shape, strides, ndim, reduce_shape, reduce_strides, reduce_ndim, 0u, uint3{0, 0, 0}, uint3{1, 1, 1},
          __msl.thread_position_in_grid, __msl.threads_per_grid);
    });
  }
  for (int i = 0; i < R * K; ++i)
    stock_w[i] = NORM && K > 1 ? Multiply()(Divide()(w[i], Add()(total[i / K], stock_consts[0])), stock_consts[1])
                               : Multiply()(w[i], stock_consts[1]);

  // The twin, as the patch launches it: one simdgroup per row.
  msl_run({uint(R) * 32, 1, 1}, {32, 1, 1}, [&] { %(call)s; });
  save(argv[6], stock_idx);
  save(argv[7], twin_idx);
  save(argv[8], stock_w);
  save(argv[9], twin_w);
  return 0;
}
"""


def run(tmp, logits, bias, top_k, norm=True, scaling=2.5, order=0, twin_source=None, **build_options):
    """{"indices", "weights": (stock bits, twin bits)} for ``_expert_select`` on float32 logits [R, E], emulated."""
    from glm53_patches.kernels import hc_sinkhorn
    from glm53_patches.patches.router_select import kernel

    logits, bias = mx.array(logits, dtype=mx.float32), mx.array(bias, dtype=mx.float32)
    rows, experts = logits.shape
    if twin_source is None:
        twin_source = generated(lambda l, b: kernel.router_select(l, b, top_k, norm, scaling, backend="metal",
                                                                  order=order), logits, bias)
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "argsort": ARGSORT, "twin": twin_source, "E": experts, "K": top_k,
        "NORM": "true" if norm else "false", "sort": argsort_call("float", experts, "R", "keys.data()", "order.data()"),
        "call": launch(twin_source, {"logits": "logits.data()", "bias": "bias.data()", "consts": "consts.data()",
                                     "indices": "twin_idx.data()", "weights": "twin_w.data()"}),
    }
    stock_consts = np.array([hc_sinkhorn.compiled_constant(1e-20), hc_sinkhorn.compiled_constant(scaling)], np.float32)
    found = execute(tmp, program, {"rows": np.array([rows], np.int32), "logits": logits, "bias": bias, "consts": kernel._constants(float(scaling)),
                                   "stock_consts": stock_consts},
                    {"stock_indices": np.int32, "twin_indices": np.int32, "stock_weights": np.uint32,
                     "twin_weights": np.uint32}, **build_options)
    return pairs(found, ["indices", "weights"])

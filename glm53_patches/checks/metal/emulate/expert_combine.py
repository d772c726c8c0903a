"""expert_combine's Metal twin against ``SwitchGLU._combine`` on Metal: copy (astype), Multiply, col_reduce_small (U = T), Add."""


from . import PRELUDE, bits_dtype, excerpt, execute, generated, host_type, launch, macro, pairs


def stock_text():
    """The stock kernels' text: Multiply / Add, Sum, col_reduce_small and the utils it calls."""
    return (excerpt("binary_ops.h", "struct Add {") + excerpt("binary_ops.h", "struct Multiply {")
            + "static constant constexpr const uint8_t simd_size = 32;\n" + macro("reduction/ops.h", "DEFINE_SIMD_REDUCE")
            + excerpt("reduction/ops.h", "struct Sum {")
            + excerpt("utils.h", "METAL_FUNC IdxT elem_to_loc(\n    IdxT elem,")
            + excerpt("utils.h", "struct LoopedElemToLoc {")
            + excerpt("utils.h", "struct LoopedElemToLoc<1, OffsetT, true> {")
            + excerpt("utils.h", "struct LoopedElemToLoc<1, OffsetT, false> {")
            + excerpt("reduction/reduce_col.h", "[[kernel]] void col_reduce_small("))


PROGRAM = r"""
%(stock)s
%(twin)s
int main(int argc, char** argv) {
  using T = %(T)s;
  constexpr int R = %(R)d, K = %(K)d, H = %(H)d;
  auto routed = load<T>(argv[1], R * K * H);
  auto weights = load<float>(argv[2], R * K);
  auto shared = load<T>(argv[3], R * H);
  std::vector<int64_t> sizes{R};
  // Stock. astype: MLX's copy kernel, static_cast to the model dtype.
  std::vector<T> w(R * K), prod(R * K * H), sum(R * H);
  auto out = poisoned<T>(R * H, STOCK), twin = poisoned<T>(R * H, TWIN);
  for (int i = 0; i < R * K; ++i) w[i] = static_cast<T>(weights[i]);
  for (int i = 0; i < R * K * H; ++i) prod[i] = Multiply()(routed[i], w[i / H]);
  // strided_reduce_small (backend/metal/reduce.cpp): reduction_size K, stride H, one
  // reduced dimension (NDIMS 1), threadgroup (min(H / 4, 32), min(8, K)), one column of threadgroups per output row.
  const size_t reduction_size = K;
  const int64_t reduction_stride = H;
  const int shape[1] = {R}, reduce_shape[1] = {K};
  const int64_t strides[1] = {int64_t(K) * H}, reduce_strides[1] = {H};
  const int ndim = 1, reduce_ndim = 1;
  const size_t non_col_reductions = 1;
  const uint tx = H / 4 < 32 ? H / 4 : 32, ty = K < 8 ? K : 8;
  msl_run({(H / 4 + tx - 1) / tx * tx, uint(R) * ty, 1}, {tx, ty, 1}, [&] {
    uint3 gid = __msl.threadgroup_position_in_grid;
    col_reduce_small<T, T, Sum<T>, int, 1>(prod.data(), sum.data(), reduction_size, reduction_stride, shape,
        strides, ndim, reduce_shape, reduce_strides, reduce_ndim, non_col_reductions, uint3{gid.x, gid.y, 0},
        uint3{__msl.threadgroups_per_grid.x, __msl.threadgroups_per_grid.y, 1}, __msl.thread_position_in_threadgroup,
        __msl.threads_per_threadgroup);
  });
  for (int i = 0; i < R * H; ++i) out[i] = Add()(sum[i], shared[i]);
  // The twin, as the patch launches it.
  msl_run({uint(%(grid)d), 1, 1}, {uint(%(threads)d), 1, 1}, [&] { %(call)s; });
  save(argv[4], out);
  save(argv[5], twin);
  return 0;
}
"""


def run(tmp, routed, weights, shared, twin_source=None, **build_options):
    """{"out": (stock bits, twin bits)} for ``SwitchGLU._combine(routed, weights, shared)``, emulated."""
    from glm53_patches.patches.expert_combine import kernel

    rows, _, k, hidden = routed.shape
    if twin_source is None:
        twin_source = generated(lambda r, w, s: kernel.expert_combine(r, w, s, backend="metal"), routed, weights, shared)
    total = rows * hidden
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "twin": twin_source, "T": host_type(routed.dtype), "R": rows, "K": k,
        "H": hidden, "grid": -(-total // kernel.THREADS) * kernel.THREADS, "threads": kernel.THREADS,
        "call": launch(twin_source, {"routed": "routed.data()", "weights": "weights.data()", "shared": "shared.data()",
                                     "sizes": "sizes.data()", "out": "twin.data()"}),
    }
    bits = bits_dtype(routed.dtype)
    found = execute(tmp, program, {"routed": routed, "weights": weights, "shared": shared},
                    {"stock_out": bits, "twin_out": bits}, **build_options)
    return pairs(found, ["out"])

"""routed_experts' Metal twin against stock's decode projections on Metal: affine_gather_qmv_fast per route.

At a decode step mlx-vlm's ``SwitchGLU`` calls each projection as one
``gather_qmm`` over the routes, one row each, unsorted below 64 routes. MLX's
Metal ``GatherQMM::eval_gpu`` runs it as ``gather_qmv`` (M = 1 is under every
``vector_limit``), and ``gather_qmv`` picks ``affine_gather_qmv_fast`` where N
is a multiple of 8 and K of 512: grid (1, N / 8, routes) threadgroups of (32,
2, 1) (``mlx/backend/metal/quantized.cpp``, ml-explore/mlx 846d176). That
kernel offsets x, w, scales, biases and y to its route (``adjust_matrix_offsets``:
the route's input row, its expert, row r of y) and runs ``qmv_fast_impl``
(block_qmv's ``stock_text``), which is what runs here, once per projection
and route, with those offsets.
"""

from . import PRELUDE, bits_dtype, execute, generated, host_type, launch, pairs
from .block_qmv import stock_text

PROGRAM = r"""
namespace stock {
%(stock)s
}
namespace twin {
%(twin)s
}
int main(int argc, char** argv) {
  using T = %(T)s;
  constexpr int E = %(E)d, N = %(N)d, K = %(K)d, R = %(R)d, X = %(X)d, P = %(P)d, BITS = %(BITS)d, G = %(G)d;
  auto x = load<T>(argv[1], X * K);
  auto idx = load<uint32_t>(argv[2], R);
  std::vector<uint32_t> w[P];
  std::vector<T> scales[P], biases[P], out[P], twin[P];
  for (int p = 0; p < P; ++p) {
    w[p] = load<uint32_t>(argv[3 + 3 * p], E * N * K * BITS / 32);
    scales[p] = load<T>(argv[4 + 3 * p], E * N * (K / G));
    biases[p] = load<T>(argv[5 + 3 * p], E * N * (K / G));
    out[p] = poisoned<T>(R * N, STOCK);
    twin[p] = poisoned<T>(R * N, TWIN);
  }
  const int in_vec_size = K, out_vec_size = N;
  // affine_gather_qmv_fast, one dispatch per projection: threadgroup (0, tile, r) after adjust_matrix_offsets
  // to route r: its input row r / (R / X), its expert idx[r], row r of the output.
  for (int p = 0; p < P; ++p) {
    msl_run({32u, 2u * (N / 8), uint(R)}, {32, 2, 1}, [&] {
      const uint3 tg = __msl.threadgroup_position_in_grid;
      const size_t e = idx[tg.z];
      stock::qmv_fast_impl<T, G, BITS>(w[p].data() + e * N * K * BITS / 32, scales[p].data() + e * N * (K / G),
          biases[p].data() + e * N * (K / G), x.data() + (tg.z / (R / X)) * K, out[p].data() + tg.z * N,
          in_vec_size, out_vec_size, uint3{0, tg.y, 0}, __msl.simdgroup_index_in_threadgroup,
          __msl.thread_index_in_simdgroup);
    });
  }
  // The twin, as the patch launches it: every projection in one dispatch.
  msl_run({32u, 2u * (N / 8), uint(R)}, {32, 2, 1}, [&] { %(call)s; });
  for (int p = 0; p < P; ++p) {
    save(argv[3 + 3 * P + p], out[p]);
    save(argv[3 + 4 * P + p], twin[p]);
  }
  return 0;
}
"""


def run(tmp, x, idx, projections, bits, group_size, twin_source=None, **build_options):
    """{"out<p>": (stock bits, twin bits)} for routes ``idx`` of ``x`` (``[X, K]``) through each of
    ``projections`` (``(w, scales, biases)``, experts first), emulated."""
    from glm53_patches.patches.routed_experts import kernel

    rows, k = x.shape
    experts, n = projections[0][0].shape[:2]
    count = len(projections)
    if twin_source is None:
        twin_source = generated(lambda x, i, *a: kernel.expert_qmv(
            x, i, [a[3 * p:3 * p + 3] for p in range(count)], bits, group_size), x, idx,
            *(a for projection in projections for a in projection))
    buffers = {"x": "x.data()", "idx": "idx.data()"}
    for p in range(count):
        buffers.update({f"w{p}": f"w[{p}].data()", f"scales{p}": f"scales[{p}].data()",
                        f"biases{p}": f"biases[{p}].data()", f"out{p}": f"twin[{p}].data()"})
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "twin": twin_source, "T": host_type(x.dtype), "E": experts, "N": n, "K": k,
        "R": idx.shape[0], "X": rows, "P": count, "BITS": bits, "G": group_size,
        "call": "twin::" + launch(twin_source, buffers),
    }
    inputs = {"x": x, "idx": idx}
    for p, (w, scales, biases) in enumerate(projections):
        inputs.update({f"w{p}": w, f"scales{p}": scales, f"biases{p}": biases})
    bits_type = bits_dtype(x.dtype)
    outputs = {f"stock_out{p}": bits_type for p in range(count)}
    outputs.update({f"twin_out{p}": bits_type for p in range(count)})
    found = execute(tmp, program, inputs, outputs, **build_options)
    return pairs(found, [f"out{p}" for p in range(count)])

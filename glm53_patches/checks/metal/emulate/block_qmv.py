"""block_qmv's Metal twin against stock's singleton block projection on Metal: gather_qmv_fast per position.

mlx-vlm's ``singleton_quantized_linear`` is one ``gather_qmm`` of P batch
elements, M = 1 each, all against the same weight. MLX's Metal
``GatherQMM::eval_gpu`` runs it as ``gather_qmv`` (M is under every
``vector_limit``; the indices are not sorted), and ``gather_qmv`` picks
``affine_gather_qmv_fast`` where N is a multiple of 8 and K of the fast
alignment: grid (M, N / 8, B) threadgroups of (32, 2, 1)
(``mlx/backend/metal/quantized.cpp``, ml-explore/mlx 846d176). That kernel
offsets x and y to its batch element (``adjust_matrix_offsets``: position p's
row of x, row p of y, the one weight) and runs ``qmv_fast_impl``, which is
what runs here, per position, with those offsets.
"""

from glm53_patches.kernels.mlx_metal import line

from . import PRELUDE, bits_dtype, excerpt, execute, generated, host_type, launch, pairs

Q = "quantized.h"


def stock_text():
    """quantized.h's constants and the functions qmv_fast_impl calls, and qmv_fast_impl itself, verbatim."""
    return (line(Q, "#define MLX_MTL_CONST") + line(Q, "MLX_MTL_CONST int SIMD_SIZE")
            + excerpt(Q, "inline constexpr short get_pack_factor()")
            + excerpt(Q, "inline constexpr short get_bytes_per_pack()")
            + excerpt(Q, "inline U load_vector(const device T* x, thread U* x_thread)") + excerpt(Q, "inline U qdot(")
            + excerpt(Q, "METAL_FUNC void qmv_fast_impl("))


PROGRAM = r"""
// Each side in its own namespace: both define quantized.h's helpers (the twin calls MLX's own).
namespace stock {
%(stock)s
}
namespace twin {
%(twin)s
}
int main(int argc, char** argv) {
  using T = %(T)s;
  constexpr int N = %(N)d, K = %(K)d, P = %(P)d, BITS = %(BITS)d, G = %(G)d;
  auto x = load<T>(argv[1], P * K);
  auto w = load<uint32_t>(argv[2], N * K * BITS / 32);
  auto scales = load<T>(argv[3], N * (K / G));
  auto biases = load<T>(argv[4], N * (K / G));
  auto out = poisoned<T>(P * N, STOCK), twin = poisoned<T>(P * N, TWIN);
  const int in_vec_size = K, out_vec_size = N;
  // affine_gather_qmv_fast: threadgroup (0, tile, p) after adjust_matrix_offsets to position p.
  msl_run({32u, 2u * (N / 8), uint(P)}, {32, 2, 1}, [&] {
    const uint3 tg = __msl.threadgroup_position_in_grid;
    stock::qmv_fast_impl<T, G, BITS>(w.data(), scales.data(), biases.data(), x.data() + tg.z * K,
        out.data() + tg.z * N, in_vec_size, out_vec_size, uint3{0, tg.y, tg.z},
        __msl.simdgroup_index_in_threadgroup, __msl.thread_index_in_simdgroup);
  });
  // The twin, as the patch launches it.
  msl_run({32u, 2u * (N / 8), 1}, {32, 2, 1}, [&] { %(call)s; });
  save(argv[5], out);
  save(argv[6], twin);
  return 0;
}
"""


def run(tmp, x, w, scales, biases, bits, group_size, twin_source=None, **build_options):
    """{"out": (stock bits, twin bits)} for the block ``x`` (``[P, K]``) through the quantized weight, emulated."""
    from glm53_patches.patches.block_qmv import kernel

    positions, k = x.shape
    n = w.shape[0]
    if twin_source is None:
        twin_source = generated(lambda *a: kernel.block_qmv(*a, bits, group_size, backend="metal"),
                                x, w, scales, biases)
    program = PRELUDE + PROGRAM % {
        "stock": stock_text(), "twin": twin_source, "T": host_type(x.dtype), "N": n, "K": k, "P": positions,
        "BITS": bits, "G": group_size,
        "call": "twin::" + launch(twin_source, {"x": "x.data()", "w": "w.data()", "scales": "scales.data()",
                                     "biases": "biases.data()", "out": "twin.data()"}),
    }
    bits_type = bits_dtype(x.dtype)
    found = execute(tmp, program, {"x": x, "w": w, "scales": scales, "biases": biases},
                    {"stock_out": bits_type, "twin_out": bits_type}, **build_options)
    return pairs(found, ["out"])

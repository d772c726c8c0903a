"""A CUDA quantized matvec for a short block of positions: each weight load serves every position.

In a speculative verify block stock computes each position's projection as a
one-token decode call would (mlx-vlm's ``singleton_quantized_linear``: one
``gather_qmm`` over the positions with one row each), which MLX 0.32's CUDA
backend runs below 8 positions as ``gather_qmv``: the ``qmv`` arithmetic per
(position, output row), the weights read once per position. exact_qmv's
``kernel.py`` documents that arithmetic and mirrors it for one row.

This kernel does the same arithmetic per (position, output row), with the
helpers of exact_qmv's header (the same cutlass converters, ``Array``
operators and ``cutlass::fma``, the same float sum over a lane's columns and
``cg::reduce`` over the warp). What changes is only the loop nesting: a warp
loads one pass of weights, scales and biases for its ``RPW`` output rows once,
then applies it to each of the ``POSITIONS`` input rows, each with its own
sums. Each (position, row) still walks its columns pass by pass in ascending
order into the same accumulators, so its bits are qmv's.
"""

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.patches.exact_qmv.kernel import HEADER

WARPS = 4  # warps per block (a launch shape: changes no bit)
RPW = 2  # output rows per warp

# Template constants: T (the input dtype), BITS, GROUP, K, POSITIONS, WARPS, RPW. N is the scales' first dim.
SOURCE = r"""
  using TC = typename glm53_qmv::Element<T>::type;
  constexpr int E = (cutlass::sizeof_bits<TC>::value <= 16 && BITS <= 4) ? 16 : 8;  // qmv's elems_per_thread
  constexpr int PER_WARP = 32 * E;
  constexpr int PASSES = K / PER_WARP + (K % PER_WARP != 0);  // the last one partial: qmv's residue tile
  constexpr int ROW_BYTES = K * BITS / 8;
  using Acc = typename cutlass::platform::conditional<(BITS >= 8), float, TC>::type;  // qmv's sums
  using XVec = cutlass::Array<TC, E>;
  using WVec = glm53_qmv::Weights<BITS, E>;

  const int N = scales_shape[0];
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  const int lane = warp.thread_rank();
  const int first_row = (blockIdx.x * WARPS + warp.meta_group_rank()) * RPW;
  if (first_row >= N) {
    return;
  }
  const TC* xs = reinterpret_cast<const TC*>(x);
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  const TC* sc = reinterpret_cast<const TC*>(scales);
  const TC* bi = reinterpret_cast<const TC*>(biases);

  Acc sums[POSITIONS][RPW][E] = {};

#pragma unroll
  for (int pass = 0; pass < PASSES; ++pass) {
    const int idx = lane * E + pass * PER_WARP;
    if (idx < K) {
      WVec wv[RPW];
      TC s[RPW], b[RPW];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const int row = first_row + r < N ? first_row + r : N - 1;  // a spare row re-reads the last
        wv[r].load(wb + (size_t)row * ROW_BYTES + idx * BITS / 8);
        s[r] = sc[(size_t)row * (K / GROUP) + idx / GROUP];
        b[r] = bi[(size_t)row * (K / GROUP) + idx / GROUP];
      }
#pragma unroll
      for (int p = 0; p < POSITIONS; ++p) {
        const XVec xv = *reinterpret_cast<const XVec*>(xs + (size_t)p * K + idx);
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          glm53_qmv::dequant_fma<E>(xv, wv[r].template values<TC>(), s[r], b[r], sums[p][r]);
        }
      }
    }
  }

#pragma unroll
  for (int p = 0; p < POSITIONS; ++p) {
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      float sum{0};
#pragma unroll
      for (int i = 0; i < E; ++i) {
        sum += sums[p][r][i];
      }
      sum = cg::reduce(warp, sum, cg::plus<float>{});
      if (lane == 0 && first_row + r < N) {
        reinterpret_cast<TC*>(out)[(size_t)p * N + first_row + r] = static_cast<TC>(sum);
      }
    }
  }
"""

BLOCK_QMV = dict(name="glm53_block_qmv", inputs=["x", "w", "scales", "biases"], outputs=["out"],
                 cuda=(SOURCE, HEADER))


def block_qmv(x, w, scales, biases, bits, group_size, *, warps=None, rpw=None):
    """Each row of ``x`` (``[P, K]``, P positions) times the quantized ``w``, ``[P, N]``: per row what
    MLX's CUDA qmv / gather_qmv computes for it alone. ``warps`` and ``rpw`` override the launch shape."""
    warps, rpw = warps or WARPS, rpw or RPW
    positions, K = x.shape
    N = w.shape[0]
    blocks = -(-N // (warps * rpw))
    return gpu_kernel(backend="cuda", **BLOCK_QMV)(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("K", K),
                  ("POSITIONS", positions), ("WARPS", warps), ("RPW", rpw)],
        grid=(blocks * warps * 32, 1, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(positions, N)],
        output_dtypes=[x.dtype],
    )[0]


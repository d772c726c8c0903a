"""A quantized matvec (CUDA, and its Metal twin) for a short block of positions: each weight load serves every position.

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

The Metal twin mirrors what MLX's Metal backend runs for the same call:
``GatherQMM::eval_gpu`` takes ``gather_qmv`` (M = 1 is under every
``vector_limit``, the indices are not sorted), the fast variant where N is a
multiple of 8 and K of 512: ``affine_gather_qmv_fast``, which offsets to its
position and runs ``qmv_fast_impl`` (``kernels/quantized.h``): threadgroups
of 2 SIMD-groups of 4 output rows, each thread summing ``qdot`` of its
values block by block, then ``simd_sum``. The twin has the same threadgroups
and calls the installed MLX's own ``load_vector`` and ``qdot`` (read from its
headers, ``kernels.mlx_metal``); per block it loads each position's inputs,
then for each row its scale and bias once and ``qdot`` for every position.
Each (position, row) gets the same calls in the same order as stock's.
"""

import functools

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.kernels.mlx_metal import declaration, line
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

# Metal: qmv_fast_impl's body (partial_rows false: N is a multiple of 8; K of 512, so no tail block) with
# the positions inside. Template constants: T, BITS, GROUP, K, N, POSITIONS.
METAL_SOURCE = r"""
  typedef float U;
  constexpr int packs_per_thread = BITS <= 2 ? 1 : 2;
  constexpr int num_simdgroups = 2;
  constexpr int results_per_simdgroup = 4;
  constexpr int pack_factor = get_pack_factor<BITS, 32>();
  constexpr int bytes_per_pack = get_bytes_per_pack<BITS, 32>();
  constexpr int values_per_thread = pack_factor * packs_per_thread;
  constexpr int block_size = values_per_thread * SIMD_SIZE;
  constexpr int scale_step_per_thread = GROUP / values_per_thread;
  const uint simd_gid = simdgroup_index_in_threadgroup;
  const uint simd_lid = thread_index_in_simdgroup;

  const device uint8_t* ws = (const device uint8_t*)w;
  thread U x_thread[POSITIONS][values_per_thread];
  thread U sum[POSITIONS];
  thread U result[POSITIONS][results_per_simdgroup] = {{0}};

  const int in_vec_size_w = K * bytes_per_pack / pack_factor;
  const int in_vec_size_g = K / GROUP;
  const int out_row = threadgroup_position_in_grid.y * (num_simdgroups * results_per_simdgroup) +
      simd_gid * results_per_simdgroup;

  ws += out_row * in_vec_size_w + simd_lid * packs_per_thread * bytes_per_pack;
  const device T* sc = scales + out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  const device T* bi = biases + out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  const device T* xs = x + simd_lid * values_per_thread;

  for (int k = 0; k < K; k += block_size) {
    for (int p = 0; p < POSITIONS; p++) {
      sum[p] = load_vector<T, U, values_per_thread, BITS>(xs + p * K, x_thread[p]);
    }
    for (int row = 0; row < results_per_simdgroup; row++) {
      auto wl = (const device uint8_t*)(ws + row * in_vec_size_w);
      U s = sc[row * in_vec_size_g];
      U b = bi[row * in_vec_size_g];
      for (int p = 0; p < POSITIONS; p++) {
        result[p][row] += qdot<U, values_per_thread, BITS>(wl, x_thread[p], s, b, sum[p]);
      }
    }
    ws += block_size * bytes_per_pack / pack_factor;
    sc += block_size / GROUP;
    bi += block_size / GROUP;
    xs += block_size;
  }

  for (int p = 0; p < POSITIONS; p++) {
    for (int row = 0; row < results_per_simdgroup; row++) {
      result[p][row] = simd_sum(result[p][row]);
      if (simd_lid == 0) {
        out[p * N + out_row + row] = static_cast<T>(result[p][row]);
      }
    }
  }
"""


@functools.lru_cache(maxsize=1)
def metal_header():
    """The installed MLX's own quantized.h helpers the Metal twin calls; None where this mlx ships no
    Metal headers (the wrapper then leaves the call to stock)."""
    q = "quantized.h"
    try:
        return (line(q, "#define MLX_MTL_CONST") + line(q, "MLX_MTL_CONST int SIMD_SIZE")
                + declaration(q, "inline constexpr short get_pack_factor()")
                + declaration(q, "inline constexpr short get_bytes_per_pack()")
                + declaration(q, "inline U load_vector(const device T* x, thread U* x_thread)")
                + declaration(q, "inline U qdot("))
    except (OSError, ValueError):  # no such file, or no such function in it
        return None


def block_qmv(x, w, scales, biases, bits, group_size, *, backend="cuda", warps=None, rpw=None):
    """Each row of ``x`` (``[P, K]``, P positions) times the quantized ``w``, ``[P, N]``: per row what
    MLX's qmv / gather_qmv on ``backend`` computes for it alone. ``warps`` and ``rpw`` override the CUDA
    launch shape."""
    positions, K = x.shape
    N = w.shape[0]
    if backend == "metal":
        return gpu_kernel(backend="metal", metal=(METAL_SOURCE, metal_header()), **BLOCK_QMV)(
            inputs=[x, w, scales, biases],
            template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("K", K), ("N", N),
                      ("POSITIONS", positions)],
            grid=(32, 2 * (N // 8), 1),  # gather_qmv's threadgroups of (32, 2): 8 rows each
            threadgroup=(32, 2, 1),
            output_shapes=[(positions, N)],
            output_dtypes=[x.dtype],
        )[0]
    warps, rpw = warps or WARPS, rpw or RPW
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


"""A CUDA matvec for the routed experts that computes what MLX's ``qmm_sm80`` computes, element for element.

At decode a token's top-8 routes are one ``gather_qmm`` with one row per
route (M = 1) and B = 8 routes, and a verify block's are one over its L x 8;
MLX 0.32's CUDA ``GatherQMM::eval_gpu`` runs both (M x B >= 8; 4- and 8-bit,
N a multiple of 128, K of 64) as ``qmm_sm80`` (``mlx/backend/cuda/quantized/
qmm/qmm_sm80.cuh``, ml-explore/mlx 846d176). Per output element that kernel
computes, with its tile of 16 x 128 x 64 (BM depends only on M; there is no
split over K and each element belongs to one thread):

- each weight dequantized to bf16 as ``q * scale + bias``, in bf16, which
  ptxas fuses into one fma on sm_90 (rounded once; on sm_80 it rounds the
  product and the sum apart, so this kernel matches Hopper only);
- a chain of ``mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`` over K in
  ascending 16-wide chunks, from a float accumulator of 0;
- the float sum rounded to bf16 (``cvt.rn``).

This kernel keeps that chain for every element and changes only the work
split, which operand carries what, and how the bytes arrive. A warp takes
16 output rows of one route, their dequantized weights as the MMA's A
operand (rows g and g + 8 of the fragment) and the route's input as every
column of B; column 0 of D holds the 16 outputs. Each element is still the
same 16 products per chunk added by one MMA onto the float it carries, chunk
after chunk, and a warp issues half the MMAs of the input-as-A layout
(``benchmarks/h200/probe_expert_swap.py``, now in git history, found the swap bit-identical to
``gather_qmm`` on an H100 and 1.17x faster, s40). The weights come 128 bytes
of a row (4 groups) at a time, 4 lanes side by side (lane t: bytes 16t and
64 + 16t of rows g and g + 8), with each row's 4 scales and 4 biases as one
8-byte load each, ``AHEAD`` such steps in flight; the warp hands them to the
lanes that feed them to the MMA through shared memory. The input is laid out
once per block so that a lane reads its 8 words of a group as two loads.
Each weight is dequantized as a bf16 pair ``128 + q`` minus 128 (exact),
then one fma, as ``qmm_sm80`` does. s37's kernel (input as A, 8 rows a warp)
and s36's are in git history.

One launch can take several projections of the same input and shape (a
decode step's gate and up): ``blockIdx.z`` picks a block's projection, and
every block runs the same body. That is one launch fewer, and on an H100 it
took 1-7% off the pair at 8 routes (s49): twice the warps in flight did not
bring 8 routes to the bandwidth of 32.
"""

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.patches.block_qmv.kernel import metal_header

WARPS = 4  # warps per block (a launch shape: changes no bit)
AHEAD = 1  # steps of 4 groups loaded ahead of the MMA chain (when they arrive changes no bit; 2 was slower, s40)
ROWS = 16  # output rows per warp: the MMA's M
BITS, GROUP = 4, 64  # what it covers: 4-bit affine, groups of 64 (qmm_sm80's BK = max(64, group))
STEP, MAX_K = 256, 16384  # K: a multiple of a step (4 groups), and its input must fit the block's shared memory

# Template constants: K, N, PER_ROW (consecutive routes per input row: every route, a position's top-k, or 1),
# WARPS, AHEAD. ``cuda_source`` puts before it which projection's w, scales, biases and out a block takes
# (``blockIdx.z``): each projection's blocks run this same body.
SOURCE = r"""
  const int lane = threadIdx.x & 31, warp_in_block = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int r = blockIdx.y;
  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 16;  // 16 output rows a warp: the MMA's M
  constexpr int GROUPS = K / 64, STEPS = K / 256;  // a step is 4 groups: 128 bytes of a row
  // the route's input, as xs[group][t]: the 8 words lane t's MMAs read in that group (chunk c: 2c and 2c + 1)
  __shared__ uint4 xs[GROUPS * 4 * 2];
  __shared__ uint4 rows[WARPS][16 * 9];  // a warp's step: 16 rows of 128 bytes, 16 bytes of padding each
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + (size_t)(r / PER_ROW) * (K / 2);
  uint32_t* xw = reinterpret_cast<uint32_t*>(xs);
  for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
    const int group = i / 32, tt = (i / 8) % 4, j = i % 8;  // j = 2c + half
    xw[i] = xr[group * 32 + (j / 2) * 8 + tt + 4 * (j % 2)];
  }
  __syncthreads();
  if (n0 >= N) {
    return;
  }
  const size_t row = (size_t)idx[r] * N + n0 + g;  // lane (g, t) loads rows g and g + 8
  const uint4* wr = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(w) + row * (K / 2));
  const uint4* wr8 = wr + 8 * (K / 32);
  const uint2* sr = reinterpret_cast<const uint2*>(scales + row * GROUPS);
  const uint2* br = reinterpret_cast<const uint2*>(biases + row * GROUPS);
  const uint2* sr8 = sr + 8 * (GROUPS / 4);
  const uint2* br8 = br + 8 * (GROUPS / 4);
  uint4* mine = rows[warp_in_block];
  // AHEAD steps in flight: slot i holds bytes 16t and 64 + 16t of rows g (ra, rb) and g + 8 (rc, rd) of a step,
  // and their 4 scales and biases
  uint4 ra[AHEAD], rb[AHEAD], rc[AHEAD], rd[AHEAD];
  uint2 rs[AHEAD], rz[AHEAD], rs8[AHEAD], rz8[AHEAD];
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) {
    if (i < STEPS) {
      ra[i] = wr[8 * i + t];
      rb[i] = wr[8 * i + 4 + t];
      rc[i] = wr8[8 * i + t];
      rd[i] = wr8[8 * i + 4 + t];
      rs[i] = sr[i];
      rz[i] = br[i];
      rs8[i] = sr8[i];
      rz8[i] = br8[i];
    }
  }
  // one bf16 pair of lane t's byte of a word: 128 + q, minus 128 (exact), then one fma per value
  auto pair = [&](uint32_t word, __nv_bfloat162 s2, __nv_bfloat162 z2) {
    const uint32_t q = (word >> (8 * t)) & 0xff;
    uint32_t p = 0x43004300u | (q & 15) | ((q >> 4) << 16);
    __nv_bfloat162 v = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p), __floats2bfloat162_rn(128.f, 128.f)),
                               s2, z2);
    return *reinterpret_cast<uint32_t*>(&v);
  };
  auto half = [](uint32_t word, int q) {
    return __bfloat162bfloat162(__ushort_as_bfloat16((unsigned short)(q % 2 ? word >> 16 : word & 0xffff)));
  };
  float d[4] = {};
#pragma unroll 1
  for (int first = 0; first < STEPS; first += AHEAD) {
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int step = first + i;
      if (step >= STEPS) {
        break;
      }
      __syncwarp();
      mine[g * 9 + t] = ra[i];
      mine[g * 9 + 4 + t] = rb[i];
      mine[(g + 8) * 9 + t] = rc[i];
      mine[(g + 8) * 9 + 4 + t] = rd[i];
      const uint2 sc = rs[i], zc = rz[i], sc8 = rs8[i], zc8 = rz8[i];
      __syncwarp();
      if (step + AHEAD < STEPS) {
        ra[i] = wr[8 * (step + AHEAD) + t];
        rb[i] = wr[8 * (step + AHEAD) + 4 + t];
        rc[i] = wr8[8 * (step + AHEAD) + t];
        rd[i] = wr8[8 * (step + AHEAD) + 4 + t];
        rs[i] = sr[step + AHEAD];
        rz[i] = br[step + AHEAD];
        rs8[i] = sr8[step + AHEAD];
        rz8[i] = br8[step + AHEAD];
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int group = 4 * step + q;
        const uint4 lo = mine[g * 9 + 2 * q], hi = mine[g * 9 + 2 * q + 1];
        const uint4 lo8 = mine[(g + 8) * 9 + 2 * q], hi8 = mine[(g + 8) * 9 + 2 * q + 1];
        const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        const uint32_t words8[8] = {lo8.x, lo8.y, lo8.z, lo8.w, hi8.x, hi8.y, hi8.z, hi8.w};
        const __nv_bfloat162 s2 = half(q < 2 ? sc.x : sc.y, q), z2 = half(q < 2 ? zc.x : zc.y, q);
        const __nv_bfloat162 s28 = half(q < 2 ? sc8.x : sc8.y, q), z28 = half(q < 2 ? zc8.x : zc8.y, q);
        const uint4 xa = xs[(group * 4 + t) * 2], xb = xs[(group * 4 + t) * 2 + 1];
        const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          // A: the weights of rows g (a0: k 2t, 2t + 1; a2: k + 8) and g + 8 (a1, a3); B: the input, every column
          const uint32_t a0 = pair(words[2 * c], s2, z2), a2 = pair(words[2 * c + 1], s2, z2);
          const uint32_t a1 = pair(words8[2 * c], s28, z28), a3 = pair(words8[2 * c + 1], s28, z28);
          asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                       "{%0,%1,%2,%3};"
                       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                       : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xv[2 * c]), "r"(xv[2 * c + 1]));
        }
      }
    }
  }
  if (t == 0) {  // column 0 of D: rows g and g + 8
    out[(size_t)r * N + n0 + g] = __float2bfloat16_rn(d[0]);
    out[(size_t)r * N + n0 + g + 8] = __float2bfloat16_rn(d[2]);
  }
"""

def _pick(name, projections):
    """The body's ``name`` (``w``, ``scales``, ``biases``, ``out``): projection ``blockIdx.z``'s."""
    choice = f"{name}0"
    for p in range(1, projections):
        choice = f"blockIdx.z == {p} ? {name}{p} : {choice}"
    return f"  const auto {name} = {choice};\n"


def cuda_source(projections):
    """The kernel's text for ``projections`` projections of one input (blockIdx.z picks one)."""
    return "".join(_pick(name, projections) for name in ("w", "scales", "biases", "out")) + SOURCE


def _expert_mma_kernel(projections):
    names = [f"{what}{p}" for p in range(projections) for what in ("w", "scales", "biases")]
    return dict(name=f"glm53_expert_mma{projections}", inputs=["x", "idx", *names],
                outputs=[f"out{p}" for p in range(projections)], cuda=(cuda_source(projections), None))


def expert_mma(x, idx, projections, *, warps=WARPS, ahead=AHEAD):
    """Route r of ``idx`` (``[R]`` uint32) through expert ``idx[r]`` of each ``(w, scales, biases)`` in
    ``projections`` (one, or several of one shape: gate and up, in one launch): a list of ``[R, N]``. ``w`` is
    ``[E, N, K / 8]``, 4-bit, group 64, with bf16 scales and biases; N a multiple of 16 x ``warps``, K of
    ``STEP``. ``x`` is ``[X, K]``, X dividing R: routes r of one row ``r // (R / X)`` (one input for every route,
    one per position's top-k, or one per route). ``warps`` and ``ahead`` are launch and probe settings."""
    rows, k = x.shape
    routes, n = idx.shape[0], projections[0][0].shape[1]
    if routes % rows or k % STEP or n % (ROWS * warps) or any(w.shape != projections[0][0].shape
                                                               for w, _, _ in projections):
        raise ValueError(f"expert_mma: {routes} routes over {rows} input rows, K {k}, N {n}, {warps} warps, "
                         f"projections {[w.shape for w, _, _ in projections]}")
    return gpu_kernel(backend="cuda", **_expert_mma_kernel(len(projections)))(
        inputs=[x, idx, *(a for projection in projections for a in projection)],
        template=[("K", k), ("N", n), ("PER_ROW", routes // rows), ("WARPS", warps), ("AHEAD", ahead)],
        grid=(n // (ROWS * warps) * 32 * warps, routes, len(projections)),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(routes, n)] * len(projections),
        output_dtypes=[x.dtype] * len(projections),
    )


# ---- the Metal twin: MLX's Metal gather_qmv, per route, with gate and up sharing their input's loads
#
# At decode MLX's Metal ``GatherQMM::eval_gpu`` runs each projection's ``gather_qmm`` (M = 1, unsorted
# routes) as ``gather_qmv``, and where N is a multiple of 8 and K of 512 as ``affine_gather_qmv_fast``:
# threadgroups of 2 SIMD-groups of 4 output rows, grid (1, N / 8, routes), each offset to its route's input
# row and expert (``adjust_matrix_offsets``), then ``qmv_fast_impl``: per block of K each thread loads its
# input values (``load_vector``), then per row its scale and bias and ``qdot``, ``simd_sum`` at the end. The
# twin is that body, calling the installed MLX's own ``load_vector`` and ``qdot`` (block_qmv's
# ``metal_header``), with one or two projections of the same input inside: per block the input is loaded
# once, then each projection's 4 rows take their ``qdot``s in stock's order. Each (route, row) of each
# projection gets the calls stock's dispatch of that projection makes, in the same order.
# Template constants: T, BITS, GROUP, K, N, PER_ROW (consecutive routes per input row).
METAL_SOURCE = r"""
  typedef float U;
  constexpr int packs_per_thread = BITS <= 2 ? 1 : 2;
  constexpr int results_per_simdgroup = 4;
  constexpr int pack_factor = get_pack_factor<BITS, 32>();
  constexpr int bytes_per_pack = get_bytes_per_pack<BITS, 32>();
  constexpr int values_per_thread = pack_factor * packs_per_thread;
  constexpr int block_size = values_per_thread * SIMD_SIZE;
  constexpr int scale_step_per_thread = GROUP / values_per_thread;
  constexpr int in_vec_size_w = K * bytes_per_pack / pack_factor;
  constexpr int in_vec_size_g = K / GROUP;
  const uint simd_gid = simdgroup_index_in_threadgroup;
  const uint simd_lid = thread_index_in_simdgroup;
  const uint route = threadgroup_position_in_grid.z;
  const int out_row = threadgroup_position_in_grid.y * (2 * results_per_simdgroup) +
      simd_gid * results_per_simdgroup;
  const size_t expert_row = size_t(idx[route]) * N + out_row;

  const device uint8_t* ws[PROJECTIONS];
  const device T* sc[PROJECTIONS];
  const device T* bi[PROJECTIONS];
  device T* ys[PROJECTIONS];
%(pointers)s
  for (int p = 0; p < PROJECTIONS; p++) {
    ws[p] += expert_row * in_vec_size_w + simd_lid * packs_per_thread * bytes_per_pack;
    sc[p] += expert_row * in_vec_size_g + simd_lid / scale_step_per_thread;
    bi[p] += expert_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  }
  const device T* xs = x + (route / PER_ROW) * K + simd_lid * values_per_thread;

  thread U x_thread[values_per_thread];
  thread U result[PROJECTIONS][results_per_simdgroup] = {{0}};

  for (int k = 0; k < K; k += block_size) {
    U sum = load_vector<T, U, values_per_thread, BITS>(xs, x_thread);
    for (int p = 0; p < PROJECTIONS; p++) {
      for (int row = 0; row < results_per_simdgroup; row++) {
        auto wl = (const device uint8_t*)(ws[p] + row * in_vec_size_w);
        U s = sc[p][row * in_vec_size_g];
        U b = bi[p][row * in_vec_size_g];
        result[p][row] += qdot<U, values_per_thread, BITS>(wl, x_thread, s, b, sum);
      }
      ws[p] += block_size * bytes_per_pack / pack_factor;
      sc[p] += block_size / GROUP;
      bi[p] += block_size / GROUP;
    }
    xs += block_size;
  }

  for (int p = 0; p < PROJECTIONS; p++) {
    for (int row = 0; row < results_per_simdgroup; row++) {
      result[p][row] = simd_sum(result[p][row]);
      if (simd_lid == 0) {
        ys[p][route * N + out_row + row] = static_cast<T>(result[p][row]);
      }
    }
  }
"""


def _expert_qmv_kernel(projections):
    names = [f"{what}{p}" for p in range(projections) for what in ("w", "scales", "biases")]
    pointers = "".join(f"  ws[{p}] = (const device uint8_t*)w{p};\n  sc[{p}] = scales{p};\n  bi[{p}] = biases{p};\n"
                       f"  ys[{p}] = out{p};\n" for p in range(projections))
    source = f"  constexpr int PROJECTIONS = {projections};\n" + METAL_SOURCE % {"pointers": pointers}
    return dict(name=f"glm53_expert_qmv{projections}", inputs=["x", "idx", *names],
                outputs=[f"out{p}" for p in range(projections)], metal=(source, metal_header()))


def expert_qmv(x, idx, projections, bits, group_size):
    """Route r of ``idx`` (``[R]`` uint32) through expert ``idx[r]`` of each ``(w, scales, biases)`` in
    ``projections`` (one, or two of one shape: gate and up), as MLX's Metal ``gather_qmv`` computes each:
    a list of ``[R, N]``. ``x`` is ``[X, K]``, X dividing R: routes r of one row ``r // (R / X)``. N must be
    a multiple of 8 and K of 512 (``affine_gather_qmv_fast``'s shapes)."""
    rows, k = x.shape
    routes, n = idx.shape[0], projections[0][0].shape[1]
    if routes % rows or k % 512 or n % 8:
        raise ValueError(f"expert_qmv: {routes} routes over {rows} input rows, K {k}, N {n}")
    return gpu_kernel(backend="metal", **_expert_qmv_kernel(len(projections)))(
        inputs=[x, idx, *(a for projection in projections for a in projection)],
        template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("K", k), ("N", n),
                  ("PER_ROW", routes // rows)],
        grid=(32, 2 * (n // 8), routes),  # gather_qmv's threadgroups of (32, 2): 8 rows of one route each
        threadgroup=(32, 2, 1),
        output_shapes=[(routes, n)] * len(projections),
        output_dtypes=[x.dtype] * len(projections),
    )

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
split and how the bytes arrive: a warp per 8 output rows of one route (the
MMA's n8), each lane loading its row's 32 bytes of a 64-wide group, that
group's scale and bias once, and the route's input in the MMA's row 0 (rows
1-15 zero; nothing in an MMA mixes rows, which ``FILL`` lets verify show by
putting other routes' inputs there). ``benchmarks/h200/probe_expert_mma.py``
found it bit-identical to ``gather_qmm`` on an H100 (s35) and times it.
"""

from glm53_patches.kernels.build import gpu_kernel

WARPS = 4  # warps per block (a launch shape: changes no bit)
DEPTH = 4  # groups of 64 weights per row loaded ahead of the MMA chain (when they arrive changes no bit)
BITS, GROUP = 4, 64  # what it covers: 4-bit affine, groups of 64 (qmm_sm80's BK = max(64, group))

# Template constants: K, N, PER_ROW (consecutive routes per input row: every route, a position's top-k, or 1),
# WARPS, DEPTH, TILES (tiles of 8 output rows per warp), MAGIC (dequantize in bf16 pairs as qmm_sm80 does), FILL.
SOURCE = r"""
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragment's group and thread in group
  const int r = blockIdx.y, routes = gridDim.y;
  const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 8 * TILES;
  if (n0 >= N) {
    return;
  }
  const uint4* wr[TILES];  // a group's 32 bytes of a row are two uint4
  const __nv_bfloat16* sr[TILES];
  const __nv_bfloat16* br[TILES];
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const size_t row = (size_t)idx[r] * N + n0 + 8 * j + g;  // B's column g is weight row n0 + 8j + g
    wr[j] = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(w) + row * (K / 2));
    sr[j] = scales + row * (K / 64);
    br[j] = biases + row * (K / 64);
  }
  // A's row g: the route's input in row 0; rows 1-15 zero, or (FILL) other routes' inputs
  const bool real = g == 0 || FILL;
  const int xrow = ((r + (FILL ? g : 0)) % routes) / PER_ROW;
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + (size_t)xrow * (K / 2);
  // DEPTH groups of weights, scales and biases in flight: each slot is refilled with the group DEPTH ahead
  // as soon as it is read, so the MMA chain (which must stay in order) never waits on a single load
  constexpr int GROUPS = K / 64;
  uint4 ring[DEPTH][TILES][2];
  __nv_bfloat16 ring_s[DEPTH][TILES], ring_z[DEPTH][TILES];
#pragma unroll
  for (int i = 0; i < DEPTH; ++i) {
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      if (i < GROUPS) {
        ring[i][j][0] = wr[j][2 * i];
        ring[i][j][1] = wr[j][2 * i + 1];
        ring_s[i][j] = sr[j][i];
        ring_z[i][j] = br[j][i];
      }
    }
  }
  float d[TILES][4] = {};
#pragma unroll 1
  for (int first = 0; first < GROUPS; first += DEPTH) {
#pragma unroll
    for (int i = 0; i < DEPTH; ++i) {
      const int group = first + i;
      if (group >= GROUPS) {
        break;
      }
      uint32_t words[TILES][8];
      __nv_bfloat16 s[TILES], z[TILES];
#pragma unroll
      for (int j = 0; j < TILES; ++j) {
        const uint4 lo = ring[i][j][0], hi = ring[i][j][1];
        words[j][0] = lo.x; words[j][1] = lo.y; words[j][2] = lo.z; words[j][3] = lo.w;
        words[j][4] = hi.x; words[j][5] = hi.y; words[j][6] = hi.z; words[j][7] = hi.w;
        s[j] = ring_s[i][j];
        z[j] = ring_z[i][j];
        if (group + DEPTH < GROUPS) {
          ring[i][j][0] = wr[j][2 * (group + DEPTH)];
          ring[i][j][1] = wr[j][2 * (group + DEPTH) + 1];
          ring_s[i][j] = sr[j][group + DEPTH];
          ring_z[i][j] = br[j][group + DEPTH];
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // the group's 16-wide chunks, ascending
        const int word = group * 32 + c * 8 + t;  // x[k] pairs: k = 64 group + 16 c + 2t, and + 8
        const uint32_t a0 = real ? xr[word] : 0u, a2 = real ? xr[word + 4] : 0u;
        const uint32_t a1 = FILL ? a0 : 0u, a3 = FILL ? a2 : 0u;  // rows g + 8
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
          // chunk c is bytes 8c .. 8c + 7: this lane's k = 2t, 2t + 1 (byte t) and 2t + 8, 2t + 9 (byte 4 + t)
          const uint32_t q0 = (words[j][2 * c] >> (8 * t)) & 0xff, q1 = (words[j][2 * c + 1] >> (8 * t)) & 0xff;
          uint32_t b0, b1;
          if (MAGIC) {  // bf16 pairs 128 + q, minus 128 (exact), then one fma per value
            const __nv_bfloat162 base = __floats2bfloat162_rn(128.f, 128.f);
            const __nv_bfloat162 s2 = __bfloat162bfloat162(s[j]), z2 = __bfloat162bfloat162(z[j]);
            uint32_t p0 = 0x43004300u | (q0 & 15) | ((q0 >> 4) << 16), p1 = 0x43004300u | (q1 & 15) | ((q1 >> 4) << 16);
            __nv_bfloat162 v0 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p0), base), s2, z2);
            __nv_bfloat162 v1 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p1), base), s2, z2);
            b0 = *reinterpret_cast<uint32_t*>(&v0);
            b1 = *reinterpret_cast<uint32_t*>(&v1);
          } else {
            const __nv_bfloat16 w0 = __hfma(__uint2bfloat16_rn(q0 & 15), s[j], z[j]);
            const __nv_bfloat16 w1 = __hfma(__uint2bfloat16_rn(q0 >> 4), s[j], z[j]);
            const __nv_bfloat16 w2 = __hfma(__uint2bfloat16_rn(q1 & 15), s[j], z[j]);
            const __nv_bfloat16 w3 = __hfma(__uint2bfloat16_rn(q1 >> 4), s[j], z[j]);
            b0 = (uint32_t)__bfloat16_as_ushort(w0) | ((uint32_t)__bfloat16_as_ushort(w1) << 16);
            b1 = (uint32_t)__bfloat16_as_ushort(w2) | ((uint32_t)__bfloat16_as_ushort(w3) << 16);
          }
          asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                       "{%0,%1,%2,%3};"
                       : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
                       : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
      }
    }
  }
  if (g == 0) {  // D's row 0: columns 2t and 2t + 1 are output rows n0 + 8j + 2t, + 1
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      out[(size_t)r * N + n0 + 8 * j + 2 * t] = __float2bfloat16_rn(d[j][0]);
      out[(size_t)r * N + n0 + 8 * j + 2 * t + 1] = __float2bfloat16_rn(d[j][1]);
    }
  }
"""

EXPERT_MMA = dict(name="glm53_expert_mma", inputs=["x", "w", "scales", "biases", "idx"], outputs=["out"],
                  cuda=(SOURCE, None))


def expert_mma(x, w, scales, biases, idx, *, warps=WARPS, depth=DEPTH, tiles=1, magic=0, fill=0):
    """Route r of ``idx`` (``[R]`` uint32) through expert ``idx[r]`` of ``w`` (``[E, N, K / 8]``, 4-bit, group
    64, bf16 ``scales`` and ``biases``): ``[R, N]``. ``x`` is ``[X, K]``, X dividing R: routes r of one row
    ``r // (R / X)`` (one input for every route, one per position's top-k, or one per route). ``warps``,
    ``depth``, ``tiles``, ``magic`` and ``fill`` are launch and probe settings (``SOURCE``)."""
    rows, k = x.shape
    routes, n = idx.shape[0], w.shape[1]
    if routes % rows:
        raise ValueError(f"expert_mma: {routes} routes over {rows} input rows")
    return gpu_kernel(backend="cuda", **EXPERT_MMA)(
        inputs=[x, w, scales, biases, idx],
        template=[("K", k), ("N", n), ("PER_ROW", routes // rows), ("WARPS", warps), ("DEPTH", depth), ("TILES", tiles), ("MAGIC", magic),
                  ("FILL", fill)],
        grid=(-(-n // (8 * tiles * warps)) * 32 * warps, routes, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(routes, n)],
        output_dtypes=[x.dtype],
    )[0]

"""Half the MMAs for the routed experts: the weights as the MMA's A operand, the input as B (issue 17, a probe).

routed_experts' kernel (and MLX's ``qmm_sm80`` it matches) puts the route's
input in row 0 of the MMA's A operand and 8 output rows' weights in B: an
``mma.sync.m16n8k16`` per 16 columns of K gives 8 outputs, and 15 of A's 16
rows are zero. Here the roles swap: 16 output rows' weights are A (rows g
and g + 8 of the fragment), the input is every column of B, and column 0 of
D is the output: the same products x[k] * w[n][k] for each element, reduced
over the same 16 k of each chunk in the same order of chunks, with half the
MMAs per output. Whether the tensor core reduces a row of A against a column
of B the same way when the operands trade places is what this probe asks:
each arm's outputs are checked bit for bit against ``gather_qmm``. The
loads, the dequantization (bf16 pairs, one fma each) and the input's layout
are the patch's, for twice the rows per warp.

Its text runs on the host like the patch's (``tests/numerics/test_routed_experts_host.py``'s
stand-ins; checked in s39 to bf16 tolerance against a float32 matvec). Not
yet run on a GPU.

Usage: python probe_expert_swap.py [--out FILE.json]   (CUDA only)
"""

from probe_expert_mma import compare, launch, main, pool_of, stock  # the same experts, routes, timing, output

from glm53_patches.patches.routed_experts.kernel import expert_mma

# Template constants: K, N, PER_ROW, WARPS, AHEAD, MAGIC (unused: bf16 pairs), as the patch's kernel.
SOURCE = r"""
  const int lane = threadIdx.x & 31, warp_in_block = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int r = blockIdx.y;
  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 16;  // 16 output rows a warp: the MMA's M
  constexpr int GROUPS = K / 64, STEPS = K / 256;
  __shared__ uint4 xs[GROUPS * 4 * 2];
  __shared__ uint4 rows[WARPS][16 * 9];  // a warp's step: 16 rows of 128 bytes, 16 bytes of padding each
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + (size_t)(r / PER_ROW) * (K / 2);
  uint32_t* xw = reinterpret_cast<uint32_t*>(xs);
  for (int i = threadIdx.x; i < K / 2; i += blockDim.x) {
    const int group = i / 32, tt = (i / 8) % 4, j = i % 8;
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

SWAP = dict(name="glm53_probe_expert_swap", inputs=["x", "w", "scales", "biases", "idx"], outputs=["out"],
            cuda=(SOURCE, None))
ROWS_PER_WARP = 16


def swapped(*operands, warps=4, ahead=2):
    return launch(SWAP, *operands, warps=warps, settings=[("AHEAD", ahead), ("MAGIC", 1)],
                  rows_per_warp=ROWS_PER_WARP)


def probe(label, n, k, routes):
    pool, per_route = pool_of(n, k, routes)
    arms = {"stock": stock, "kernel": expert_mma, "swapped": swapped,
            "swapped, 8 warps": lambda *a: swapped(*a, warps=8),
            "swapped, 2 warps": lambda *a: swapped(*a, warps=2),
            "swapped, 1 ahead": lambda *a: swapped(*a, ahead=1)}
    return compare(label, n, k, routes, arms, pool, per_route)


if __name__ == "__main__":
    main(probe, "probe_expert_swap")

"""Where does routed_experts' kernel lose its time: the loads, or the arithmetic? (issue 17, a probe)

routed_experts' ``expert_mma`` reaches 1.0-1.2 TB/s at 8 routes (s36: 34-36 us
per projection on an H100 whose plain copy does about 2.4 TB/s), and loading
more groups ahead (``depth`` 1 to 8) changed that by 6% at most. This times
kernels that only load, with the same grid and the same rows per warp, and
fold what they load into one word per lane (so nothing is optimized away;
their outputs mean nothing):

- ``fragment``: the loads expert_mma issues for a group (each lane its row's
  32 bytes, that row's scale and bias), no dequantization, no MMA;
- ``fragment + x``: those and the input words the MMAs read (8 per group);
- ``coalesced``: the same bytes, 4 lanes side by side in a row (64 contiguous
  bytes an instruction), and a row's 4 scales and 4 biases as one 8-byte load;
- ``stream``: each warp's 8 rows read as one contiguous run by all 32 lanes.

If ``fragment`` is already as slow as expert_mma, the access pattern is the
limit and a faster exact kernel must reshape its loads (and then move bytes
between lanes); if it is much faster, the dequantization and MMA issue are.
s36: the loads took 27 of expert_mma's 37 us, side by side 20. So ``SIDE``
below reads side by side and keeps expert_mma's arithmetic; it is checked bit
for bit against ``gather_qmm`` and timed with the rest (30 us, bit-identical).

Usage: python probe_expert_loads.py [--out FILE.json]   (CUDA only)
"""

import mlx.core as mx
from probe_expert_mma import main, pool_of, stock, time_arms  # the same experts, routes, timing and output

from glm53_patches.kernels.build import gpu_kernel
from glm53_patches.patches.routed_experts.kernel import expert_mma

WARPS = 4

SOURCE = r"""
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r = blockIdx.y;
  const int warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
  const int n0 = warp * 8;
  if (n0 >= N) {
    return;
  }
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w) + ((size_t)idx[r] * N + n0) * (K / 2);
  const size_t row = (size_t)idx[r] * N + n0 + g;
  const uint4* wr = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(w) + row * (K / 2));
  const __nv_bfloat16* sr = scales + row * (K / 64);
  const __nv_bfloat16* br = biases + row * (K / 64);
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x);
  uint32_t acc = 0;
  if (MODE <= 1) {  // fragment (+ x)
#pragma unroll 4
    for (int group = 0; group < K / 64; ++group) {
      const uint4 lo = wr[2 * group], hi = wr[2 * group + 1];
      acc ^= lo.x ^ lo.y ^ lo.z ^ lo.w ^ hi.x ^ hi.y ^ hi.z ^ hi.w;
      acc ^= (uint32_t)__bfloat16_as_ushort(sr[group]) ^ ((uint32_t)__bfloat16_as_ushort(br[group]) << 16);
      if (MODE == 1) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc ^= xr[group * 32 + c * 8 + t] ^ xr[group * 32 + c * 8 + t + 4];
        }
      }
    }
  } else if (MODE == 2) {  // coalesced: 4 groups (128 bytes of a row) a step, lane t at bytes 16t and 64 + 16t
#pragma unroll 4
    for (int step = 0; step < K / 256; ++step) {
      const uint4 a = wr[8 * step + t], b = wr[8 * step + 4 + t];
      const uint2 s4 = reinterpret_cast<const uint2*>(sr)[step], z4 = reinterpret_cast<const uint2*>(br)[step];
      acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ s4.x ^ s4.y ^ z4.x ^ z4.y;
    }
  } else {  // stream: the warp's 8 rows as one run
    const uint4* run = reinterpret_cast<const uint4*>(base);
#pragma unroll 4
    for (int i = lane; i < 8 * K / 32; i += 32) {
      const uint4 a = run[i];
      acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
  }
  out[((size_t)r * (N / 8) + warp) * 32 + lane] = acc;
"""

# The next kernel to try: expert_mma's arithmetic (the same MMA operands in the same order, so the
# same bits, as checked below) with its weights read 4 lanes side by side and handed to the fragment
# lanes through shared memory, the input laid out once per block so a lane reads its 8 words as two.
SIDE = r"""
  const int lane = threadIdx.x & 31, warp_in_block = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int r = blockIdx.y;
  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 8;
  constexpr int GROUPS = K / 64, STEPS = K / 256;  // a step is 4 groups: 128 bytes of a row
  // the input, as xs[group][t]: the 8 words lane t's MMAs read in that group (chunk c: 2c and 2c + 1)
  __shared__ uint4 xs[GROUPS * 4 * 2];
  __shared__ uint4 rows[WARPS][8 * 9];  // a warp's step: 8 rows of 128 bytes, 16 bytes of padding each
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
  const size_t row = (size_t)idx[r] * N + n0 + g;
  const uint4* wr = reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(w) + row * (K / 2));
  const uint2* sr = reinterpret_cast<const uint2*>(scales + row * GROUPS);
  const uint2* br = reinterpret_cast<const uint2*>(biases + row * GROUPS);
  uint4* mine = rows[warp_in_block];
  // AHEAD steps in flight: slot i holds row g's bytes 16t and 64 + 16t of a step, and its 4 scales and biases
  uint4 ra[AHEAD], rb[AHEAD];
  uint2 rs[AHEAD], rz[AHEAD];
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) {
    if (i < STEPS) {
      ra[i] = wr[8 * i + t];
      rb[i] = wr[8 * i + 4 + t];
      rs[i] = sr[i];
      rz[i] = br[i];
    }
  }
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
      const uint2 sc = rs[i], zc = rz[i];
      __syncwarp();
      if (step + AHEAD < STEPS) {
        ra[i] = wr[8 * (step + AHEAD) + t];
        rb[i] = wr[8 * (step + AHEAD) + 4 + t];
        rs[i] = sr[step + AHEAD];
        rz[i] = br[step + AHEAD];
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int group = 4 * step + q;
        const uint4 lo = mine[g * 9 + 2 * q], hi = mine[g * 9 + 2 * q + 1];
        const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        const uint32_t sw = q < 2 ? sc.x : sc.y, zw = q < 2 ? zc.x : zc.y;
        const __nv_bfloat16 sg = __ushort_as_bfloat16((unsigned short)(q % 2 ? sw >> 16 : sw & 0xffff));
        const __nv_bfloat16 zg = __ushort_as_bfloat16((unsigned short)(q % 2 ? zw >> 16 : zw & 0xffff));
        const uint4 xa = xs[(group * 4 + t) * 2], xb = xs[(group * 4 + t) * 2 + 1];
        const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const uint32_t a0 = g == 0 ? xv[2 * c] : 0u, a2 = g == 0 ? xv[2 * c + 1] : 0u;
          const uint32_t q0 = (words[2 * c] >> (8 * t)) & 0xff, q1 = (words[2 * c + 1] >> (8 * t)) & 0xff;
          uint32_t b0, b1;
          if (MAGIC) {  // bf16 pairs 128 + q, minus 128 (exact), then one fma per value, as in expert_mma
            const __nv_bfloat162 base = __floats2bfloat162_rn(128.f, 128.f);
            const __nv_bfloat162 s2 = __bfloat162bfloat162(sg), z2 = __bfloat162bfloat162(zg);
            uint32_t p0 = 0x43004300u | (q0 & 15) | ((q0 >> 4) << 16), p1 = 0x43004300u | (q1 & 15) | ((q1 >> 4) << 16);
            __nv_bfloat162 v0 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p0), base), s2, z2);
            __nv_bfloat162 v1 = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&p1), base), s2, z2);
            b0 = *reinterpret_cast<uint32_t*>(&v0);
            b1 = *reinterpret_cast<uint32_t*>(&v1);
          } else {
            const __nv_bfloat16 w0 = __hfma(__uint2bfloat16_rn(q0 & 15), sg, zg);
            const __nv_bfloat16 w1 = __hfma(__uint2bfloat16_rn(q0 >> 4), sg, zg);
            const __nv_bfloat16 w2 = __hfma(__uint2bfloat16_rn(q1 & 15), sg, zg);
            const __nv_bfloat16 w3 = __hfma(__uint2bfloat16_rn(q1 >> 4), sg, zg);
            b0 = (uint32_t)__bfloat16_as_ushort(w0) | ((uint32_t)__bfloat16_as_ushort(w1) << 16);
            b1 = (uint32_t)__bfloat16_as_ushort(w2) | ((uint32_t)__bfloat16_as_ushort(w3) << 16);
          }
          asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                       "{%0,%1,%2,%3};"
                       : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                       : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
        }
      }
    }
  }
  if (g == 0) {
    out[(size_t)r * N + n0 + 2 * t] = __float2bfloat16_rn(d[0]);
    out[(size_t)r * N + n0 + 2 * t + 1] = __float2bfloat16_rn(d[1]);
  }
"""

SIDE_MMA = dict(name="glm53_probe_expert_side", inputs=["x", "w", "scales", "biases", "idx"], outputs=["out"],
                cuda=(SIDE, None))


def side(x, w, scales, biases, idx, warps=WARPS, ahead=1, magic=0):
    routes, n, k = idx.shape[0], w.shape[1], x.shape[1]
    return gpu_kernel(backend="cuda", **SIDE_MMA)(
        inputs=[x, w, scales, biases, idx],
        template=[("K", k), ("N", n), ("PER_ROW", routes // x.shape[0]), ("WARPS", warps), ("AHEAD", ahead),
                  ("MAGIC", magic)],
        grid=(n // (8 * warps) * 32 * warps, routes, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(routes, n)], output_dtypes=[x.dtype])[0]


LOADS = dict(name="glm53_probe_expert_loads", inputs=["x", "w", "scales", "biases", "idx"], outputs=["out"],
             cuda=(SOURCE, None))


def loads(x, w, scales, biases, idx, mode):
    routes, n, k = idx.shape[0], w.shape[1], x.shape[1]
    return gpu_kernel(backend="cuda", **LOADS)(
        inputs=[x, w, scales, biases, idx], template=[("K", k), ("N", n), ("WARPS", WARPS), ("MODE", mode)],
        grid=(n // (8 * WARPS) * 32 * WARPS, routes, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(routes, n // 8 * 32)], output_dtypes=[mx.uint32])[0]


def probe(label, n, k, routes):
    pool, per_route = pool_of(n, k, routes)
    variants = {"side by side": side, "side, 2 ahead": lambda *a: side(*a, ahead=2),
                "side, 3 ahead": lambda *a: side(*a, ahead=3), "side, magic": lambda *a: side(*a, magic=1),
                "side, 2 ahead, magic": lambda *a: side(*a, ahead=2, magic=1),
                "side, 8 warps": lambda *a: side(*a, warps=8), "side, 2 warps": lambda *a: side(*a, warps=2)}
    arms = {"stock gather_qmm": stock, "expert_mma": expert_mma, **variants,
            "fragment": lambda *a: loads(*a, 0), "coalesced": lambda *a: loads(*a, 2),
            "stream": lambda *a: loads(*a, 3)}
    expected = [stock(*p) for p in pool]  # stock's outputs, computed once for every variant
    mx.eval(expected)
    exact = {name: all(mx.array_equal(fn(*p), e).item() for p, e in zip(pool, expected))
             for name, fn in variants.items()}
    row = {"label": label, "n": n, "k": k, "routes": routes, "side_by_side_exact": exact,
           "arms": time_arms(arms, pool, routes, per_route)}
    print(f"{label} {n}x{k}, {routes} routes", flush=True)
    for name, a in row["arms"].items():
        verdict = f"  bit-identical {exact[name]}" if name in exact else ""
        print(f"    {name:22s} {a['us']:7.1f} us {a['gbps']:5.0f} GB/s{verdict}", flush=True)
    return row


if __name__ == "__main__":
    main(probe, "probe_expert_loads")

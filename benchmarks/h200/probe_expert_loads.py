"""Where does routed_experts' kernel lose its time: the loads, or the arithmetic? (issue 17, a probe)

routed_experts' first kernel (each lane loading its own row's 32 bytes of a
group) reached 1.0-1.2 TB/s at 8 routes (s36: 34-36 us per projection on an
H100 whose plain copy does about 2.4 TB/s), and loading more groups ahead
changed that by 6% at most. This times
kernels that only load, with the same grid and the same rows per warp, and
fold what they load into one word per lane (so nothing is optimized away;
their outputs mean nothing):

- ``fragment``: the loads that kernel issued for a group (each lane its row's
  32 bytes, that row's scale and bias), no dequantization, no MMA;
- ``fragment + x``: those and the input words the MMAs read (8 per group);
- ``side by side``: the same bytes, 4 lanes side by side in a row (64
  contiguous bytes an instruction), and a row's 4 scales and 4 biases as one
  8-byte load;
- ``stream``: each warp's 8 rows read as one contiguous run by all 32 lanes.

If ``fragment`` is already as slow as the kernel, the access pattern is the
limit and a faster exact kernel must reshape its loads (and then move bytes
between lanes); if it is much faster, the dequantization and MMA issue are.
s36: the loads took 27 of the then kernel's 37 us, side by side 20. A kernel
that read side by side and kept the arithmetic (written here first) was
bit-identical to ``gather_qmm`` and took 29-30 us; it is now routed_experts'
``expert_mma``, which this times beside its loads.

Usage: python probe_expert_loads.py [--out FILE.json]   (CUDA only)
"""

import mlx.core as mx
from probe_expert_mma import main, one, pool_of, stock, time_arms  # the same experts, routes, timing and output

from glm53_patches.kernels.build import gpu_kernel

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
    arms = {"stock gather_qmm": stock, "expert_mma": one, "fragment": lambda *a: loads(*a, 0),
            "fragment + x": lambda *a: loads(*a, 1), "side by side": lambda *a: loads(*a, 2),
            "stream": lambda *a: loads(*a, 3)}
    row = {"label": label, "n": n, "k": k, "routes": routes, "arms": time_arms(arms, pool, routes, per_route)}
    print(f"{label} {n}x{k}, {routes} routes", flush=True)
    for name, a in row["arms"].items():
        print(f"    {name:22s} {a['us']:7.1f} us {a['gbps']:5.0f} GB/s", flush=True)
    return row


if __name__ == "__main__":
    main(probe, "probe_expert_loads")

"""Can a routed-expert matvec be exact against MLX's CUDA gather_qmm, and faster? (issue 17, a probe)

At decode a token's 8 routes are one ``gather_qmm`` with M = 1 row per route
and B = 8 routes, so MLX 0.32's CUDA ``GatherQMM`` takes ``qmm_sm80``
(M x B >= 8), not the qmv path. Read from ``qmm_sm80.cuh`` (846d176) and its
sm_90a machine code: per output element, a chain over K in ascending 16-wide
chunks of one ``mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`` each, into a
float accumulator that starts at 0, no split over K; each weight dequantized
to bf16 as ``q * scale + bias`` in bf16, which ptxas fuses into one fma on
sm_90 (rounded once; on sm_80 it rounds twice); the sum rounded to bf16 at
the end. Nothing mixes the tile's rows, so row 0 is a matvec whatever the
other 15 rows hold.

This kernel keeps that chain per element and changes only who computes it
and how the weights arrive: one warp per 8 output rows of one route, each
lane loading its row's 32 bytes of a group (one group per iteration: its
scale and bias once), the x row in the MMA's row 0 (``FILL=1`` puts other
routes' inputs in rows 1-15, to check they do not matter). Variants: each
weight converted and dequantized alone (``__hfma``) or, ``MAGIC``, as
qmm_sm80 does it, in bf16 pairs (``0x4300 | q`` is 128 + q, minus 128 exactly,
then ``__hfma2``); ``TILES`` tiles of 8 rows per warp (more bytes in flight
per warp); 2, 4 warps per block. It is a probe,
not a patch: it reports per shape and route count whether every output is
bit-identical to ``mx.gather_qmm`` and the time of each (interleaved rounds
over random top-8 routes of 64 experts, weights larger than the L2).

Usage: python probe_expert_mma.py [--out FILE.json]   (CUDA only)
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

EXPERTS, GROUP, BITS = 64, 64, 4
ROUNDS, REPS, POOL = 5, 20, 16  # s35: 5 arms' timings took about 15 s of a 55 s run

SOURCE = r"""
  // Template constants: K, N, WARPS, TILES, MAGIC, FILL. One warp: route r = blockIdx.y, output rows
  // n0 .. n0 + 8 TILES - 1, as TILES tiles of 8 (each its own MMA chain; the x fragment shared).
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;  // the MMA fragment's group and thread in group
  const int r = blockIdx.y, routes = gridDim.y;
  const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * 8 * TILES;
  if (n0 >= N) {
    return;
  }
  const uint8_t* wr[TILES];
  const __nv_bfloat16* sr[TILES];
  const __nv_bfloat16* br[TILES];
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const size_t row = (size_t)idx[r] * N + n0 + 8 * j + g;  // B's column g is weight row n0 + 8j + g
    wr[j] = reinterpret_cast<const uint8_t*>(w) + row * (K / 2);
    sr[j] = scales + row * (K / 64);
    br[j] = biases + row * (K / 64);
  }
  // A's row g: the route's input in row 0; rows 1-15 zero, or (FILL) other routes' inputs
  const bool real = g == 0 || FILL;
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x) + (size_t)((r + g) % routes) * (K / 2);
  float d[TILES][4] = {};
#pragma unroll 4
  for (int group = 0; group < K / 64; ++group) {
    uint32_t words[TILES][8];
    __nv_bfloat16 s[TILES], z[TILES];
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const uint4 lo = *reinterpret_cast<const uint4*>(wr[j] + group * 32);
      const uint4 hi = *reinterpret_cast<const uint4*>(wr[j] + group * 32 + 16);
      words[j][0] = lo.x; words[j][1] = lo.y; words[j][2] = lo.z; words[j][3] = lo.w;
      words[j][4] = hi.x; words[j][5] = hi.y; words[j][6] = hi.z; words[j][7] = hi.w;
      s[j] = sr[j][group];
      z[j] = br[j][group];
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
        if (MAGIC) {  // bf16 pairs 128 + q, minus 128 (exact), then one fma per value: qmm_sm80's own steps
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
  if (g == 0) {  // D's row 0: columns 2t and 2t + 1 are output rows n0 + 8j + 2t, + 1
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      out[(size_t)r * N + n0 + 8 * j + 2 * t] = __float2bfloat16_rn(d[j][0]);
      out[(size_t)r * N + n0 + 8 * j + 2 * t + 1] = __float2bfloat16_rn(d[j][1]);
    }
  }
"""

KERNEL = None


def expert_mma(x, w, scales, biases, idx, warps=4, fill=0, tiles=1, magic=0):
    """``x [R, K]`` (bf16), route r through expert ``idx[r]``: ``[R, N]``."""
    global KERNEL
    if KERNEL is None:
        KERNEL = mx.fast.cuda_kernel(name="glm53_probe_expert_mma", input_names=["x", "w", "scales", "biases", "idx"],
                                     output_names=["out"], source=SOURCE)
    routes, k = x.shape
    n = w.shape[1]
    return KERNEL(inputs=[x, w, scales, biases, idx],
                  template=[("K", k), ("N", n), ("WARPS", warps), ("TILES", tiles), ("MAGIC", magic), ("FILL", fill)],
                  grid=(-(-n // (8 * tiles * warps)) * 32 * warps, routes, 1), threadgroup=(32 * warps, 1, 1),
                  output_shapes=[(routes, n)], output_dtypes=[x.dtype])[0]


def stock(x, w, scales, biases, idx):
    return mx.gather_qmm(x[:, None, :], w, scales, biases, rhs_indices=idx, transpose=True, group_size=GROUP,
                         bits=BITS)[:, 0, :]


def timed(fn, args):
    outs = [fn(*args[i % len(args)]) for i in range(REPS)]
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - start) / REPS


def probe(label, n, k, routes):
    key = mx.random.key(n + k)
    weight = (mx.random.normal((EXPERTS, n, k), key=key) * k**-0.5).astype(mx.bfloat16)
    w, s, b = mx.quantize(weight, group_size=GROUP, bits=BITS)
    del weight
    pool = []
    for i in range(POOL):
        x = mx.random.normal((routes, k), key=mx.random.key(100 + i)).astype(mx.bfloat16)
        picks = [mx.random.permutation(EXPERTS, key=mx.random.key(1000 * i + j))[:8] for j in range(-(-routes // 8))]
        pool.append((x, w, s, b, mx.concatenate(picks)[:routes].astype(mx.uint32)))
    mx.eval(w, s, b, pool)
    arms = {"stock": stock, "mma": expert_mma, "mma w2": lambda *a: expert_mma(*a, warps=2),
            "magic": lambda *a: expert_mma(*a, magic=1),
            "magic w2": lambda *a: expert_mma(*a, magic=1, warps=2),
            "magic 2 tiles": lambda *a: expert_mma(*a, magic=1, tiles=2),
            "magic 2 tiles w2": lambda *a: expert_mma(*a, magic=1, tiles=2, warps=2),
            "magic 4 tiles w2": lambda *a: expert_mma(*a, magic=1, tiles=4, warps=2)}
    exact = {name: all(mx.array_equal(fn(*p), stock(*p)).item() for p in pool) for name, fn in arms.items()}
    exact["magic 2 tiles, other rows filled"] = all(
        mx.array_equal(expert_mma(*p, fill=1, magic=1, tiles=2), stock(*p)).item() for p in pool)
    deviation = max(mx.max(mx.abs(expert_mma(*p).astype(mx.float32) - stock(*p).astype(mx.float32))).item()
                    for p in pool)
    times = {name: [] for name in arms}
    for name, fn in arms.items():
        timed(fn, pool)
    for r in range(ROUNDS):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[name].append(timed(arms[name], pool))
    per_route = (w.nbytes + s.nbytes + b.nbytes) / EXPERTS
    row = {"label": label, "n": n, "k": k, "routes": routes, "exact": exact, "max_deviation": deviation,
           "arms": {name: {"us": statistics.median(ts) * 1e6, "gbps": routes * per_route / statistics.median(ts) / 1e9,
                           "us_rounds": [t * 1e6 for t in ts]} for name, ts in times.items()}}
    print(f"{label} {n}x{k}, {routes} routes: max deviation (mma) {deviation:g}", flush=True)
    for name, a in row["arms"].items():
        print(f"    {name:18s} {a['us']:7.1f} us {a['gbps']:5.0f} GB/s  exact {exact[name]}", flush=True)
    print(f"    {'other rows filled':18s} exact {exact['magic 2 tiles, other rows filled']}", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe_expert_mma.json")
    args = parser.parse_args()
    if mx.metal.is_available() or mx.default_device() != mx.gpu:
        raise SystemExit("probe_expert_mma: needs MLX's CUDA backend")
    rows = [probe(label, n, k, routes) for routes in (8, 32)
            for label, n, k in (("gate/up", 2048, 4096), ("down", 4096, 2048))]
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

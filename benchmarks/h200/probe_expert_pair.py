"""A decode step's up and gate in one launch of routed_experts' kernel, against two (issue 17, s49).

At 8 routes one projection's launch is 256 blocks of 4 warps, which leaves
an H100's memory pipes half idle: s41 timed it at 1.5 TB/s, and 2.05 TB/s at
32 routes. Up and gate read the same input, so one launch can take both
(``blockIdx.z`` picks the projection; every block runs the same body). This
times, for the gate/up shape (2048 x 4096, 4-bit, group 64, 64 experts, random
top-8 per call, weights larger than the L2), interleaved rounds of:

- ``stock, 2 calls``: two ``gather_qmm`` (what mlx-vlm runs);
- ``kernel, 2 launches``: the patch's kernel per projection (before s49);
- ``kernel, 1 launch``: both in one launch, and that launch with 8 warps.

Every arm's outputs are checked bit for bit against stock's on every call.

Usage: python probe_expert_pair.py [--out FILE.json]   (CUDA only)
"""

import argparse
import json

import mlx.core as mx
from probe_expert_mma import exact_arms, one, pool_of, stock, time_arms

from glm53_patches.patches.routed_experts.kernel import expert_mma

N, K = 2048, 4096


def probe(routes):
    ups, per_route = pool_of(N, K, routes)
    gates, _ = pool_of(N, K, routes, seed=1)
    pool = [(x, idx, (w, s, b), gate[1:4]) for (x, w, s, b, idx), gate in zip(ups, gates)]
    arms = {
        "stock, 2 calls": lambda x, idx, up, gate: [stock(x, *up, idx), stock(x, *gate, idx)],
        "kernel, 2 launches": lambda x, idx, up, gate: [one(x, *up, idx), one(x, *gate, idx)],
        "kernel, 1 launch": lambda x, idx, up, gate: expert_mma(x, idx, [up, gate]),
        "1 launch, 8 warps": lambda x, idx, up, gate: expert_mma(x, idx, [up, gate], warps=8),
    }
    exact = exact_arms(arms, pool, [arms["stock, 2 calls"](*p) for p in pool])
    row = {"n": N, "k": K, "routes": routes, "exact": exact,
           "arms": time_arms(arms, pool, 2 * routes, per_route)}  # GB/s of both projections' routes
    print(f"up and gate {N}x{K}, {routes} routes", flush=True)
    for name, a in row["arms"].items():
        print(f"    {name:20s} {a['us']:7.1f} us {a['gbps']:5.0f} GB/s  exact {exact[name]}", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="probe_expert_pair.json")
    args = parser.parse_args()
    if mx.metal.is_available() or mx.default_device() != mx.gpu:
        raise SystemExit("probe_expert_pair: needs MLX's CUDA backend")
    rows = [probe(routes) for routes in (8, 16)]
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

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

The kernel (``glm53_patches/patches/routed_experts/kernel.py``, the
routed_experts patch's; until s35's run it lived here) keeps that chain and
changes only the work split: one warp per 16 output rows of a route, its
weights the MMA's A operand (since s40; before, the input was A's row 0 and
a warp took 8 rows), read 4 lanes side by side (since s36; first each lane
read its own row's bytes). This probe reports, per shape and route count, whether every
output of each setting is bit-identical to ``mx.gather_qmm`` and the time of
each (interleaved rounds over random top-8 routes of 64 experts, weights
larger than the L2): the default launch, 2 and 3 steps loaded ahead (the
default is 1), and 8 and 2 warps; with ``--baseline``, also another version of the
kernel module (e.g. ``git show REV:glm53_patches/patches/routed_experts/kernel.py``),
side by side with this one.

Usage: python probe_expert_mma.py [--out FILE.json] [--baseline KERNEL.py]   (CUDA only)
"""

import argparse
import importlib.util
import json
import statistics

import mlx.core as mx
from micro_qmv import timed  # REPS calls over the pool, one evaluation: seconds per call

from glm53_patches.kernels.build import gpu_kernel

from glm53_patches.patches.routed_experts.kernel import expert_mma

EXPERTS, GROUP, BITS = 64, 64, 4
ROUNDS, REPS, POOL = 5, 20, 16  # s35: 5 arms' timings took about 15 s of a 55 s run


def one(x, w, scales, biases, idx, **settings):
    """The patch's kernel on one projection, in the order of the probes' operands."""
    return expert_mma(x, idx, [(w, scales, biases)], **settings)[0]


def stock(x, w, scales, biases, idx):
    return mx.gather_qmm(x[:, None, :], w, scales, biases, rhs_indices=idx, transpose=True, group_size=GROUP,
                         bits=BITS)[:, 0, :]


def pool_of(n, k, routes, seed=0):
    """POOL calls' operands over one set of 64 random 4-bit experts ([n, k] each; ``seed`` picks the set): a
    random input per route and random top-8 picks, the same for every set. Also returns the bytes of one
    route's weights, scales and biases."""
    key = mx.random.key(n + k + seed)
    weight = (mx.random.normal((EXPERTS, n, k), key=key) * k**-0.5).astype(mx.bfloat16)
    w, s, b = mx.quantize(weight, group_size=GROUP, bits=BITS)
    del weight
    pool = []
    for i in range(POOL):
        x = mx.random.normal((routes, k), key=mx.random.key(100 + i)).astype(mx.bfloat16)
        picks = [mx.random.permutation(EXPERTS, key=mx.random.key(1000 * i + j))[:8] for j in range(-(-routes // 8))]
        pool.append((x, w, s, b, mx.concatenate(picks)[:routes].astype(mx.uint32)))
    mx.eval(w, s, b, pool)
    return pool, (w.nbytes + s.nbytes + b.nbytes) / EXPERTS


def exact_arms(arms, pool, expected):
    """Per arm: whether its output (an array, or a list of them) is bit for bit ``expected`` (stock's) on every
    call of the pool."""
    mx.eval(expected)

    def same(actual, want):
        return all(mx.array_equal(a, e).item() for a, e in (zip(actual, want) if isinstance(want, list) else
                                                              [(actual, want)]))

    return {name: all(same(fn(*p), e) for p, e in zip(pool, expected)) for name, fn in arms.items()}


def compare(label, n, k, routes, arms, pool, per_route, expected=None):
    """Each arm checked bit for bit against stock on the pool (``expected``: stock's outputs, where the caller
    has them) and timed (``time_arms``), printed: the row."""
    exact = exact_arms(arms, pool, expected or [stock(*p) for p in pool])
    row = {"label": label, "n": n, "k": k, "routes": routes, "exact": exact,
           "arms": time_arms(arms, pool, routes, per_route)}
    print(f"{label} {n}x{k}, {routes} routes", flush=True)
    for name, a in row["arms"].items():
        print(f"    {name:24s} {a['us']:7.1f} us {a['gbps']:5.0f} GB/s  exact {exact[name]}", flush=True)
    return row


def launch(spec, x, w, scales, biases, idx, *, warps, settings, rows_per_warp=8, extra_outputs=()):
    """A probe's kernel (``spec``, as ``gpu_kernel`` takes it) launched over the routes as the patch launches
    its own: template K, N, PER_ROW and WARPS, then ``settings``; a warp per ``rows_per_warp`` output rows of a
    route. Returns the ``[R, N]`` output, or all outputs where ``extra_outputs`` ((shape, dtype) each) adds some."""
    rows, k = x.shape
    routes, n = idx.shape[0], w.shape[1]
    outputs = gpu_kernel(backend="cuda", **spec)(
        inputs=[x, w, scales, biases, idx],
        template=[("K", k), ("N", n), ("PER_ROW", routes // rows), ("WARPS", warps), *settings],
        grid=(n // (rows_per_warp * warps) * 32 * warps, routes, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(routes, n), *(shape for shape, _ in extra_outputs)],
        output_dtypes=[x.dtype, *(dtype for _, dtype in extra_outputs)],
    )
    return outputs if extra_outputs else outputs[0]


def time_arms(arms, pool, routes, per_route):
    """Each arm's median seconds per call over ROUNDS interleaved rounds (after one untimed pass each), as
    us and GB/s of the routes' weights, with every round's us."""
    times = {name: [] for name in arms}
    for fn in arms.values():
        timed(fn, pool, REPS)
    for r in range(ROUNDS):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[name].append(timed(arms[name], pool, REPS)[0])
    return {name: {"us": statistics.median(ts) * 1e6, "gbps": routes * per_route / statistics.median(ts) / 1e9,
                   "us_rounds": [t * 1e6 for t in ts]} for name, ts in times.items()}


def load_baseline(path):
    """``expert_mma`` of another version of the kernel module, its kernel renamed so both can be built."""
    spec = importlib.util.spec_from_file_location("baseline_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.EXPERT_MMA["name"] += "_baseline"
    return module.expert_mma


def probe(label, n, k, routes, baseline=None):
    pool, per_route = pool_of(n, k, routes)
    arms = {"stock": stock, **({"baseline": baseline} if baseline else {}),
            "kernel": one,  # the default: 4 warps, 1 step ahead
            "2 ahead": lambda *a: one(*a, ahead=2),
            "3 ahead": lambda *a: one(*a, ahead=3),
            "8 warps": lambda *a: one(*a, warps=8),
            "2 warps": lambda *a: one(*a, warps=2)}
    expected = [stock(*p) for p in pool]  # stock's outputs, computed once for every check
    row = compare(label, n, k, routes, arms, pool, per_route, expected)
    row["max_deviation"] = max(mx.max(mx.abs(one(*p).astype(mx.float32) - e.astype(mx.float32))).item()
                               for p, e in zip(pool, expected))
    print(f"    max deviation (kernel) {row['max_deviation']:g}", flush=True)
    return row


PROBE = probe


def main(probe=PROBE, name="probe_expert_mma"):
    """Every shape at 8 and 32 routes, printed and written to --out (JSON)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=f"{name}.json")
    if probe is PROBE:  # the probes that reuse main() have their own arms
        parser.add_argument("--baseline", help="another version of routed_experts' kernel.py, timed beside it")
    args = parser.parse_args()
    if mx.metal.is_available() or mx.default_device() != mx.gpu:
        raise SystemExit(f"{name}: needs MLX's CUDA backend")
    baseline = getattr(args, "baseline", None)
    extra = {"baseline": load_baseline(baseline)} if baseline else {}
    rows = [probe(label, n, k, routes, **extra) for routes in (8, 32)
            for label, n, k in (("gate/up", 2048, 4096), ("down", 4096, 2048))]
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

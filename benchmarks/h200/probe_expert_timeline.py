"""Where does a routed-experts call spend the ~10 us it takes beyond its loads? (issue 17, a probe)

s39 ruled out issue slots, bytes in flight and the input's prologue one by
one (routed_experts' PATCH.md): each change kept the arithmetic and ran no
faster. This probe looks instead of guessing. It runs the patch's kernel
text with timestamps added (nothing else changed): each warp's lane 0
records the global timer at its start and end, its SM, and its own clock
after the block's prologue, after its first step, halfway and at the end.
From those it prints, per shape and route count:

- the call as the GPU saw it (first warp's start to last warp's end) against
  the call's time in probe_expert_mma.py's harness;
- when warps start (the launch ramp) and end (the tail), from the first start;
- per warp, in us: the prologue, the first step (its loads waited for in
  full), the mean of the steady steps, and the whole warp;
- warps per SM.

The instrumented kernel's outputs are checked bit for bit against
``gather_qmm`` (the stamps must not change what it computes).

Usage: python probe_expert_timeline.py [--out FILE.json]   (CUDA only)
"""

import statistics

import mlx.core as mx
from probe_expert_mma import launch, main, one, pool_of, stock, time_arms

from glm53_patches.patches.routed_experts import kernel

STAMPS = 8  # per warp: start and end (global timer, ns), SM, and clocks at start, prologue, step 0, half, end
HEADER = r"""
__device__ inline unsigned long long glm53_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ inline unsigned glm53_smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
"""


def instrumented_source():
    """The patch's kernel text with the stamps put in at four places; fails loudly if the text moved."""
    source = kernel.SOURCE
    edits = [
        ("  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 16;  // 16 output rows a warp: the MMA's M\n",
         "  const int n0 = (blockIdx.x * WARPS + warp_in_block) * 16;\n"
         "  const unsigned long long t_start = glm53_globaltimer();\n"
         "  const long long c_start = clock64();\n"
         "  long long c_prologue = 0, c_first = 0, c_half = 0;\n"),
        ("  __syncthreads();\n", "  __syncthreads();\n  c_prologue = clock64();\n"),
        ("        }\n      }\n    }\n  }\n  if (t == 0) {",
         "        }\n      }\n"
         "      if (step == 0) c_first = clock64();\n"
         "      if (step == STEPS / 2) c_half = clock64();\n"
         "    }\n  }\n  if (t == 0) {"),
    ]
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"probe_expert_timeline: the kernel text moved; cannot find {old!r}")
        source = source.replace(old, new)
    return source + r"""
  if (lane == 0) {
    const long long c_end = clock64();
    const size_t at = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * WARPS + warp_in_block;
    auto* s = stamps + at * 8;  // int64 as MLX names it
    s[0] = t_start;
    s[1] = glm53_globaltimer();
    s[2] = glm53_smid();
    s[3] = c_start;
    s[4] = c_prologue;
    s[5] = c_first;
    s[6] = c_half;
    s[7] = c_end;
  }
"""


TIMELINE = dict(name="glm53_probe_expert_timeline", inputs=["x", "w", "scales", "biases", "idx"],
                outputs=["out", "stamps"], cuda=(instrumented_source(), HEADER))


def timeline(x, w, scales, biases, idx, warps=kernel.WARPS):
    """The patch's default launch, instrumented: ``(out, stamps)``, stamps ``[warps in the grid, 8]`` int64."""
    grid_warps = idx.shape[0] * w.shape[1] // kernel.ROWS  # a warp per 16 output rows of a route
    return launch(TIMELINE, x, w, scales, biases, idx, warps=warps, settings=[("AHEAD", kernel.AHEAD)],
                  rows_per_warp=kernel.ROWS,
                  extra_outputs=[((grid_warps, STAMPS), mx.int64)])


def summary(stamps, steps):
    """What the stamps of one call say, in us: a dict of figures (see the module's docstring)."""
    rows = [list(map(int, r)) for r in stamps.tolist()]
    first = min(r[0] for r in rows)
    wall_ns = max(r[1] for r in rows) - first
    # each SM's clock against the global timer over its warps' lifetimes: cycles per us
    rate = statistics.median((r[7] - r[3]) / max(r[1] - r[0], 1) * 1e3 for r in rows)

    def spread(values):
        values = sorted(values)
        return {"min": values[0], "median": values[len(values) // 2], "max": values[-1]}

    per_sm = {}
    for r in rows:
        per_sm[r[2]] = per_sm.get(r[2], 0) + 1
    steady = max(steps // 2, 1)  # from after step 0 to after step STEPS / 2
    return {
        "wall_us": wall_ns / 1e3,
        "clock_per_us": rate,
        "start_us": spread([(r[0] - first) / 1e3 for r in rows]),
        "end_us": spread([(r[1] - first) / 1e3 for r in rows]),
        "prologue_us": spread([(r[4] - r[3]) / rate for r in rows]),
        "first_step_us": spread([(r[5] - r[4]) / rate for r in rows]),
        "steady_step_us": spread([(r[6] - r[5]) / steady / rate for r in rows]),
        "warp_us": spread([(r[7] - r[3]) / rate for r in rows]),
        "warps_per_sm": spread(list(per_sm.values())),
        "sms": len(per_sm),
    }


def probe(label, n, k, routes):
    pool, per_route = pool_of(n, k, routes)
    exact = all(mx.array_equal(timeline(*p)[0], stock(*p)).item() for p in pool)
    arms = {"stock": stock, "kernel": one, "instrumented": lambda *a: timeline(*a)[0]}
    times = time_arms(arms, pool, routes, per_route)
    calls = []
    for p in pool[:4]:  # one call at a time, each evaluated alone
        out, stamps = timeline(*p)
        mx.eval(out, stamps)
        calls.append(summary(stamps, k // kernel.STEP))
    row = {"label": label, "n": n, "k": k, "routes": routes, "exact": exact, "arms": times, "calls": calls}
    print(f"{label} {n}x{k}, {routes} routes: instrumented exact {exact}", flush=True)
    for name, a in times.items():
        print(f"    {name:14s} {a['us']:7.1f} us in the harness", flush=True)
    for c in calls:
        print(f"    call: wall {c['wall_us']:.1f} us, {c['sms']} SMs ({c['warps_per_sm']['min']}-"
              f"{c['warps_per_sm']['max']} warps), clock {c['clock_per_us']:.0f}/us; from the first start, "
              f"starts {c['start_us']['median']:.1f} [{c['start_us']['max']:.1f}], ends "
              f"{c['end_us']['min']:.1f}-{c['end_us']['max']:.1f}", flush=True)
        print(f"          per warp (median [max]): prologue {c['prologue_us']['median']:.2f} "
              f"[{c['prologue_us']['max']:.2f}], first step {c['first_step_us']['median']:.2f} "
              f"[{c['first_step_us']['max']:.2f}], steady step {c['steady_step_us']['median']:.2f} "
              f"[{c['steady_step_us']['max']:.2f}], whole {c['warp_us']['median']:.1f} "
              f"[{c['warp_us']['max']:.1f}]", flush=True)
    return row


if __name__ == "__main__":
    main(probe, "probe_expert_timeline")

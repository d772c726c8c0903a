"""exact_qmv against MLX's qmv, one decode projection at a time, at GLM-5.3-Flash's widths (issue 17).

For each projection of a decode step (``exact_qmv.checks.verify.REAL``, plus
4-bit versions of two), stock ``mx.quantized_matmul`` and, at the widths the
patch takes (``linear.TAKES_BITS``), ``kernel.qmv`` at several launch shapes
(passes ahead, warps per block, rows per warp; the first is the default) run
interleaved, ROUNDS rounds of REPS calls each, over enough copies of the
weights that they do not stay in the 50 MB L2. Per arm: the median per-call
time, the spread of the round medians, GB/s (weights, scales and biases read
once per call), and whether every output of the arm equals stock's bit for
bit. Then stock's routed experts at decode (``gather_qmm``, top-8 of 64 at one
token, 4-bit), the other half of issue 17. Last, the step estimate: each
projection's saving at the default launch times how often a 45-layer decode
step calls it. A device copy gives the bandwidth ceiling. ``MICRO_SMALL=1``
shrinks everything for a CPU dry run (the kernel arms need CUDA and are
skipped there).

Usage: python micro_qmv.py [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import time

import mlx.core as mx

from glm53_patches.exactness import same_bits
from glm53_patches.patches.exact_qmv import kernel, linear
from glm53_patches.patches.exact_qmv.checks.verify import REAL, case_inputs

SMALL = os.environ.get("MICRO_SMALL") == "1"
ROUNDS, REPS = (2, 3) if SMALL else (3, 30)
ROTATION_BYTES = 2e6 if SMALL else 600e6
# How often a decode step calls each projection: 34 KDA and 11 DSA layers, 42 MoE and 3 dense MLPs.
PER_STEP = {"KDA": 34, "DSA": 11, "indexer": 11, "shared": 42, "dense": 3, "lm_head": 1}
SWEEP = {"default": {}, "a1w8r1": dict(ahead=1, warps=8, rpw=1), "a4w8r1": dict(ahead=4, warps=8, rpw=1),
         "a1w8r2": dict(ahead=1, warps=8, rpw=2)}


def calls_per_step(label):
    if label.startswith("KDA f_b_proj"):
        return 2 * PER_STEP["KDA"]  # f_b_proj and g_b_proj
    for prefix, count in PER_STEP.items():
        if label.lower().startswith(prefix.lower()):
            return count
    return 0


def timed(fn, copies, reps):
    outs = [fn(*copies[i % len(copies)]) for i in range(reps)]
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - start) / reps, outs


def measure(label, n, k, bits, arms, per_step=0):
    if SMALL:
        n, k = max(n // 64, 8), max(k // 16, 128)
    x, w, s, b = case_inputs(n, k, bits, 64, mx.bfloat16, 1, 0)
    nbytes = w.nbytes + s.nbytes + b.nbytes
    copies = [(w, s, b)] + [case_inputs(n, k, bits, 64, mx.bfloat16, 1, i)[1:] for i in range(1, max(2, int(ROTATION_BYTES // nbytes) + 1))]
    stock = lambda w, s, b: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits)  # noqa: E731
    reference = [stock(*c) for c in copies]
    mx.eval(reference)
    fns = {"stock": stock}
    for name, launch in arms.items():
        fns[name] = lambda w, s, b, launch=launch: kernel.qmv(x, w, s, b, bits, 64, **launch)
    times = {name: [] for name in fns}
    exact = {name: True for name in fns}
    for name, fn in fns.items():  # compile and warm each arm
        timed(fn, copies, len(copies))
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            seconds, outs = timed(fn, copies, REPS)
            times[name].append(seconds)
            exact[name] &= all(same_bits(outs[i], reference[i % len(copies)]) for i in range(min(len(copies), len(outs))))
    rows = {}
    for name in fns:
        med = statistics.median(times[name])
        rows[name] = {"us": med * 1e6, "us_rounds": [t * 1e6 for t in times[name]], "gbps": nbytes / med / 1e9,
                      "exact": exact[name]}
    return {"label": label, "n": n, "k": k, "bits": bits, "bytes": nbytes, "copies": len(copies),
            "per_step": per_step, "arms": rows}


def experts(top_k=8, count=64, bits=4):
    """Stock's routed experts at one decode token: gather_qmm over the top-8 of ``count`` experts."""
    rows = []
    for label, n, k in (("experts gate/up", 2048, 4096), ("experts down", 4096, 2048)):
        if SMALL:
            n, k, count = n // 16, k // 16, 16
        key = mx.random.key(1)
        x = mx.random.normal((1, 1, 1, k), key=key).astype(mx.bfloat16)
        weight = (mx.random.normal((count, n, k), key=key) * k**-0.5).astype(mx.bfloat16)
        w, s, b = mx.quantize(weight, group_size=64, bits=bits)
        del weight
        index = mx.array([[3, 9, 17, 22, 31, 40, 51, 60][:top_k]], dtype=mx.uint32) % count
        mx.eval(x, w, s, b, index)
        per_expert = (w.nbytes + s.nbytes + b.nbytes) / count
        times = []
        for _ in range(ROUNDS):
            seconds, _ = timed(lambda i: mx.gather_qmm(x, w, s, b, rhs_indices=(index + i) % count, transpose=True,
                                                       group_size=64, bits=bits), [(i,) for i in range(8)], REPS)
            times.append(seconds)
        med = statistics.median(times)
        rows.append({"label": label, "n": n, "k": k, "experts": count, "top_k": top_k, "us": med * 1e6,
                     "gbps": top_k * per_expert / med / 1e9})
        print(f"stock gather_qmm {label:16s} top-{top_k} of {count}: {med * 1e6:7.1f} us "
              f"{rows[-1]['gbps']:6.0f} GB/s", flush=True)
    return rows


def copy_ceiling():
    """Read + write GB/s of ``a + 1`` over 256 MB, the best of 5 timings of 4 calls: s27 and s28 timed
    one batch of 10 with a cold allocator (10 new GB), which gave 915-998 GB/s, no ceiling."""
    a = mx.random.normal((64 * 1024 * 1024,)) if not SMALL else mx.ones((1 << 20,))
    mx.eval(a)
    seconds = min(timed(lambda a: a + 1, [(a,)], 4)[0] for _ in range(5))
    return 2 * a.nbytes / seconds / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="micro_qmv.json")
    args = parser.parse_args()
    on_cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    results = {"device": str(mx.default_device()), "copy_gbps": copy_ceiling(), "launch_default":
               dict(ahead=kernel.AHEAD, warps=kernel.WARPS, rpw=kernel.RPW), "rows": []}
    print(f"copy ceiling {results['copy_gbps']:.0f} GB/s", flush=True)
    shapes = [(*shape, calls_per_step(shape[0])) for shape in REAL]
    shapes += [("4-bit KDA qkv_proj", 24576, 4096, 4, 0), ("4-bit KDA o_proj", 4096, 8192, 4, 0)]  # not in the step
    for label, n, k, bits, per_step in shapes:
        arms = SWEEP if on_cuda and bits in linear.TAKES_BITS else {}
        row = measure(label, n, k, bits, arms, per_step)
        results["rows"].append(row)
        print(f"{label:28s} {n:>6}x{k:<5} {bits}b " + "  ".join(
            f"{a}: {r['us']:8.1f} us {r['gbps']:6.0f} GB/s {'exact' if r['exact'] else 'DIFFERS'}"
            for a, r in row["arms"].items()), flush=True)
    results["experts"] = experts()
    if on_cuda:
        saved = sum(r["per_step"] * (r["arms"]["stock"]["us"] - r["arms"]["default"]["us"])
                    for r in results["rows"] if "default" in r["arms"])
        results["step_saving_ms"] = saved / 1e3
        print(f"estimated saving per 45-layer decode step at the default launch: {saved / 1e3:.2f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""block_qmv against stock's block projection, one projection at a time, at GLM-5.3-Flash's widths (issue 16).

For each projection of a layer that stock's singleton path takes in a verify
block (``block_qmv.checks.verify.case_module``; widths that are multiples of
512) and each block size P (2, 4 and 7 positions): stock (mlx-vlm's
``native_batch_linear``: one gather_qmv over the positions, the weights read
per position) and ``kernel.block_qmv`` at several launch shapes (the first is
the default) run interleaved, ROUNDS rounds of REPS calls each, over enough
copies of the weights that they do not stay in the 50 MB L2 (micro_qmv's
timing). Per arm: the median per-call time, GB/s of the weights read once,
and whether every output equals stock's bit for bit. Last, what a 4-token
block would save: each projection's saving at the default launch times how
often a 45-layer step calls it. ``MICRO_SMALL=1`` shrinks everything for a CPU
dry run (the kernel arms need CUDA and are skipped there).

Usage: python micro_block_qmv.py [--out FILE.json] [--positions 2,4,7] [--only LABEL,...]
"""

import argparse
import json
import statistics

import mlx.core as mx
from micro_qmv import REPS, ROTATION_BYTES, ROUNDS, SMALL, calls_per_step, copy_ceiling, timed
from mlx_vlm.models.linear import native_batch_linear

from glm53_patches.exactness import same_bits
from glm53_patches.patches.block_qmv import kernel
from glm53_patches.patches.block_qmv.checks.verify import REAL, case_module

POSITIONS = (2, 4, 7)
# s34 (H100): one row per warp (w8r1, w4r1) was slower at 4 and 7 positions and the sweep did not finish
# in 210 s; 8 warps of 2 rows stayed within a few percent of the default. Kept: the default and w8r2.
SWEEP = {"default": {}, "w8r2": dict(warps=8, rpw=2)}


def measure(label, n, k, bits, positions, arms):
    if SMALL:
        n, k = max(n // 64, 8), 512
    module, x = case_module(n, k, bits, 64, mx.bfloat16, positions, 0)
    nbytes = sum(module[name].nbytes for name in ("weight", "scales", "biases"))
    copies = [module] + [case_module(n, k, bits, 64, mx.bfloat16, positions, i)[0]
                         for i in range(1, max(2, int(ROTATION_BYTES // nbytes) + 1))]
    reference = [native_batch_linear(m, x) for m in copies]
    mx.eval(reference)
    fns = {"stock": lambda m: native_batch_linear(m, x)}
    for name, launch in arms.items():
        fns[name] = lambda m, launch=launch: kernel.block_qmv(x[0], m["weight"], m["scales"], m["biases"], bits,
                                                             64, **launch)[None]
    times = {name: [] for name in fns}
    exact = {name: True for name in fns}
    for fn in fns.values():  # compile and warm each arm
        timed(fn, [(m,) for m in copies], len(copies))
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            seconds, outs = timed(fn, [(m,) for m in copies], REPS)
            times[name].append(seconds)
            exact[name] &= all(same_bits(outs[i], reference[i % len(copies)]) for i in range(min(len(copies), len(outs))))
    rows = {name: {"us": statistics.median(times[name]) * 1e6, "us_rounds": [t * 1e6 for t in times[name]],
                   "gbps": nbytes / statistics.median(times[name]) / 1e9, "exact": exact[name]} for name in fns}
    return {"label": label, "n": n, "k": k, "bits": bits, "positions": positions, "bytes": nbytes,
            "copies": len(copies), "per_step": calls_per_step(label), "arms": rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="micro_block_qmv.json")
    parser.add_argument("--positions", default=",".join(map(str, POSITIONS)), help="block sizes (default 2,4,7)")
    parser.add_argument("--only", default="", help="comma-separated labels to measure (default: all)")
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    only = {label.strip() for label in args.only.split(",") if label.strip()}
    on_cuda = mx.default_device() == mx.gpu and not mx.metal.is_available()
    results = {"device": str(mx.default_device()), "copy_gbps": copy_ceiling(),
               "launch_default": dict(warps=kernel.WARPS, rpw=kernel.RPW), "rows": []}
    print(f"copy ceiling {results['copy_gbps']:.0f} GB/s", flush=True)
    for label, n, k, bits in [shape for shape in REAL if shape[2] % 512 == 0 and (not only or shape[0] in only)]:
        for p in positions:
            row = measure(label, n, k, bits, p, SWEEP if on_cuda else {})
            results["rows"].append(row)
            print(f"{label:24s} {row['n']:>6}x{row['k']:<5} {bits}b P={p} " + "  ".join(
                f"{a}: {r['us']:8.1f} us {r['gbps']:6.0f} GB/s {'exact' if r['exact'] else 'DIFFERS'}"
                for a, r in row["arms"].items()), flush=True)
    if on_cuda:
        saved = sum(r["per_step"] * (r["arms"]["stock"]["us"] - r["arms"]["default"]["us"])
                    for r in results["rows"] if r["positions"] == 4)
        results["block4_saving_ms"] = saved / 1e3
        print(f"estimated saving per 4-token verify block, 45 layers, default launch: {saved / 1e3:.2f} ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

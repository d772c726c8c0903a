"""Is a short block's dense per-position matvec, as one batched gemv, bit for bit stock's tokenwise calls? (issue 16)

``glm53_patches.kernels.rowwise.block_matvecs`` against mlx-vlm's ``tokenwise(lambda p: p @ w.T, x)`` at the
shapes a verify block computes that way at batch 1: the hyper-connections' mix (K = 4 x 4,096, 24 outputs,
float32) and the router's logits (K = 4,096, 64 and 288 experts, a float32 input, float32 or bf16 weights),
for 2 to 8 positions. Prints, per case, whether every output is bit-identical and the us per call of each
(median of 6 rounds of 50 calls each, each round one evaluation, the arms interleaved A B B A).

Usage: python probe_rowwise.py [--out FILE.json]   (CUDA; on the CPU it runs, but says nothing about CUDA)
"""

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_vlm.models.linear import tokenwise

from glm53_patches.kernels import rowwise

SHAPES = [("hc mix", 16384, 24, mx.float32), ("router, 64 experts", 4096, 64, mx.float32),
          ("router, 288 experts", 4096, 288, mx.float32), ("router, bf16 weight", 4096, 288, mx.bfloat16)]


def per_call(fn, reps=50, rounds=3):
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        times.append((time.perf_counter() - t0) / reps)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for label, k, n, wdtype in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n)).astype(wdtype)
        for length in range(2, 9):
            x = mx.random.normal((1, length, k), key=mx.random.key(length))
            arms = {"stock": lambda: tokenwise(lambda part: part @ w.T, x), "ours": lambda: rowwise.block_matvecs(x, w)}
            exact = mx.array_equal(arms["stock"](), arms["ours"]()).item()
            times = {name: [] for name in arms}
            for name in ("stock", "ours", "ours", "stock"):
                times[name].extend(per_call(arms[name]))
            us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            row = dict(case=label, k=k, n=n, positions=length, exact=exact, stock_us=us["stock"], ours_us=us["ours"])
            rows.append(row)
            print(f"{label:22s} L={length}  exact {exact}  stock {row['stock_us']:7.1f} us  one gemv "
                  f"{row['ours_us']:7.1f} us", flush=True)
    print("all exact:", all(r["exact"] for r in rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

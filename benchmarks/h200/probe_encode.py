"""What the time inside mx.async_eval is made of (issue 20's question), on tiny tensors.

A chain of N small element-wise primitives (no mx.compile, so each is its own
kernel, as in an uncompiled decode step) is built and handed to async_eval:
  idle  - the GPU has nothing queued: the call's time is MLX encoding and launching;
  busy  - right after a heavy graph (large matmuls) was async_eval'd and is still running:
          if the call now takes longer, the thread is held back by the GPU (back-pressure).
Prints per-N medians of build, async_eval and wait ms, and us per primitive.
Usage: python probe_encode.py [N ...]
"""

import os
import statistics
import sys
import time

import mlx.core as mx

HEAVY = int(os.environ.get("PROBE_HEAVY", "8192"))  # matmul size of the busy graph (small for a CPU dry run)


def chain(x, n):
    for i in range(n):
        x = x * 1.0001 + 0.5 if i % 2 else mx.maximum(x, -1.0)
    return x


def timed(n, busy, heavy):
    if busy:
        mx.async_eval(heavy())
    t0 = time.perf_counter()
    y = chain(mx.full((1, 256), 0.25, dtype=mx.bfloat16), n // 2)  # each step above is 2 primitives
    t1 = time.perf_counter()
    mx.async_eval(y)
    t2 = time.perf_counter()
    mx.eval(y)
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def main():
    sizes = [int(a) for a in sys.argv[1:]] or [500, 1000, 2000, 4000]
    a = mx.random.normal((HEAVY, HEAVY)).astype(mx.bfloat16)
    mx.eval(a)

    def heavy():  # about 40 ms of matmuls on an H200
        y = a
        for _ in range(30):
            y = (y @ a) * (1.0 / HEAVY)
        return y

    print(f"device {mx.default_device()}  mlx {mx.__version__}")
    print(f"{'N prims':>8} {'state':>5} {'build ms':>9} {'async_eval ms':>14} {'wait ms':>8} {'us/prim in async_eval':>22}")
    for n in sizes:
        for busy in (False, True):
            for _ in range(3):
                timed(n, busy, heavy)  # warm-up: kernels compiled, pools filled
            runs = [timed(n, busy, heavy) for _ in range(15)]
            build, call, wait = (statistics.median(r[k] for r in runs) for k in range(3))
            spread = (min(r[1] for r in runs), max(r[1] for r in runs))
            print(f"{n:>8} {'busy' if busy else 'idle':>5} {build:>9.2f} {call:>8.2f} [{spread[0]:.2f}-{spread[1]:.2f}]"
                  f" {wait:>8.2f} {call * 1e3 / n:>14.2f}")


if __name__ == "__main__":
    main()

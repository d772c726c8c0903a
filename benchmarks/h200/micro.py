"""What the H200 micro-benchmarks share (imported from the scripts beside it)."""

import statistics
import time

import mlx.core as mx


def timed(fn):
    """Milliseconds of one call of ``fn`` after one untimed call (compiles, warms caches)."""
    mx.eval(fn())
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - start) * 1e3


def interleaved(arms, rounds):
    """``{name: {"median", "min", "max"}}`` in ms of each arm, timed in turn once per round."""
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            times[name].append(timed(fn))
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v)} for name, v in times.items()}

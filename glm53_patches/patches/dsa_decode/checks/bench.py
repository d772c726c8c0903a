"""The DSA decode pieces at real dimensions, stock vs dsa_decode, interleaved.

    python -m glm53_patches.patches.dsa_decode.checks.bench [--contexts 4096,16384,32768] [--dtype bfloat16]

Per context and piece (the indexer from synthetic caches; the attention over a
2,063-key selection of a random latent cache): rounds alternate the arms
(stock first in even rounds, patched first in odd ones); each round times
``--steps`` calls, evaluated one by one, after two warm-up calls. Prints per
arm the median ms/call, the min-max of round medians, the ratio and the graph
primitives of one call. The whole DSA layer is measured by
``glm53-patches bench --sections dsa``.
"""

import argparse
import statistics
import time

import mlx.core as mx

from glm53_patches.bench.measure import count_primitives

from .. import PATCH
from ..decode import make_attend, make_call
from .verify import _caches, _indexer, _attention


def _indexer_case(dtype, context, batch=1):
    indexer, config = _indexer(dtype)
    x = [mx.random.normal((batch, 1, config.hidden_size), key=mx.random.key(i)).astype(dtype) for i in range(8)]
    q = [mx.random.normal((batch, 1, config.q_lora_rank), key=mx.random.key(50 + i)).astype(dtype) for i in range(8)]
    mx.eval(x, q)  # inputs ready: the primitive count is the call's own graph

    def start():  # fresh caches per round; the call advances them
        valid, pool = _caches(config, context, batch, dtype)
        mx.eval(valid.keys, pool.pooled, pool.buf_kv, pool.buf_gate)
        return lambda fn, step: fn(indexer, x[step % 8], q[step % 8], None, valid, pool, context + step)

    return start


def _attend_case(dtype, context, batch=1):
    attention, config, inputs = _attention(dtype, context, batch)
    return lambda: (lambda fn, step: fn(attention, *inputs))


def _with_kernel(fn, on):
    """``fn`` with the indexer's selection kernel forced on or off."""
    from ..decode import switch

    def call(*args):
        with switch.forcing(on):
            return fn(*args)

    return call


def measure(pieces, contexts, dtype, rounds, steps):
    from glm53_patches import registry

    rows = []
    for piece, (target, make, case) in pieces.items():
        stock = registry.upstream(target)
        arms = {"stock": stock, "dsa_decode": _with_kernel(make(stock), False)}
        if piece == "indexer" and registry.backend() in PATCH.kernels_on:
            arms["dsa_decode kernel"] = _with_kernel(make(stock), True)
        for context in contexts:
            start = case(dtype, context)
            times = {name: [] for name in arms}
            primitives = {name: count_primitives(list(start()(fn, 0))) for name, fn in arms.items()}
            for r in range(rounds):
                for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    call, per_call = start(), []
                    for step in range(steps + 2):
                        begin = time.perf_counter()
                        mx.eval(call(arms[name], step))
                        if step >= 2:
                            per_call.append(time.perf_counter() - begin)
                    times[name].append(statistics.median(per_call) * 1e3)
            base = statistics.median(times["stock"])
            for name, medians in times.items():
                mid = statistics.median(medians)
                rows.append((piece, context, name, mid, min(medians), max(medians), base / mid, primitives[name]))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="4096,16384,32768")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pieces", default="indexer,attend")
    args = parser.parse_args(argv)
    indexer_target, attend_target = PATCH.targets
    pieces = {"indexer": (indexer_target, make_call, _indexer_case), "attend": (attend_target, make_attend, _attend_case)}
    pieces = {name: pieces[name] for name in args.pieces.split(",")}
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.dtype}, {args.rounds} rounds x {args.steps} steps")
    print(f"{'piece':>8} {'context':>8} {'arm':>11} {'ms/call':>9} {'[min-max of rounds]':>21} {'speedup':>8} {'primitives':>18}")
    for piece, context, name, mid, low, high, ratio, prims in measure(
        pieces, contexts, getattr(mx, args.dtype), args.rounds, args.steps
    ):
        print(f"{piece:>8} {context:>8} {name:>11} {mid:>9.3f}  [{low:8.3f}-{high:8.3f}] {ratio:>7.2f}x "
              f"{prims['total']:>6} ({prims['not_views']} not views)")


if __name__ == "__main__":
    main()

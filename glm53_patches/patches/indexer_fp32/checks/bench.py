"""Stock vs indexer_fp32, interleaved: ``python -m glm53_patches.patches.indexer_fp32.checks.bench``.

Real indexer dimensions (32 heads x 128, bf16 q and pool keys, float32 head
weights, kpool 16, 128 pools selected), one query (decode) and a 512-query
chunk (prefill), against 1024 and 2048 pools (16k and 32k keys). Two
functions per case:

* ``score``:  ``_score_index_keys`` (unmasked; what a decode path calls);
* ``select``: ``_exact_pool_select`` (score + mask + argpartition).

Rounds alternate the arms (A B B A ...); each sample is the median time of
``reps`` calls, each ending in ``mx.eval``. Printed: median [min, max] of the
samples per arm, and the median of the per-round ratios stock / patch.
"""

import argparse
import statistics

import mlx.core as mx

from glm53_patches.bench.measure import _median_time

from .quality import real_inputs

CASES = ((1, 1024), (1, 2048), (512, 1024), (512, 2048))
SELECT_K = 128
SCALE = 128**-0.5


def bench_case(queries, pools, rounds, reps):
    from mlx_vlm.models.glm5_next import language

    from .. import score

    inputs = real_inputs(pools, queries)
    q, keys, weights = inputs[:3]
    stock_score, stock_select = language._score_index_keys, language._exact_pool_select
    patched_score, patched_select = score.make_score(stock_score), score.make_select(stock_select)
    arms = {
        "score": {
            "stock": lambda: stock_score(q, keys, weights, SCALE),
            "patch": lambda: patched_score(q, keys, weights, SCALE),
        },
        "select": {
            "stock": lambda: stock_select(*inputs, SELECT_K, SCALE),
            "patch": lambda: patched_select(*inputs, SELECT_K, SCALE),
        },
    }
    results = {}
    for what, pair in arms.items():
        for fn in pair.values():  # warm up: traces, JIT kernels, allocator
            mx.eval(fn())
        samples = {"stock": [], "patch": []}
        ratios = []
        for r in range(rounds):
            order = ("stock", "patch") if r % 2 == 0 else ("patch", "stock")
            got = {name: _median_time(pair[name], reps, warm=0) for name in order}
            for name, value in got.items():
                samples[name].append(value)
            ratios.append(got["stock"] / got["patch"])
        results[what] = samples, ratios
    return results


def _ms(values):
    return f"{statistics.median(values) * 1e3:.3f} [{min(values) * 1e3:.3f}, {max(values) * 1e3:.3f}]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds for 1-query cases")
    parser.add_argument("--chunk-rounds", type=int, default=4, help="rounds for 512-query cases")
    parser.add_argument("--reps", type=int, default=20, help="calls per sample, 1-query cases")
    args = parser.parse_args(argv)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; times in ms: median [min, max]")
    print("| queries | pools | function | stock ms | patch ms | stock/patch (median of rounds) |")
    print("|---|---|---|---|---|---|")
    for queries, pools in CASES:
        rounds = args.rounds if queries == 1 else args.chunk_rounds
        reps = args.reps if queries == 1 else 1
        for what, (samples, ratios) in bench_case(queries, pools, rounds, reps).items():
            print(
                f"| {queries} | {pools} | {what} | {_ms(samples['stock'])} | {_ms(samples['patch'])} | "
                f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

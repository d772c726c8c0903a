"""Where a DSA layer's sparse prefill attention goes on this GPU, stock vs exact_sparse_prefill.

One 2,048-query prefill chunk over 4,096 keys at GLM-5.3-Flash's sizes (64
heads x 256, 2,048 + 15 selected keys, bf16), indices as the indexer writes
them. Whole calls, interleaved (stock, patched, ...), each evaluated and
synchronised; then the pieces, each timed alone over the call's 128 chunks of
16 queries. Bits: the patched result against stock's, with both FMA readings.

    python benchmarks/h200/probe_sparse_prefill.py [--rounds 3] [--queries 2048] [--keys 4096] [--out F.json]
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def seconds(fn, rounds):
    times = []
    for _ in range(rounds):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--out")
    args = parser.parse_args()

    from glm53_patches.upstream_import import import_language

    language = import_language()  # on a bare GPU machine too

    from glm53_patches.exactness import abs_diff, same_bits
    from glm53_patches.patches.exact_sparse_prefill import attention, kernel
    from glm53_patches.patches.exact_sparse_prefill.checks.verify import case_inputs

    stock = language._sparse_prefill_attention
    report = {}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    report = {"device": str(mx.default_device()), "queries": args.queries, "keys": args.keys}
    for strided in (False, True):
        q, k, v, idx = case_inputs(mx.bfloat16, 1, 64, 256, args.queries, args.keys, 2048, 16, strided, 7)
        scale = 256**-0.5
        arms = {"stock": lambda: stock(q, k, v, idx, scale), "patched": lambda: attention.attention(q, k, v, idx, scale)}
        expected = arms["stock"]()
        mx.eval(expected)
        bits = {}
        for fma in (1, 0):
            kernel.DEFAULT_FMA = fma
            got = arms["patched"]()
            mx.eval(got)
            bits[f"fma={fma}"] = {"identical": same_bits(expected, got), "max_abs_diff": abs_diff(expected, got)}
        kernel.DEFAULT_FMA = 1
        del got
        times = {name: [] for name in arms}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, fn in arms.items():
                times[name] += seconds(fn, 1)
        timing = {name: {"median_s": statistics.median(t[1:]), "all_s": t} for name, t in times.items()}
        timing["ratio"] = timing["stock"]["median_s"] / timing["patched"]["median_s"]
        report["strided" if strided else "contiguous"] = {"bits": bits, "calls": timing}
        print(json.dumps({"strided": strided, "bits": bits, "ratio": timing["ratio"],
                          "stock_s": timing["stock"]["median_s"], "patched_s": timing["patched"]["median_s"]}), flush=True)
        save()

    # The pieces, over the contiguous case's 128 chunks.
    q, k, v, idx = case_inputs(mx.bfloat16, 1, 64, 256, args.queries, args.keys, 2048, 16, False, 7)
    N, K = k.shape[2], idx.shape[-1]
    chunks = range(0, args.queries, 16)
    safe = mx.clip(idx, 0, N - 1)
    valid = (idx >= 0) & (idx < N)
    pieces = {}

    def each_chunk(make):
        def run():
            for start in chunks:
                mx.eval(make(start))
            return []
        return run

    gk = language._sparse_head_gather(k, safe[:, :16])
    gv = language._sparse_head_gather(v, safe[:, :16])
    cq = q[:, :, :16].transpose(0, 2, 1, 3).reshape(16, 64, 1, 256)
    mask = valid[:, :16].reshape(16, 1, 1, K)
    scores16 = (cq * mx.array(scale, mx.bfloat16)) @ gk.swapaxes(-1, -2)
    probs16 = mx.softmax(mx.where(mask, scores16, mx.finfo(mx.bfloat16).min), axis=-1, precise=True)
    mx.eval(gk, gv, cq, mask, scores16, probs16)
    qs = mx.array(scale, mx.bfloat16) * q
    mx.eval(qs)
    parts = {
        "stock: gather K (one chunk, x128)": each_chunk(lambda s: language._sparse_head_gather(k, safe[:, s:s + 16])),
        "stock: SDPA on gathered K/V (x128)": each_chunk(lambda s: mx.fast.scaled_dot_product_attention(cq, gk, gv, scale=scale, mask=mask)),
        "stock: scores matmul (x128)": each_chunk(lambda s: (cq * mx.array(scale, mx.bfloat16)) @ gk.swapaxes(-1, -2)),
        "stock: where + softmax (x128)": each_chunk(lambda s: mx.softmax(mx.where(mask, scores16, mx.finfo(mx.bfloat16).min), axis=-1, precise=True)),
        "stock: probs @ V (x128)": each_chunk(lambda s: probs16 @ gv),
        "patched: scores kernel (all queries, one launch)": lambda: kernel.scores(qs, k, idx),
        "patched: value gather kernel (x128)": each_chunk(lambda s: kernel.gathered_values(v, idx[:, s:s + 16])),
        "stock: value gather take (x128)": each_chunk(lambda s: language._sparse_head_gather(v, safe[:, s:s + 16])),
    }
    for name, fn in parts.items():
        t = seconds(fn, 3)
        pieces[name] = {"median_s": statistics.median(t[1:]), "all_s": t}
        print(f"{name}: {pieces[name]['median_s'] * 1e3:.1f} ms", flush=True)
        report["pieces"] = pieces
        save()
    report["peak_gb"] = mx.get_peak_memory() / 1e9
    save()


if __name__ == "__main__":
    main()

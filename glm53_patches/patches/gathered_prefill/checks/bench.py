"""Stock vs gathered_prefill: one DSA layer's sparse prefill attention, interleaved.

    python -m glm53_patches.patches.gathered_prefill.checks.bench [--contexts 4096 8192]
        [--queries 63] [--rounds 4] [--dtype bfloat16] [--heads 64 --dim 256
        --topk 2048 --kpool 16] [--strided] [--arms stock patched]

Stock needs about 2.2 GB of memory per 16 queries at the real sizes (it
keeps every chunk's gathered K/V alive), hence the default of 63 queries;
for long query chunks run ``--arms patched`` alone.

Random q/k/v at GLM-5.3-Flash's projected DSA sizes (64 heads, K/V head dim
256 = qk_nope_head_dim = v_head_dim) and indices shaped like the indexer's:
per query, ``topk/kpool`` complete pools of ``kpool`` consecutive keys picked
at random among those the query can see, in chronological order, then the
``kpool-1`` tail keys of its partial pool (-1 where a slot is empty). The
queries are the last ``--queries`` positions of the context (a prefill chunk
at the end of the context). Each round runs both arms (order alternating),
each call ending in ``mx.eval``; the first round checks the outputs are
bit-identical. Prints one JSON line per context.
"""

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import numpy as np

from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.exactness import same_bits

from ..attention import balanced_chunk, gathered_attention, query_chunk


def indexer_like_indices(batch, queries, context, topk, kpool, seed=0):
    """[B, queries, topk + kpool - 1] int32 absolute key positions, -1 for empty slots."""
    rng = np.random.default_rng(seed)
    pools_wanted = topk // kpool
    tail_width = kpool - 1
    out = np.full((batch, queries, topk + tail_width), -1, dtype=np.int32)
    for b in range(batch):
        for i in range(queries):
            position = context - queries + i  # the query sees keys 0..position
            visible = position + 1
            complete = visible // kpool
            chosen = np.sort(rng.permutation(complete)[:pools_wanted])
            keys = (chosen[:, None] * kpool + np.arange(kpool)).reshape(-1)
            out[b, i, : keys.size] = keys
            tail = np.arange(complete * kpool, visible)[:tail_width]
            out[b, i, topk : topk + tail.size] = tail
    return mx.array(out)


def _stock(q, k, v, indices, scale):
    return _lang._sparse_prefill_attention(q, k, v, indices, scale)


def run(context, queries, rounds, dtype, heads, dim, topk, kpool, batch=1, arms=("stock", "patched"),
        strided=False):
    mx.random.seed(context)
    q = mx.random.normal((batch, heads, queries, dim)).astype(dtype)
    # strided: K/V as the projected KVCache returns them, views of a buffer
    # whose capacity is a multiple of 256 past the context
    # (keys[..., :offset, :]), which a flat [B*H*N, D] reshape must copy.
    capacity = (context // 256 + 1) * 256 if strided else context
    k = mx.random.normal((batch, heads, capacity, dim)).astype(dtype)[..., :context, :]
    v = mx.random.normal((batch, heads, capacity, dim)).astype(dtype)[..., :context, :]
    indices = indexer_like_indices(batch, queries, context, topk, kpool, seed=context)
    mx.eval(q, k, v, indices)
    scale = dim**-0.5
    arms = {name: {"stock": _stock, "patched": gathered_attention}[name] for name in arms}
    times = {name: [] for name in arms}
    peaks = {name: 0 for name in arms}
    base = mx.get_active_memory()
    exact = None
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        outputs = {}
        for name in order:
            mx.reset_peak_memory()
            start = time.perf_counter()
            out = arms[name](q, k, v, indices, scale)
            mx.eval(out)
            times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], mx.get_peak_memory() - base)
            if r == 0:
                outputs[name] = out
            del out
        if r == 0 and len(outputs) == 2:
            exact = same_bits(outputs["stock"], outputs["patched"])
        del outputs
    ratios = [s / p for s, p in zip(times.get("stock", []), times.get("patched", []))]
    return {
        "context": context,
        "kv_view_of_capacity": capacity,
        "queries": queries,
        "batch": batch,
        "dtype": str(dtype),
        "heads": heads,
        "dim": dim,
        "selected_keys": topk + kpool - 1,
        "patched_chunk": balanced_chunk(queries, query_chunk(batch, heads, heads, dim, dim, topk + kpool - 1)),
        "bit_identical": exact,
        **{f"{n}_s": [round(t, 3) for t in times[n]] for n in arms},
        **{f"{n}_median_s": round(statistics.median(times[n]), 3) for n in arms},
        "speedup_per_round": [round(x, 3) for x in ratios],
        "speedup_median": round(statistics.median(ratios), 3) if ratios else None,
        "peak_gb_above_inputs": {n: round(p / 1e9, 2) for n, p in peaks.items()},
        "machine": f"{platform.machine()} {mx.default_device()}",
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--queries", type=int, default=63)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--kpool", type=int, default=16)
    parser.add_argument("--strided", action="store_true",
                        help="K/V as strided views of a larger buffer, as KVCache returns them")
    parser.add_argument("--arms", nargs="+", default=["stock", "patched"], choices=["stock", "patched"],
                        help="stock needs about 2 GB per 16 queries at real sizes: run patched alone for long chunks")
    args = parser.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    for context in args.contexts:
        if args.queries > context:
            raise SystemExit(f"--queries {args.queries} > context {context}")
        result = run(context, args.queries, args.rounds, dtype, args.heads, args.dim, args.topk, args.kpool,
                     args.batch, tuple(args.arms), args.strided)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Where a speculative verify block's time goes, layer by layer (issue 16).

Runs blocks of L tokens (as the bench's verify section: a speculating cache, the forward, a
commit of one token) through layer_decode's step, with every layer entry evaluated on its own:
per layer, the ms spent building its graph and the ms its evaluation takes; for a DSA layer also
its compiled front, the row gather and the compiled back (its "layer" build is then what they
leave: the eager latent update and indexer).
Per layer kind (kda+mlp, kda+moe, dsa+moe) the medians at each L; for the whole block (evaluated once) the ms of the commit, the build, inside
``async_eval`` (on CUDA: encoding the kernels) and waiting, and its primitives by kind (stock
evaluates a block's positions one by one while building it: its count is the last position's).
Evaluating each layer alone adds a synchronization per layer: the sum is above the block's own time.
Each whole block is printed as soon as it is measured, so a run cut short keeps what it measured.
``--interleave`` times whole blocks only, one of each length per round, and gives each length's ratio
to the first length round by round (its median and range): a machine whose speed drifts between
processes, or within one, then moves every length alike (s45 and s46 met such H100s).

  python probe_verify_layers.py --arms A,A+routed_experts --blocks 1,4 --context 4096
  python probe_verify_layers.py --small --context 256 --whole-only   # a CPU dry run at tiny widths
  python probe_verify_layers.py --arms all --blocks 1,2,3,4 --interleave --no-stock --blocks-timed 20
"""

import argparse
import json
import statistics
import time
from collections import defaultdict

import mlx.core as mx

from glm53_patches import upstream_import
from glm53_patches.bench import measure, synthetic


def _arrays(value):
    """The arrays in a piece's output (nested tuples and lists)."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _arrays(v)]
    return []


def _grown(first, last):
    """(change, primitive) for each primitive kind whose count differs from ``first`` to ``last``, largest first."""
    return sorted(((last.get(k, 0) - first.get(k, 0), k) for k in set(first) | set(last)), reverse=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arms", default="all")
    p.add_argument("--blocks", default="1,4")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--blocks-timed", type=int, default=12)
    p.add_argument("--whole-only", action="store_true", help="no layer-by-layer pass")
    p.add_argument("--small", action="store_true")
    p.add_argument("--interleave", action="store_true",
                   help="whole blocks only, one of each length per round (implies --whole-only)")
    p.add_argument("--no-stock", action="store_true", help="leave stock's arm out")
    p.add_argument("--out")
    args = p.parse_args()
    args.whole_only |= args.interleave
    upstream_import.import_language()
    from mlx_vlm.speculative.cache_state import start_speculative_cache

    from glm53_patches.patches.layer_decode import step

    preset, dtype = ("small", mx.float32) if args.small else ("real", mx.bfloat16)
    config = synthetic.text_config(preset, layers=45, experts=args.experts)
    model = synthetic.build(config, dtype=dtype, seed=0)
    print(f"built the {preset} model", flush=True)
    base = synthetic.context_caches(model, args.context, dtype)
    arms = measure.Arms(args.arms, lambda *a: None)
    kinds = [("kda+" if layer.is_linear else "dsa+") + ("moe" if hasattr(layer.mlp, "gate") else "mlp")
             for layer in model.model.layers]
    records = defaultdict(list)  # (arm, L, kind, piece) -> [(build ms, eval ms)]
    piece_counts = {}  # (arm, L, kind, piece) -> primitives by kind in the graph the piece leaves to evaluate
    current = {}

    def timed(fn, piece):
        def wrapper(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            t1 = time.perf_counter()
            key = (*current["key"], piece)
            if key not in piece_counts:  # once per arm, length, kind and piece: what its graph holds
                piece_counts[key] = measure.count_primitives(_arrays(out))["by_primitive"]
            mx.eval(out)
            mx.synchronize()
            t2 = time.perf_counter()
            # a DSA layer's own build is what its pieces leave: the eager latent update and indexer
            build = (t1 - t0) * 1e3 - (current.pop("nested", 0.0) if piece == "layer" else 0.0)
            if piece != "layer":
                current["nested"] = current.get("nested", 0.0) + (t2 - t0) * 1e3
            records[(*current["key"], piece)].append((build, (t2 - t1) * 1e3))
            return out
        return wrapper

    original = {cls: cls.run for cls in (step.Kda, step.Dsa)}

    def layer_run(cls):
        def run(self, plan, layer, h, mask, cache, topk):
            current["key"] = (current["arm"], current["L"], current["kind"][id(layer)])
            if isinstance(self, step.Dsa):
                saved = self.front, self.back, self.rows
                self.front, self.back, self.rows = (timed(saved[0], "front"), timed(saved[1], "back"),
                                                    timed(saved[2], "rows"))
            try:
                return timed(lambda: original[cls](self, plan, layer, h, mask, cache, topk), "layer")()
            finally:
                if isinstance(self, step.Dsa):
                    self.front, self.back, self.rows = saved
        return run

    current["kind"] = {id(layer): kind for layer, kind in zip(model.model.layers, kinds)}
    totals, counts = defaultdict(list), {}
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    out = {"context": args.context, "blocks": [], "arms": arms.labels, "whole": {}, "pieces": {}}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    def whole(label, length):
        rows = totals[(label, length)]
        commit, build, encode, wait = (med([r[i] for r in rows]) for i in range(4))
        total = med([sum(r) for r in rows])
        c = counts[(label, length)]
        out["whole"][f"{label}|{length}"] = dict(commit=commit, build=build, encode=encode, wait=wait, total=total,
                                                 blocks=rows, primitives=c)
        print(f"{label} L={length}: whole block {total:.2f} ms (commit {commit:.2f}, build {build:.2f}, "
              f"async_eval {encode:.2f}, wait {wait:.2f}); {c['total']} primitives, {c['not_views']} not views",
              flush=True)
        save()
    lengths = [int(x) for x in args.blocks.split(",")]
    out["blocks"] = lengths

    def runner(length):
        """(forward, primitives) for blocks of ``length`` tokens on their own copy of the context."""
        cache = synthetic.clone_cache(base)
        block = mx.random.randint(0, config.vocab_size, (1, length), key=mx.random.key(length))
        state = {"tx": None}

        def begin():  # as the bench's verify section: the previous block's commit of one token, a new block
            if state["tx"] is not None:
                state["tx"].commit([1])
                state["tx"] = None
            if length > 1:
                state["tx"] = start_speculative_cache(cache, length)

        def logits_and_tokens():
            logits = model(block, cache=cache).logits
            return [logits, mx.argmax(logits, axis=-1)]

        def forward():
            current["L"] = length
            t0 = time.perf_counter()
            begin()
            t1 = time.perf_counter()
            arrays = logits_and_tokens() + synthetic.cache_arrays(cache)
            t2 = time.perf_counter()
            mx.async_eval(arrays)  # on CUDA: encodes every kernel, then returns
            t3 = time.perf_counter()
            mx.eval(arrays)
            return [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, time.perf_counter()))]

        def primitives():
            current["L"] = length
            begin()
            arrays = logits_and_tokens() + synthetic.cache_arrays(cache)
            counted = measure.count_primitives(arrays)
            mx.eval(arrays)
            return counted

        return forward, primitives

    def interleaved(label, runs):
        """``--interleave``: each round one block of every length, in turn (reversed every other round),
        so that a machine's drift falls on all lengths alike; each length's ratio to the first, per round."""
        for round_ in range(args.blocks_timed):
            order = lengths if round_ % 2 == 0 else lengths[::-1]
            for length in order:
                totals[(label, length)].append(runs[length][0]())
            rows = {n: sum(totals[(label, n)][-1]) for n in lengths}
            print(f"{label[:40]} round {round_ + 1}: " + ", ".join(f"L={n} {ms:.2f}" for n, ms in rows.items()),
                  flush=True)
            for n in lengths[1:]:
                out["ratios"].setdefault(f"{label}|{n}", []).append(rows[n] / rows[lengths[0]])
            save()
        for length in lengths:
            whole(label, length)
        for n in lengths[1:]:
            ratios = out["ratios"][f"{label}|{n}"]
            print(f"{label[:40]} L={n} / L={lengths[0]}, per round: median {med(ratios):.3f}, "
                  f"range {min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)} rounds)", flush=True)

    out["ratios"] = {}
    for label in arms.labels:
        if label == "stock" and args.no_stock:
            continue
        arms.activate(label)
        current["arm"] = label
        runs = {length: runner(length) for length in lengths}

        def warm_and_count(length):
            forward, primitives = runs[length]
            for _ in range(4):
                forward()
            counts[(label, length)] = primitives()

        if args.interleave:
            for length in lengths:  # every length compiled and counted before any is timed
                warm_and_count(length)
            interleaved(label, runs)
            continue
        for length in lengths:
            warm_and_count(length)
            forward = runs[length][0]
            for _ in range(args.blocks_timed):  # whole blocks, evaluated once
                totals[(label, length)].append(forward())
            whole(label, length)  # printed now: a run cut short keeps what it measured
            if args.whole_only:
                continue
            for cls in original:
                cls.run = layer_run(cls)
            try:
                for _ in range(args.blocks_timed):
                    forward()
            finally:
                for cls, fn in original.items():
                    cls.run = fn
    arms.close()
    for label in arms.labels:
        if len(lengths) > 1 and (label, lengths[0]) in counts:
            first, last = (counts[(label, n)]["by_primitive"] for n in (lengths[0], lengths[-1]))
            grown = _grown(first, last)
            print(f"{label[:40]}: primitives L={lengths[-1]} minus L={lengths[0]}: "
                  + ", ".join(f"{k} {d:+d}" for d, k in grown[:25] if d))
    count = {k: kinds.count(k) for k in set(kinds)}
    print("\nper layer, median ms (build / eval); x count per block")
    for label in arms.labels:
        for kind in sorted(count):
            for piece in ("layer", "front", "rows", "back"):
                cells = []
                for length in lengths:
                    rows = records.get((label, length, kind, piece))
                    if not rows:
                        continue
                    b, e = med([r[0] for r in rows]), med([r[1] for r in rows])
                    out["pieces"][f"{label}|{length}|{kind}|{piece}"] = dict(build=b, eval=e, n=count[kind])
                    cells.append(f"L={length} {b:6.3f} / {e:6.3f}")
                if cells:
                    print(f"{label:<40.40} {kind:8} x{count[kind]:<3} {piece:6} " + "   ".join(cells))
                if len(lengths) > 1 and (label, lengths[-1], kind, piece) in piece_counts:
                    first, last = (piece_counts.get((label, n, kind, piece), {}) for n in (lengths[0], lengths[-1]))
                    grown = _grown(first, last)
                    out["pieces"][f"{label}|counts|{kind}|{piece}"] = {"first": first, "last": last}
                    print(f"{'':40} {'':13} {piece:6} primitives L={lengths[-1]} minus L={lengths[0]}: "
                          + ", ".join(f"{k} {d:+d}" for d, k in grown[:14] if d))
    save()


if __name__ == "__main__":
    main()

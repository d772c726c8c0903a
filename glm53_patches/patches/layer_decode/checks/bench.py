"""Graph-build time and primitives of one decode step: stock, the decode patches, and with layer_decode.

``python -m glm53_patches.patches.layer_decode.checks.bench [--rounds N] [--steps N] [--layers 8|45] [--bits 4] [--batch 3]
[--block L]``

The tiny model (``glm53_patches.tiny_model``; ``--layers 45`` repeats its
layer kinds to GLM-5.3-Flash's 45 layers: 34 KDA, 11 DSA with full indexers,
3 dense MLPs) is decoded greedily under each arm in turn, the order of the
arms alternating between rounds. A step's build time is
``time.perf_counter`` (and the calling thread's CPU time, less sensitive to
other processes) around ``language_model(token, cache)`` before anything is
evaluated; the step is then evaluated and timed on its own. Each round gives
the median over its steps; the summary is the median of the round medians
with their min-max. The first step of each arm in a fresh process (its
traces) is reported separately, as are the graph primitives of one step
(``glm53_patches.bench.measure.count_primitives``, deterministic). With
``--block L`` every step is a speculative verify block instead, as mlx-vlm's
MTP loop runs it on the target: ``start_speculative_cache``, a forward of the
greedy token and L - 1 drafts, then a commit of the whole block.
"""

import argparse
import statistics
import time

import mlx.core as mx

DECODE = ["compiled_kda_decode", "fused_kda_kernel", "hc_decode", "router_select", "expert_combine", "dsa_decode"]
ARMS = {"stock": [], "all (decode patches)": DECODE, "all + layer_decode": DECODE + ["layer_decode"],
        "layer_decode alone": ["layer_decode"]}
PROMPT = [3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]


def model(layers, bits):
    from glm53_patches.tiny_model import build_model

    overrides = {}
    if layers != 8:
        overrides = dict(
            num_hidden_layers=layers,
            layer_types=["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
            mlp_layer_types=["dense"] * 3 + ["sparse"] * (layers - 3),
            index_topk_pattern="F" * layers,
        )
    return build_model(seed=0, quantize_bits=bits, **overrides).language_model


def prompt(language_model, batch):
    """Batch 1: the prompt and a plain cache; 3: three prompts left-padded in mlx-vlm's batch caches (the server's)."""
    from mlx_vlm.generate.ar import _make_cache

    if batch == 1:
        return mx.array([PROMPT]), language_model.make_cache()
    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    padding = [len(PROMPT) - len(p) for p in prompts]
    return mx.array([[0] * pad + p for pad, p in zip(padding, prompts)]), _make_cache(language_model, padding)


def run(language_model, steps, warmup, batch=1, block=1):
    """(build seconds, build CPU seconds, eval seconds) per step after ``warmup``, the first step's, primitives."""
    from mlx_vlm.speculative.cache_state import start_speculative_cache

    from glm53_patches.bench.measure import count_primitives

    tokens, cache = prompt(language_model, batch)
    logits = language_model(tokens, cache=cache).logits[:, -1]
    mx.eval(logits)
    rows, first, primitives = [], None, None
    for step in range(warmup + steps):
        token = mx.argmax(logits, axis=-1)[:, None]
        if block > 1:  # the greedy token and the drafts (fixed ones: the block's cost does not depend on them)
            token = mx.concatenate([token, mx.broadcast_to(mx.array(PROMPT[:block - 1]), (batch, block - 1))], axis=1)
            transaction = start_speculative_cache(cache, block)
        mx.eval(token)
        wall, cpu = time.perf_counter(), time.thread_time()
        logits = language_model(token, cache=cache).logits[:, -1]
        built, built_cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if block > 1:
            transaction.commit([block] * batch)
        if step == warmup:
            primitives = count_primitives([logits])
        start = time.perf_counter()
        mx.eval(logits)
        row = (built, built_cpu, time.perf_counter() - start)
        if step == 0:
            first = row
        if step >= warmup:
            rows.append(row)
    return rows, first, primitives


def main(argv=None):
    import glm53_patches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=None)
    parser.add_argument("--batch", type=int, choices=(1, 3), default=1)
    parser.add_argument("--block", type=int, choices=range(1, 9), default=1, metavar="1-8",
                        help="tokens per step: more than 1 makes every step a speculative verify block")
    args = parser.parse_args(argv)
    language_model = model(args.layers, args.bits)
    medians = {arm: [] for arm in ARMS}
    firsts, primitives = {}, {}
    for round_ in range(args.rounds):
        for arm in (list(ARMS) if round_ % 2 == 0 else list(ARMS)[::-1]):
            glm53_patches.disable()
            if ARMS[arm]:
                glm53_patches.enable(ARMS[arm], strict=True)
            rows, first, counted = run(language_model, args.steps, args.warmup, args.batch, args.block)
            firsts.setdefault(arm, first)
            primitives[arm] = counted
            medians[arm].append(tuple(statistics.median(r[i] for r in rows) for i in range(3)))
    glm53_patches.disable()
    batch = "batch 1" if args.batch == 1 else "a left-padded batch of 3"
    if args.block > 1:
        batch += f", verify blocks of {args.block} tokens"
    print(f"tiny model, {args.layers} layers, {'fp32' if args.bits is None else f'{args.bits}-bit'}, {batch}, "
          f"{args.rounds} interleaved rounds x {args.steps} steps (after {args.warmup} warm-up); "
          "ms per step: median of round medians [min-max]")
    print(f"{'arm':22} {'build (wall)':>22} {'build (thread CPU)':>22} {'eval':>22} {'first step build':>17} "
          f"{'primitives (not views)':>23}")
    for arm, values in medians.items():
        cells = []
        for i in range(3):
            column = [v[i] * 1e3 for v in values]
            cells.append(f"{statistics.median(column):7.2f} [{min(column):.2f}-{max(column):.2f}]")
        counted = primitives[arm]
        print(f"{arm:22} {cells[0]:>22} {cells[1]:>22} {cells[2]:>22} {firsts[arm][0] * 1e3:14.1f} ms "
              f"{counted['total']:>12} ({counted['not_views']})")


if __name__ == "__main__":
    main()

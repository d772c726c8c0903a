"""``glm53-patches verify layer_decode``: bitwise check on this backend.

The compiled layer functions fuse, per backend, across what the other
patches keep apart, so exactness is checked where it runs. Greedy decode of
the tiny model (fp32, and 4-bit on the CPU or bf16 on a GPU, as a converted
checkpoint stores it), batch 1 and a left-padded batch of 3, 16 steps, and the
same prompts through 7 speculative verify blocks of 2 to 8 tokens, each
rolled back to a random accepted prefix and followed by a decode step
(``tiny_model.speculative_logits``): every step's and block's logits and, at
the end, every array and counter of every layer cache, stock (no patch
applied) against

1. layer_decode alone (stock's layer code, compiled);
2. layer_decode with the exact decode patches, their GPU kernels forced off;
3. on a GPU, the same with every kernel forced on. Each kernel patch's
   kernel must then have entered the traces (its hit counter rises while
   layer_decode traces), so equal outputs cannot come from stock running twice.

Stock runs twice per case: where it differs from itself the case proves
nothing and is reported as inconclusive. The patches applied in this process
before are reverted for the check and applied again after it.
"""

import contextlib
import itertools
import logging
import time

import mlx.core as mx

from glm53_patches import registry
from glm53_patches.exactness import Tally, _served_dtype, cache_fields, same_bits
from glm53_patches.kernels import hc_sinkhorn
from glm53_patches.log import log

from .. import PATCH

STEPS = 16
ROUNDS = 7  # speculative verify blocks: one of each length 2 to 8
DECODE = ("compiled_kda_decode", "fused_kda_kernel", "hc_decode", "router_select", "expert_combine", "dsa_decode")
# kernel patch -> (its switch's module, the hit its kernel counts)
KERNELS = {
    "hc_decode": ("glm53_patches.patches.hc_decode.layer", "hc kernel traced"),  # counted by layer_decode
    "fused_kda_kernel": ("glm53_patches.patches.fused_kda_kernel.step", "kernel"),
    "router_select": ("glm53_patches.patches.router_select.gate", "kernel"),
    "expert_combine": ("glm53_patches.patches.expert_combine.combine", "kernel"),
    "dsa_decode": ("glm53_patches.patches.dsa_decode.decode", "indexer kernel"),
}


def _run(language_model, batch, blocks):
    """Greedy decode or verify blocks: every step's (and block's) logits, then the cache's arrays
    (plain fields compared here)."""
    from glm53_patches.tiny_model import greedy_logits, speculative_logits

    from .bench import prompt

    tokens, cache = prompt(language_model, batch)
    if blocks:
        logits, cache = speculative_logits(language_model, tokens, ROUNDS, cache)
    else:
        logits = greedy_logits(language_model, tokens, STEPS, cache=cache)
    state = [value for _, value in cache_fields(cache)]
    arrays = [a for a in state if isinstance(a, mx.array)]
    plain = [a for a in state if not isinstance(a, mx.array)]
    return logits + arrays, plain


def _models():
    from glm53_patches import tiny_model

    on_gpu = hc_sinkhorn.gpu_backend() is not None
    yield "fp32", tiny_model.build_model(seed=1).language_model
    if on_gpu:  # MLX's CUDA quantized matmul has no fp32-activation kernel for the tiny shapes
        yield "bf16", _served_dtype(tiny_model.build_model(seed=1), mx.bfloat16).language_model
    else:
        yield "4-bit", tiny_model.build_model(seed=1, quantize_bits=4).language_model


@contextlib.contextmanager
def _kernels(on):
    """Every decode patch's GPU kernel forced on or off."""
    import importlib

    with contextlib.ExitStack() as stack:
        for module, _ in KERNELS.values():
            implementation = importlib.import_module(module)
            if hasattr(implementation, "forcing_kernel"):
                stack.enter_context(implementation.forcing_kernel(on))
            else:
                stack.enter_context(implementation.switch.forcing(on))
        yield


def _kernel_hits():
    patches = registry.available()
    counter = {name: patches[name] for name in KERNELS}
    counter["hc_decode"] = PATCH  # layer_decode calls hc_decode's collapse directly and counts its kernel
    return {name: counter[name].stats.snapshot()["hits"].get(hit, 0) for name, (_, hit) in KERNELS.items()}


def verify():
    """``{"exact", "max_abs_diff", "cases", "detail"}`` for this machine's backend."""
    start = time.perf_counter()
    before = registry.applied()
    forced = [n for n, e in registry.status()["patches"].items() if n in before and e.get("forced")]
    level = log.level
    log.setLevel(logging.WARNING)  # the many applies and reverts below are not news
    registry.revert()
    arms = [("alone", (), None), ("with decode patches, kernels off", DECODE, False)]
    if hc_sinkhorn.gpu_backend() is not None:
        arms.append(("with decode patches, kernels on", DECODE, True))
    tally, inconclusive, ran = Tally(), [], {}
    try:
        for label, language_model in _models():
            for batch, blocks in itertools.product((1, 3), (False, True)):
                run = f"{label} B={batch}" + " verify blocks" * blocks
                stock, stock_plain = _run(language_model, batch, blocks)
                again, _ = _run(language_model, batch, blocks)
                if not all(same_bits(a, b) for a, b in zip(stock, again)):
                    inconclusive.append(run)
                    continue
                for arm, others, kernels in arms:
                    registry.apply([*others, PATCH.name], strict=True)
                    hits = _kernel_hits()
                    block_hits = PATCH.stats.snapshot()["hits"].get("kda block", 0)
                    try:
                        with _kernels(kernels) if kernels is not None else contextlib.nullcontext():
                            actual, plain = _run(language_model, batch, blocks)
                    finally:
                        registry.revert()
                    name = f"tiny model {run} {arm}"
                    if tally.compare(name, stock, actual) and plain != stock_plain:
                        tally.mismatches.append(f"{name}: cache offsets or padding differ")
                    if blocks and PATCH.stats.snapshot()["hits"].get("kda block", 0) == block_hits:
                        tally.mismatches.append(f"{name}: no block ran as compiled layers")
                    if kernels:
                        for patch, n in _kernel_hits().items():
                            ran[patch] = ran.get(patch, 0) + n - hits[patch]
    finally:
        registry.revert()
        registry.apply(before, force=forced)
        log.setLevel(level)
    for patch, n in sorted(ran.items()):
        if not n:
            tally.mismatches.append(f"{patch}'s kernel never ran inside the compiled layers")
    tally.notes.append(f"{STEPS} greedy steps, and {ROUNDS} verify blocks with rollbacks, logits and every "
                       "cache array, stock vs layer_decode "
                       + ", ".join(a for a, _, _ in arms))
    if inconclusive:
        tally.notes.append("inconclusive, stock not repeatable here: " + ", ".join(inconclusive))
    return tally.result(time.perf_counter() - start)

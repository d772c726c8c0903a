"""``glm53-patches verify kda_verify_kernel``: the kernels against stock's KDA layer on this machine.

1. CUDA, each kernel alone (``recurrence``: the recurrence kernel behind
   ``gated_delta_update``; ``mixer``: the block's whole mixer behind the
   layer's ``__call__``, verify blocks only): a KDA layer (stock's eager
   ``__call__``, so the cache records the block's history itself), bf16, dense and 8-bit, batch 1 and a left-padded
   batch of 3 (masked tokens), at a small size (4 heads of 64) and at
   GLM-5.3-Flash's (64 heads of 128, hidden 4,096): 16 speculative verify
   blocks of 2 to 8 tokens after a 5-token prefill, each committed with
   another accepted prefix per row; output, conv window and recurrent state
   bit for bit after every commit (``compiled_kda_decode``'s
   ``check_case``, which also runs stock twice and calls a case
   inconclusive where stock differs from itself). Plain decode steps (one
   token, no history) at both sizes too. Where a case differs, the other
   ``FMA_STATE`` is tried and the note says whether it matched;
2. the tiny random-weight model, greedy decode and verify blocks, batch 1
   and 2, with each kernel forced on against stock: every logit bit for bit.

On the CPU there is no kernel: the patch steps aside, and only check 2 runs.
"""

import itertools

import mlx.core as mx

from glm53_patches.exactness import verify_gpu_kernel
from glm53_patches.patches.compiled_kda_decode.checks.verify import SMALL, check_case
from glm53_patches.patches.fused_kda_kernel.checks.verify import REAL

ATTR = "gated_delta_update"
LAYER_CALL = "mlx_vlm.models.glm5_next.language:Glm5NextLinearAttention.__call__"


def _with(update, call):
    """``call`` (a layer's ``__call__``) with glm5_next's ``gated_delta_update`` set to ``update`` meanwhile."""
    from mlx_vlm.models.glm5_next import language

    def run(layer, x, mask, cache):
        installed = vars(language)[ATTR]
        setattr(language, ATTR, update)
        try:
            return call(layer, x, mask, cache)
        finally:
            setattr(language, ATTR, installed)

    return run


def check_kernel(tally, backend):
    from mlx_vlm.models.glm5_next import language

    from glm53_patches import registry
    from glm53_patches.exactness import compare_tiny_models

    from .. import PATCH, kernel
    from ..mixer import make_call
    from ..recurrence import make_update, switch

    upstream = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    layer_call = registry.upstream(LAYER_CALL)
    stock = _with(upstream, layer_call)
    paths = {"recurrence": ("kernel", _with(make_update(upstream), layer_call)),
             "mixer": ("block kernel", _with(upstream, make_call(layer_call)))}
    seed = 0
    for blocks, dims, bits, padding in itertools.product((True, False), (SMALL, REAL), (None, 8), (None, [0, 2, 7])):
        if not blocks and (bits or padding):
            continue  # decode: one token per step, covered at both sizes
        for path, (hit, fast) in paths.items():
            if path == "mixer" and not blocks:
                continue  # the mixer kernel takes verify blocks only
            name = f"{path}: {'verify blocks' if blocks else 'decode'} {dims[1]}x{dims[2]} bits={bits} pad={padding}"
            seed += 1
            _check(tally, name, hit, lambda: check_case(stock, fast, mx.bfloat16, bits, padding, seed, dims,
                                                        blocks=blocks))
    # The tiny model through the mixer (the recurrence's run in verify_gpu_kernel): bf16, as a server runs it.
    before = PATCH.stats.snapshot()["hits"].get("block kernel", 0)
    compare_tiny_models(tally, language.Glm5NextLinearAttention, "__call__", layer_call, make_call(layer_call),
                        lambda: switch.forcing(True), variants=(("bf16 mixer", None, mx.bfloat16),), blocks=True)
    if PATCH.stats.snapshot()["hits"].get("block kernel", 0) == before:
        tally.mismatches.append("the mixer kernel never ran in the model check")


def _check(tally, name, hit, compare):
    """One case of ``check_case`` with the kernels forced on; where it differs, FMA_STATE's other value is tried."""
    from .. import PATCH, kernel
    from ..recurrence import switch

    def forced():
        with switch.forcing(True):
            return compare()

    before = PATCH.stats.snapshot()["hits"].get(hit, 0)
    found = forced()
    if PATCH.stats.snapshot()["hits"].get(hit, 0) == before:
        tally.add(name, False, why="the kernel never ran")
    elif "control" in found:
        tally.inconclusive(name, found["control"])
    elif "patch" in found:
        previous, kernel.FMA_STATE = kernel.FMA_STATE, 1 - kernel.FMA_STATE
        try:
            other = "patch" not in forced()
        finally:
            kernel.FMA_STATE = previous
        tally.add(name, False, found["worst"], f"{found['patch']} (max |diff| {found['worst']:.3g}); "
                                               f"FMA_STATE={1 - previous} {'matches' if other else 'differs too'}")
    else:
        tally.add(name, True)


def verify():
    from mlx_vlm.models.glm5_next import language

    from .. import PATCH
    from ..recurrence import make_update, switch

    return verify_gpu_kernel(PATCH, check_kernel, language, make_update, switch, attr=ATTR, blocks=True)

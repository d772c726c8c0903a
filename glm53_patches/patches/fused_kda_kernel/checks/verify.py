"""``glm53-patches verify fused_kda_kernel``: the kernel against stock's KDA decode on this machine.

1. GPU: a KDA layer, bf16, dense and 8-bit, batch 1 and a left-padded
   batch of 3 (masked steps), at a small size (4 heads of 64) and at
   GLM-5.3-Flash's (64 heads of 128, hidden 4,096): 16 decode steps after a
   5-token prefill, output, conv window and recurrent state bit for bit at
   every step (``compiled_kda_decode.verify.check_case``, which also runs
   stock twice and calls a case inconclusive where stock differs from
   itself). Where a case differs, the other FMA_NORM / FMA_STATE variants
   are tried and the note says which, if any, matched;
2. the tiny random-weight model, greedy decode batch 1 and 2, with the
   kernel forced on against stock: logits of every step bit for bit.

On the CPU there is no kernel: the patch steps aside, and only check 2 runs.
"""

import contextlib
import itertools

import mlx.core as mx

from glm53_patches.exactness import verify_gpu_kernel
from glm53_patches.patches.compiled_kda_decode.checks.verify import SMALL, check_case

REAL = (4096, 64, 128)  # hidden size, heads, head dim


@contextlib.contextmanager
def _fma(backend, variant):
    from .. import kernel

    previous = kernel.DEFAULT_FMA[backend]
    kernel.DEFAULT_FMA[backend] = variant
    try:
        yield
    finally:
        kernel.DEFAULT_FMA[backend] = previous


def check_kernel(tally, backend):
    from glm53_patches import registry

    from .. import PATCH, kernel
    from ..step import make_call, switch

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    fast = make_call(stock)
    default = kernel.DEFAULT_FMA[backend]
    seed = 0
    for dims, bits, padding in itertools.product((SMALL, REAL), (None, 8), (None, [0, 2, 7])):
        name = f"layer {dims[1]}x{dims[2]} bits={bits} pad={padding}"
        seed += 1
        before = PATCH.stats.snapshot()["hits"].get("kernel", 0)
        with switch.forcing(True):
            found = check_case(stock, fast, mx.bfloat16, bits, padding, seed, dims)
        if PATCH.stats.snapshot()["hits"].get("kernel", 0) == before:
            tally.add(name, False, why="the kernel never ran")
        elif "control" in found:
            tally.inconclusive(name, found["control"])
        elif "patch" in found:
            matched = []
            for variant in itertools.product((0, 1), repeat=2):
                if variant != default:
                    with _fma(backend, variant), switch.forcing(True):
                        if "patch" not in check_case(stock, fast, mx.bfloat16, bits, padding, seed, dims):
                            matched.append(variant)
            tally.add(name, False, found["worst"],
                      f"{found['patch']} (max |diff| {found['worst']:.3g}); "
                      f"FMA (norm, state) variants matching instead: {matched or 'none'}")
        else:
            tally.add(name, True)


def verify():
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    from .. import PATCH
    from ..step import make_call, switch

    return verify_gpu_kernel(PATCH, check_kernel, Glm5NextLinearAttention, make_call, switch)

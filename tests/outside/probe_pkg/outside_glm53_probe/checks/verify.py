"""``glm53-patches verify outside_probe``: the tiny models' greedy decode, stock vs this patch, bit for bit."""

import contextlib
import time


def verify():
    from mlx_vlm.models.glm5_next.language import Glm5NextMLP

    from glm53_patches import registry
    from glm53_patches.exactness import Tally, compare_tiny_models

    from .. import PATCH
    from ..mlp import make_call

    start = time.perf_counter()
    tally = Tally()
    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    compare_tiny_models(tally, Glm5NextMLP, "__call__", stock, make_call(stock), contextlib.nullcontext)
    return tally.result(time.perf_counter() - start)

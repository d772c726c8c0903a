"""latent_prefill: DSA prefill attends over the selected latent rows, as decode does.

The implementation lives in ``attend.py`` and is imported on first use, so
discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_CACHE = "mlx_vlm.models.cache"

PATCH = Patch(
    name="latent_prefill",
    summary=(
        "Off Metal, prefill of the DSA layers attends each query over its selected latent "
        "rows with the absorbed query, as stock decode does (heads share the gathered rows), "
        "instead of projecting per-head keys and values and gathering them per head, 16 "
        "queries at a time; up to 16 keys per selected slot, over every latent row with the "
        "selection as a mask. Same math, other rounding: numerics-changing, quality-gated."
    ),
    targets={f"{GLM5_NEXT}:Glm5NextAttention._attend": lazy(f"{__name__}.attend", "make_attend")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextAttention.__call__",
        f"{GLM5_NEXT}:Glm5NextAttention.__init__",
        f"{GLM5_NEXT}:_sparse_prefill_attention",
        "mlx_vlm.models.base:scaled_dot_product_attention",
        "mlx_vlm.models.mla:MultiLinear.__call__",
        f"{_CACHE}:KVCache.update_and_fetch",
        f"{_CACHE}:BatchKVCache.update_and_fetch",
    ),
    numerics="changing",
    needs_verify_on=(),  # no kernels: stock's own SDPA and MultiLinear calls
    upstream="not yet proposed: the prefill branch of Glm5NextAttention._attend (PATCH.md)",
)


@hookimpl
def glm53_patches():
    return [PATCH]

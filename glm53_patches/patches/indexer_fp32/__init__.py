"""indexer_fp32: the DSA lightning-indexer pool score as one fused float32 computation.

The implementation lives in ``score.py`` (and the GPU kernels in
``kernels.py``) and is imported on first use, so discovering this plugin
imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_SCORE = f"{__name__}.score"

PATCH = Patch(
    name="indexer_fp32",
    summary=(
        "The DSA indexer's per-pool score (sum over heads of relu(q.k) * w, "
        "float32, masked) as one fused computation: an mx.compile'd function "
        "(bit-identical to stock on CPU), or with GLM53_INDEXER_FP32_KERNEL=1 "
        "one CUDA/Metal kernel without the [B, L, H, P] temporary."
    ),
    targets={
        f"{GLM5_NEXT}:_score_index_keys": lazy(_SCORE, "make_score"),
        f"{GLM5_NEXT}:_exact_pool_select": lazy(_SCORE, "make_select"),
    },
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextIndexer.__call__",  # how it calls _exact_pool_select
        f"{GLM5_NEXT}:Glm5NextIndexer._project_queries",  # q in model dtype, weights float32
        f"{GLM5_NEXT}:Glm5NextIndexer._compress_pools",  # pool keys in model dtype
        f"{GLM5_NEXT}:Glm5NextIndexer._pooled_states",
    ),
    # The compiled path is bit-identical to stock on this CPU; the GPU kernels
    # sum in another order (and contract to FMA), so scores move by float32
    # ulps and near-tied pools can swap. Quality gate: PATCH.md.
    uses=("glm53_patches.kernels.build",),
    numerics="changing",
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: fused float32 indexer score (CUDA/Metal kernel, compiled fallback)",
    on_revert=lazy(_SCORE, "clear", only_if_loaded=True),
    knobs={
        "kernel": config.flag("its CUDA/Metal kernel instead of the compiled score (default off)"),
        "kernel_max_queries": config.integer(1, what="queries", doc="the longest query chunk the kernel takes (default 16)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]

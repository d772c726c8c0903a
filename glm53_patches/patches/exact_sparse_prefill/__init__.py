"""exact_sparse_prefill: DSA sparse prefill attention on CUDA without gathering the keys, bit for bit stock.

The kernels live in ``kernel.py``, the replacement ``_sparse_prefill_attention``
in ``attention.py`` and the checks in ``checks/``; all are imported on first
use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

PATCH = Patch(
    name="exact_sparse_prefill",
    summary=(
        "On CUDA, _sparse_prefill_attention (the DSA layers' prefill attention off Metal) scores each "
        "query's selected keys where they lie, in the order of MLX's gemv, instead of gathering them per "
        "head and chunk; the softmax, value gather and value matmul stay stock's ops on stock's chunks. "
        "Where `glm53-patches verify exact_sparse_prefill` passed; bit-identical to stock there. "
        "Elsewhere stock's loop."
    ),
    targets={f"{GLM5_NEXT}:_sparse_prefill_attention": lazy(f"{__name__}.attention", "make_sparse_prefill")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{GLM5_NEXT}:_sparse_head_gather",
        f"{GLM5_NEXT}:Glm5NextAttention._attend",
        "mlx_vlm.models.sparse_attention:indexed_sparse_attention",
    ),
    uses=("glm53_patches.kernels.build",),
    numerics="exact",
    needs_verify_on=("cuda",),
    kernels_on=("cuda",),  # Metal: stock has its own fused indexed kernel
    upstream="not yet proposed: a CUDA path for _sparse_prefill_attention that keeps the fallback's arithmetic (PATCH.md)",
    on_revert=lazy(f"{__name__}.attention", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernels: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""gathered_prefill: DSA sparse prefill attention off Metal in fewer, larger chunks.

The implementation lives in ``attention.py`` and is imported on first use, so
discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

PATCH = Patch(
    name="gathered_prefill",
    summary=(
        "Off Metal, _sparse_prefill_attention sizes its query chunks from the "
        "shapes (at most 2^31 elements per gathered K/V; a smaller budget on "
        "the CPU) instead of 16 queries, flattens K/V once per call instead of "
        "once per chunk (a copy for the projected cache's strided views), and "
        "orders the chunks' gathers to bound memory; same fused SDPA over the "
        "same values, bit-identical to stock."
    ),
    targets={f"{GLM5_NEXT}:_sparse_prefill_attention": lazy(f"{__name__}.attention", "make_sparse_prefill")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{GLM5_NEXT}:_sparse_head_gather",
        f"{GLM5_NEXT}:Glm5NextAttention._attend",
        "mlx_vlm.models.sparse_attention:indexed_sparse_attention",
    ),
    numerics="exact",
    # No kernels of its own, but on CUDA the SDPA call gets more rows per call
    # than stock's, and the library under it may choose its algorithm by batch
    # count: GLM53_PATCHES=all includes it there only after `verify` passed.
    # (On Metal it always calls stock.)
    needs_verify_on=("cuda",),
    upstream="not yet proposed: flatten K/V once per call, shape-derived query chunks, ordered chunk gathers (PATCH.md)",
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    report=lazy(f"{__name__}.attention", "report"),
    knobs={
        "min_context": config.integer(0, what="keys", doc="contexts below this run stock (default 0 on the CPU; on CUDA never, where it measured slower)"),
        "max_elements": config.integer(1, 2**31 - 1, what="elements", doc="elements per gathered K (or V) and chunk (default 2^31 - 1 on a GPU, 2^29 on the CPU)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]

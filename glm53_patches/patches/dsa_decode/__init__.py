"""dsa_decode: single-token decode of the DSA layers without context-sized bookkeeping.

The implementation lives in ``decode.py`` and is imported on first use, so
discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_CACHE = "mlx_vlm.models.cache"

PATCH = Patch(
    name="dsa_decode",
    summary=(
        "Single-token decode of the DSA layers: the indexer keeps stock's projections, cache "
        "updates, pool scores and argpartition, then does pool-to-key expansion, ordering and "
        "tail as integer arithmetic in one compiled graph instead of context-sized tables, "
        "cumsum and gathers (also per position of a speculative verify block); the attention (also "
        "in verify blocks) gathers the "
        "selected latent rows as whole rows instead of a per-element take_along_axis. On a GPU where `glm53-patches verify "
        "dsa_decode` passed, the selection after the pool scores is one kernel launch "
        "for a decode token or every position of a verify block (up to 8,192 pools, 131k keys). "
        "Bit-identical to stock."
    ),
    targets={
        f"{GLM5_NEXT}:Glm5NextIndexer.__call__": lazy(f"{__name__}.decode", "make_call"),
        f"{GLM5_NEXT}:Glm5NextAttention._attend": lazy(f"{__name__}.decode", "make_attend"),
    },
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextIndexer.__init__",
        f"{GLM5_NEXT}:Glm5NextIndexer._project_keys",
        f"{GLM5_NEXT}:Glm5NextIndexer._project_queries",
        f"{GLM5_NEXT}:Glm5NextIndexer._compress_pools",
        f"{GLM5_NEXT}:_exact_pool_select",
        f"{GLM5_NEXT}:_score_index_keys",
        f"{GLM5_NEXT}:Glm5NextAttention.__call__",
        f"{GLM5_NEXT}:Glm5NextAttention.__init__",
        "mlx_vlm.models.base:scaled_dot_product_attention",
        "mlx_vlm.models.mla:MultiLinear.__call__",
        f"{_CACHE}:KVCache.update_and_fetch",
        f"{_CACHE}:BatchKVCache.update_and_fetch",
        f"{_CACHE}:PoolingCache.accumulate_windows",
        f"{_CACHE}:PoolingCache.update_and_fetch",
        f"{_CACHE}:PoolingCache.offset",
        f"{_CACHE}:BatchPoolingCache.accumulate_windows",
        f"{_CACHE}:BatchPoolingCache.update_and_fetch",
        f"{_CACHE}:BatchPoolingCache.offset",
    ),
    uses=("glm53_patches.kernels.build",),
    numerics="exact",
    # The compiled part is integer-only (no rounding, no math mode), and every
    # float op is stock's own call: exact on any backend by construction. The
    # selection kernel (CUDA, Metal) runs where `verify` passed on this machine.
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: decode branches of Glm5NextIndexer.__call__ and Glm5NextAttention._attend (PATCH.md)",
    on_revert=lazy(f"{__name__}.decode", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its GPU selection kernel: where `verify` passed (auto, the default), always (1), never (0); the CPU has none")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

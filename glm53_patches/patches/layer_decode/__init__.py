"""layer_decode: each decoder layer's decode (one token, or a speculative verify block) as compiled graphs, the
step loop without per-call checks.

The decode loop lives in ``step.py``, the compiled layer functions in
``layer.py`` and the exactness checks in ``checks/verify.py``; all are imported on
first use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

from .counts import LayerStats

_HC = "mlx_vlm.models.deepseek_v4.hyper_connection"
_SWITCH = "mlx_vlm.models.switch_layers"
_CACHE = "mlx_vlm.models.cache"

PATCH = Patch(
    name="layer_decode",
    summary=(
        "Decode steps and speculative verify blocks (up to 8 tokens, off Metal) of Glm5NextTextModel: "
        "every KDA layer runs as one mx.compile'd "
        "pure function (hyper-connections, the mixer as installed, with fused_kda_kernel's kernel, "
        "the MoE with router_select's and expert_combine's kernels), every DSA layer as two around "
        "its growing part (latent cache, indexer, row gather); in a verify block the KDA layers hand "
        "the history they record to the cache for the rollback; one trace per layer kind and shape, "
        "what to run decided once per step, not per layer call. Bit-identical to stock."
    ),
    targets={f"{GLM5_NEXT}:Glm5NextTextModel.__call__": lazy(f"{__name__}.step", "make_call")},
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextTextModel.__init__",
        f"{GLM5_NEXT}:DecoderLayer.__init__",
        f"{GLM5_NEXT}:DecoderLayer.__call__",
        f"{GLM5_NEXT}:Glm5NextAttention.__init__",
        f"{GLM5_NEXT}:Glm5NextAttention.__call__",
        f"{GLM5_NEXT}:Glm5NextAttention._attend",
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__",
        f"{GLM5_NEXT}:Glm5NextMoE.__init__",
        f"{GLM5_NEXT}:LanguageModel.__call__",
        f"{_HC}:HyperConnection.apply_branch",
        f"{_HC}:HyperConnection.__call__",
        f"{_HC}:hc_expand",
        f"{_SWITCH}:SwitchGLU._combine",
        f"{_SWITCH}:MoE.__call__",
        f"{_CACHE}:ArraysCache.__new__",
        f"{_CACHE}:ArraysCache.update_window",
        f"{_CACHE}:ArraysCache.update_recurrent",
        f"{_CACHE}:ArraysCache.advance",
        f"{_CACHE}:ArraysCache.make_mask",
        f"{_CACHE}:ArraysCache.is_speculating",
        f"{_CACHE}:ArraysCache.history_capacity",
        f"{_CACHE}:ArraysCache.start_speculation",
        f"{_CACHE}:ArraysCache.record_speculative_window",
        f"{_CACHE}:ArraysCache.record_speculative_states",
        f"{_CACHE}:ArraysCache.lengths",
        f"{_CACHE}:CacheList.__getitem__",
        f"{_CACHE}:KVCache.update_and_fetch",
        f"{_CACHE}:BatchKVCache.update_and_fetch",
        "mlx_vlm.models.base:create_ssm_mask",
        "mlx_vlm.models.base:scaled_dot_product_attention",
    ),
    numerics="exact",
    # No hand-written kernel of its own, but mx.compile fuses across what the
    # other patches kept apart, per backend: on a GPU it joins
    # GLM53_PATCHES=all only after `glm53-patches verify layer_decode` passed there.
    needs_verify_on=("cuda", "metal"),
    # It traces these patches' code into its graphs (the installed chains run inside them).
    uses=("glm53_patches.patches.hc_decode.layer", "glm53_patches.kernels.hc_sinkhorn",
          "glm53_patches.patches.dsa_decode.decode"),
    upstream="not yet proposed: a compiled decode step for glm5_next layers (PATCH.md)",
    on_revert=lazy(f"{__name__}.step", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    report=lazy(f"{__name__}.step", "report"),
    stats=LayerStats(),
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""compiled_kda_decode: a KDA mixer decode step as one mx.compile'd graph.

The implementation lives in ``step.py`` and is imported on first use, so
discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_CACHE = "mlx_vlm.models.cache:ArraysCache"
_GATED = "mlx_vlm.models.gated_delta"


PATCH = Patch(
    name="compiled_kda_decode",
    summary=(
        "Single-token decode and speculative verify blocks (1-8 tokens, "
        "history recorded for rollback) of Glm5NextLinearAttention (KDA) run "
        "as one mx.compile'd graph (projections, short conv, norms, safe gate, "
        "delta-rule step, gated output norm); bit-identical to stock."
    ),
    targets={f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__": lazy(f"{__name__}.step", "make_call")},
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__call__",
        f"{GLM5_NEXT}:Glm5NextTextModel.__call__",
        "mlx_vlm.models.linear:linear",
        # 1 < L <= 8 (verify blocks): linear's decode-equivalent per-position form
        "mlx_vlm.models.linear:native_batch_linear",
        "mlx_vlm.models.linear:tokenwise",
        "mlx_vlm.models.quantized_verifier:exact_quantized_linear",
        "mlx_vlm.models.quantized_verifier:singleton_quantized_linear",
        f"{_GATED}:gated_delta_update",
        f"{_GATED}:compute_g_safe",
        f"{_GATED}:compute_g",
        f"{_GATED}:gated_delta_ops",
        f"{_GATED}:_gated_delta_step_ops",
        f"{_GATED}:gated_delta_kernel",
        f"{_CACHE}.update_window",
        f"{_CACHE}.update_recurrent",
        f"{_CACHE}.advance",
        f"{_CACHE}.make_mask",
        f"{_CACHE}.is_speculating",
        f"{_CACHE}.history_capacity",
        f"{_CACHE}.record_speculative_states",
        f"{_CACHE}.record_speculative_window",
        f"{_CACHE}.lengths",
        f"{_CACHE}.__setitem__",
    ),
    numerics="exact",
    # No hand-written kernels, but mx.compile emits backend-specific fused
    # kernels (math mode, FMA contraction, constant printing): the CPU is
    # covered by tests/numerics; a GPU backend joins GLM53_PATCHES=all only
    # after `glm53-patches verify compiled_kda_decode` passed on it.
    needs_verify_on=("metal", "cuda"),
    upstream="not yet proposed: opt-in compiled KDA decode step (MLX_VLM_GLM5_COMPILED_KDA_DECODE)",
    on_revert=lazy(f"{__name__}.step", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""fused_kda_kernel: a KDA decode step after the projections as one GPU kernel launch.

The kernels live in ``kernel.py``, the replacement ``__call__`` in
``step.py`` and the exactness checks in ``verify.py``; all are imported on
first use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_GATED = "mlx_vlm.models.gated_delta"

PATCH = Patch(
    name="fused_kda_kernel",
    summary=(
        "Single-token decode of Glm5NextLinearAttention (KDA): stock's projections and conv, "
        "then SiLU, q/k norms, safe gate, beta, the delta-rule step and the gated output norm "
        "in one kernel launch instead of ~20. GPU only, where `glm53-patches verify "
        "fused_kda_kernel` passed; bit-identical to stock there."
    ),
    targets={f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__": lazy(f"{__name__}.step", "make_call")},
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__call__",
        "mlx_vlm.models.linear:linear",
        f"{_GATED}:gated_delta_update",
        f"{_GATED}:compute_g_safe",
        f"{_GATED}:gated_delta_ops",
        f"{_GATED}:_gated_delta_step_ops",
        f"{_GATED}:gated_delta_kernel",
        "mlx_vlm.models.cache:ArraysCache.update_window",
        "mlx_vlm.models.cache:ArraysCache.update_recurrent",
        "mlx_vlm.models.cache:ArraysCache.advance",
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.patches.compiled_kda_decode.step"),
    numerics="exact",
    runs_before=("compiled_kda_decode",),  # the kernel first; what it does not take goes to the compiled step
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: a CUDA twin of gated_delta_kernel for decode, fused with the norms (PATCH.md)",
    on_revert=lazy(f"{__name__}.step", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its GPU kernel: where `verify` passed (auto, the default), always (1), never (0); the CPU has none")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""expert_combine: the MoE block's weighted sum of routed experts plus the shared expert, in one launch.

The kernels live in ``kernel.py``, the replacement ``MoE.__call__`` in
``combine.py`` and the exactness checks in ``verify.py``; all are imported on
first use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_SWITCH = "mlx_vlm.models.switch_layers"

PATCH = Patch(
    name="expert_combine",
    summary=(
        "Glm5NextMoE at decode and in speculative verify blocks: the routed experts' weighted "
        "sum plus the shared expert's output in one kernel launch instead of four (cast, "
        "multiply, column sum, add), with stock's rounding. GPU only, where `glm53-patches verify "
        "expert_combine` passed; other models' MoE blocks are left alone."
    ),
    targets={f"{_SWITCH}:MoE.__call__": lazy(f"{__name__}.combine", "make_call")},
    relies_on=(
        f"{_SWITCH}:SwitchGLU.__call__",
        f"{_SWITCH}:SwitchGLU._combine",
        f"{GLM5_NEXT}:Glm5NextMoE.__init__",
        # short blocks: the residual apply_branch hands over, and the Metal-only
        # paths that make stock's routed outputs depend on the call form
        "mlx_vlm.models.deepseek_v4.hyper_connection:HyperConnection.apply_branch",
        "mlx_vlm.models.deepseek_v4.hyper_connection:hc_expand",
        "mlx_vlm.models.fast_ops:exact_affine_moe_down",
        "mlx_vlm.models.quantized_verifier:exact_quantized_moe_hc_expand",
    ),
    uses=("glm53_patches.kernels.build",),
    numerics="exact",
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: a fused SwitchGLU._combine for single-token decode (PATCH.md)",
    on_revert=lazy(f"{__name__}.combine", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its GPU kernel: where `verify` passed (auto, the default), always (1), never (0); the CPU has none")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

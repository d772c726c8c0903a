"""routed_experts: glm5_next's routed-expert projections at decode and in verify blocks on CUDA, computed as
MLX's qmm_sm80 computes them, element for element, with another work split.

The kernel lives in ``kernel.py``, the replacements in ``experts.py`` and the
checks in ``checks/``; all are imported on first use, so discovering this
plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_SWITCH = "mlx_vlm.models.switch_layers"
_VERIFIER = "mlx_vlm.models.quantized_verifier"

PATCH = Patch(
    name="routed_experts",
    summary=(
        "The routed experts of a glm5_next decode step, exact. On CUDA their quantized projections (and a "
        "verify block's; one gather_qmm over 8 or more routes, one row each, which MLX runs as its tiled "
        "qmm_sm80) run a matvec kernel that keeps qmm_sm80's arithmetic per output element (bf16 "
        "dequantization, one 16-wide MMA per chunk of K in order) with another work split: 4-bit, group 64, "
        "bf16, Hopper (sm_80 dequantizes with another rounding); a decode step's gate and up share one launch. "
        "On Metal a decode step's gate and up run in "
        "one dispatch that loads the input once, then down, each with the arithmetic of MLX's Metal "
        "gather_qmv. Where `glm53-patches verify routed_experts` passed; bit-identical there. Other models' "
        "experts, prefill and every other call: stock."
    ),
    targets={
        f"{_SWITCH}:MoE.__call__": lazy(f"{__name__}.experts", "make_moe_call"),
        f"{_SWITCH}:QuantizedSwitchLinear.__call__": lazy(f"{__name__}.experts", "make_projection_call"),
        f"{_SWITCH}:SwitchGLU.__call__": lazy(f"{__name__}.experts", "make_glu_call"),
    },
    relies_on=(
        f"{_SWITCH}:SwitchGLU._combine",
        f"{_VERIFIER}:exact_quantized_switch_linear",
        f"{_VERIFIER}:exact_quantized_selected_linear",
        f"{GLM5_NEXT}:Glm5NextMoE.__init__",
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.kernels.mlx_metal", "glm53_patches.patches.block_qmv.kernel"),
    numerics="exact",
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    # its MoE wrapper marks a glm5_next block's calls, so it must be outside those that call the experts
    runs_before=("expert_combine", "batched_experts", "dequantized_experts"),
    upstream=("not yet proposed: a faster decode path for MLX's CUDA gather_qmm with qmm_sm80's arithmetic; on "
              "Metal, mlx-vlm's SwitchGLU taking gate and up in one dispatch at decode too (PATCH.md)"),
    on_revert=lazy(f"{__name__}.experts", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernel or Metal twin: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

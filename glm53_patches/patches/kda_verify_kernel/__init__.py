"""kda_verify_kernel: a KDA speculative verify block after its projections as one CUDA launch.

The kernels live in ``kernel.py``, the replacement ``Glm5NextLinearAttention.__call__`` (a block's whole mixer) in
``mixer.py``, the replacement ``gated_delta_update`` (the recurrence alone, for the blocks the mixer's kernel does not
take) in ``recurrence.py`` and the checks in ``checks/``; all are imported on first use, so discovering this plugin
imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_GATED = "mlx_vlm.models.gated_delta"

PATCH = Patch(
    name="kda_verify_kernel",
    summary=(
        "On CUDA, a speculative verify block (1 to 8 tokens) of Glm5NextLinearAttention after its projections: "
        "the conv, SiLU, norms, gate, the delta-rule recurrence with the states stock records for rollback, and "
        "the gated output norm in one kernel with fused_kda_kernel's arithmetic (stock: ~10 ops, then a Python "
        "loop of ~8 small kernels a token). Blocks it does not take keep a one-launch recurrence. Where "
        "`glm53-patches verify kda_verify_kernel` passed; bit-identical to stock there. Elsewhere, stock's code."
    ),
    targets={
        f"{GLM5_NEXT}:gated_delta_update": lazy(f"{__name__}.recurrence", "make_update"),
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__call__": lazy(f"{__name__}.mixer", "make_call"),
    },
    relies_on=(
        f"{GLM5_NEXT}:Glm5NextLinearAttention.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__init__",
        f"{GLM5_NEXT}:ShortConv1d.__call__",
        "mlx_vlm.models.linear:linear",
        f"{_GATED}:gated_delta_update",
        f"{_GATED}:gated_delta_ops",
        f"{_GATED}:_gated_delta_step_ops",
        f"{_GATED}:compute_g",
        f"{_GATED}:compute_g_safe",
        "mlx_vlm.models.cache:ArraysCache.update_recurrent",
        "mlx_vlm.models.cache:ArraysCache.update_window",
        "mlx_vlm.models.cache:ArraysCache.advance",
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.patches.fused_kda_kernel.kernel",
          "glm53_patches.patches.fused_kda_kernel.step"),
    numerics="exact",
    runs_before=("compiled_kda_decode",),  # a block the kernel does not take goes to the compiled step
    needs_verify_on=("cuda",),
    kernels_on=("cuda",),
    upstream="not yet proposed: a CUDA twin of mlx-vlm's gated_delta_kernel for short blocks (PATCH.md)",
    on_revert=lazy(f"{__name__}.mixer", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernel: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

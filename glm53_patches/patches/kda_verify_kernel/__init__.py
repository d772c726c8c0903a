"""kda_verify_kernel: the delta-rule recurrence of a KDA speculative verify block as one CUDA launch.

The kernel lives in ``kernel.py``, the replacement ``gated_delta_update`` in
``recurrence.py`` and the checks in ``checks/``; all are imported on first
use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_GATED = "mlx_vlm.models.gated_delta"

PATCH = Patch(
    name="kda_verify_kernel",
    summary=(
        "On CUDA, the delta-rule recurrence of Glm5NextLinearAttention for 1 to 8 tokens from a state "
        "(speculative verify blocks; stock loops over the tokens in ~8 small kernels each, then stacks the "
        "outputs and the states it records for rollback) runs one kernel with fused_kda_kernel's arithmetic. "
        "Where `glm53-patches verify kda_verify_kernel` passed; bit-identical to stock there. Elsewhere, and "
        "for every other call, stock's function."
    ),
    targets={f"{GLM5_NEXT}:gated_delta_update": lazy(f"{__name__}.recurrence", "make_update")},
    relies_on=(
        f"{_GATED}:gated_delta_update",
        f"{_GATED}:gated_delta_ops",
        f"{_GATED}:_gated_delta_step_ops",
        f"{_GATED}:compute_g",
        f"{_GATED}:compute_g_safe",
        "mlx_vlm.models.cache:ArraysCache.update_recurrent",
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.patches.fused_kda_kernel.kernel"),
    numerics="exact",
    needs_verify_on=("cuda",),
    kernels_on=("cuda",),
    upstream="not yet proposed: a CUDA twin of mlx-vlm's gated_delta_kernel for short blocks (PATCH.md)",
    on_revert=lazy(f"{__name__}.recurrence", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernel: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""exact_kda_prefill: KDA prefill's recurrence on CUDA in one launch, bit for bit stock's per-token loop.

The kernel lives in ``kernel.py``, the replacement ``gated_delta_ops`` in
``recurrence.py`` and the checks in ``checks/``; all are imported on first
use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import Patch, lazy

_GATED = "mlx_vlm.models.gated_delta"

PATCH = Patch(
    name="exact_kda_prefill",
    summary=(
        "On CUDA, gated_delta_ops (stock's KDA recurrence off Metal: a Python loop of one compiled "
        "step per token) runs as one kernel launch per chunk that loops the same step, each value "
        "rounded where stock's step rounds it. Where `glm53-patches verify exact_kda_prefill` "
        "passed; bit-identical to stock there. Elsewhere stock's loop."
    ),
    targets={f"{_GATED}:gated_delta_ops": lazy(f"{__name__}.recurrence", "make_call")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{_GATED}:_gated_delta_step_ops",
        f"{_GATED}:gated_delta_update",
        "mlx_vlm.models.cache:ArraysCache.update_recurrent",
    ),
    uses=("glm53_patches.kernels.build",),
    numerics="exact",
    needs_verify_on=("cuda",),
    kernels_on=("cuda",),  # Metal: stock has its own fused kernel and never calls gated_delta_ops there
    upstream="not yet proposed: a CUDA twin of gated_delta_kernel that reproduces gated_delta_ops (PATCH.md)",
    on_revert=lazy(f"{__name__}.recurrence", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernel: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

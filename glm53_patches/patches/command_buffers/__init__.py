"""command_buffers: larger Metal command buffers for launch-heavy batch-1 decode.

MLX reads MLX_MAX_OPS_PER_BUFFER and MLX_MAX_MB_PER_BUFFER once, when it is
imported, so the .pth bootstrap sets them (stdlib only, before mlx loads);
this plugin only reports what was done. Nothing is replaced in mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import Patch


def _report():
    import sys

    bootstrap = sys.modules.get("glm53_patches._bootstrap")
    note = getattr(bootstrap, "COMMAND_BUFFERS", None)
    return note or "not set: the bootstrap did not run in this process (no GLM53_* variable at start-up)"


PATCH = Patch(
    name="command_buffers",
    summary="Metal only: raise MLX's command-buffer limits before mlx is imported (user values win).",
    targets={},
    numerics="exact",  # scheduling only: the same kernels run on the same data
    in_all=False,  # costs prefill and batched/speculative throughput (seeds 003, 004)
    upstream="not a code change: proposed to MLX as larger defaults on Ultra-class devices (ml-explore/mlx#4521)",
    report=_report,
    knobs={
        "ops": config.integer(1, what="operations", doc="MLX_MAX_OPS_PER_BUFFER to set (default 200)"),
        "mb": config.integer(1, what="MB", doc="MLX_MAX_MB_PER_BUFFER to set (default 400)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]

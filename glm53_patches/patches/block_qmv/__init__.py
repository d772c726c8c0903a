"""block_qmv: glm5_next's quantized projections of a short block (speculative verify blocks) on CUDA and Metal, each
weight read once for every position, each position bit for bit MLX's qmv.

The kernel lives in ``kernel.py`` (on exact_qmv's header), the replacement
``linear`` / ``tiled_linear`` in ``linear.py`` and the checks in ``checks/``;
all are imported on first use, so discovering this plugin imports neither mlx
nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_LINEAR = "mlx_vlm.models.linear"

PATCH = Patch(
    name="block_qmv",
    summary=(
        "On CUDA and Metal, the quantized projections of a block of 2 to 7 positions at batch 1 (speculative "
        "verify blocks; stock computes each position as a one-token call, singleton_quantized_linear's "
        "gather_qmv, reading the weights once per position; on CUDA also the narrower projections stock runs "
        "as one qmv per position, up to 8) run one matvec kernel that loads each weight once "
        "for every position and keeps qmv's arithmetic per position. Where `glm53-patches verify block_qmv` "
        "passed; bit-identical to stock there. Elsewhere, and for every other call, stock's function."
    ),
    targets={
        f"{GLM5_NEXT}:linear": lazy(f"{__name__}.linear", "make_linear"),
        f"{GLM5_NEXT}:tiled_linear": lazy(f"{__name__}.linear", "make_tiled_linear"),
    },
    relies_on=(
        f"{_LINEAR}:linear",
        f"{_LINEAR}:tiled_linear",
        f"{_LINEAR}:native_batch_linear",
        "mlx_vlm.models.quantized_verifier:singleton_quantized_linear",
        "mlx_vlm.models.quantized_verifier:exact_quantized_linear",
    ),
    uses=("glm53_patches.kernels.build", "glm53_patches.kernels.mlx_metal", "glm53_patches.patches.exact_qmv.kernel"),
    numerics="exact",
    needs_verify_on=("cuda", "metal"),
    kernels_on=("cuda", "metal"),
    upstream="not yet proposed: a gather_qmv in MLX that reads a weight shared by its batch once (PATCH.md)",
    on_revert=lazy(f"{__name__}.linear", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch(
        "its CUDA kernel or Metal twin: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

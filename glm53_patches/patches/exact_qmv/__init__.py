"""exact_qmv: glm5_next's decode projections on CUDA through a quantized matvec bit for bit MLX's qmv, with more bytes in flight.

The kernel lives in ``kernel.py``, the replacement ``linear`` / ``tiled_linear``
in ``linear.py`` and the checks in ``checks/``; all are imported on first use,
so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_LINEAR = "mlx_vlm.models.linear"

PATCH = Patch(
    name="exact_qmv",
    summary=(
        "On CUDA, a decode step's quantized projections (glm5_next's linear / tiled_linear of a "
        "QuantizedLinear at one token, fewer than 8 rows: MLX's qmv) run a matvec with qmv's "
        "arithmetic, the same cutlass functions in the same order per row, whose passes are unrolled "
        "and loaded ahead. Where `glm53-patches verify exact_qmv` passed; bit-identical to stock there. "
        "Elsewhere, and for every other call, stock's function."
    ),
    targets={
        f"{GLM5_NEXT}:linear": lazy(f"{__name__}.linear", "make_linear"),
        f"{GLM5_NEXT}:tiled_linear": lazy(f"{__name__}.linear", "make_tiled_linear"),
    },
    relies_on=(f"{_LINEAR}:linear", f"{_LINEAR}:tiled_linear"),
    uses=("glm53_patches.kernels.build",),
    numerics="exact",
    needs_verify_on=("cuda",),
    kernels_on=("cuda",),  # Metal's qmv is another kernel with another order: no twin yet
    upstream="not yet proposed: a faster CUDA qmv in MLX itself (PATCH.md: the same arithmetic, loads ahead)",
    on_revert=lazy(f"{__name__}.linear", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={"kernel": config.switch("its CUDA kernel: where `verify` passed (auto, the default), always (1), never (0)")},
)


@hookimpl
def glm53_patches():
    return [PATCH]

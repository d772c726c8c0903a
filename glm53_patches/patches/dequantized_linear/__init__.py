"""dequantized_linear: prefill's dense quantized projections as dequantize + stock's matmul.

The replacement ``linear`` lives in ``linear.py`` and the exactness checks in
``checks/verify.py``; both are imported on first use, so discovering this
plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_LINEAR = "mlx_vlm.models.linear"

PATCH = Patch(
    name="dequantized_linear",
    summary=(
        "glm5_next's `linear` at prefill (GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS rows or more, default "
        "1,024) over an affine QuantizedLinear: the weight dequantized once per call and multiplied by "
        "stock's matmul, instead of quantized_matmul. On CUDA where `glm53-patches verify "
        "dequantized_linear` passed; bit-identical to stock there."
    ),
    targets={f"{GLM5_NEXT}:linear": lazy(f"{__name__}.linear", "make_linear")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(f"{_LINEAR}:linear", f"{_LINEAR}:DECODE_BLOCK_SIZE"),
    numerics="exact",
    needs_verify_on=("cuda", "metal"),  # its fast path swaps a kernel; on the CPU it runs only when forced
    upstream="not yet proposed: QuantizedLinear dequantizing for large prefill chunks, or MLX's CUDA qmm doing so (PATCH.md)",
    on_revert=lazy(f"{__name__}.linear", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={
        "fast_path": config.switch("on CUDA where `verify` passed (auto, the default; never on the CPU, where it is slower, or on Metal, unmeasured there), always (1), never (0)"),
        "min_tokens": config.integer(1, what="rows", doc="the fewest rows (batch x tokens) it takes (default 1024; verify checks this value)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]

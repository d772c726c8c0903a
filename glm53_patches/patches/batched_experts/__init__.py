"""batched_experts: prefill's routed experts as one batched matmul per projection, over padded routes.

The replacement ``MoE.__call__`` lives in ``experts.py`` and is imported on
first use, so discovering this plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_SWITCH = "mlx_vlm.models.switch_layers"

PATCH = Patch(
    name="batched_experts",
    summary=(
        "Glm5NextMoE at prefill: each routed-expert projection runs as one batched matmul over "
        "[experts, rows, hidden], every expert's routes padded with zero rows to the busiest "
        "expert's count, instead of gather_mm over the sorted routes (on CUDA a grouped GEMM). "
        "The same products summed in another order: numerics-changing, quality-gated."
    ),
    targets={f"{_SWITCH}:MoE.__call__": lazy(f"{__name__}.experts", "make_call")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{_SWITCH}:SwitchGLU.__call__",
        f"{_SWITCH}:SwitchGLU._combine",
        f"{_SWITCH}:SwitchLinear.__call__",
        f"{_SWITCH}:QuantizedSwitchLinear.__call__",
        "mlx_vlm.models.linear:DECODE_BLOCK_SIZE",
        f"{GLM5_NEXT}:Glm5NextMoE.__init__",
    ),
    numerics="changing",
    needs_verify_on=(),  # no hand-written kernels: dequantize and matmul
    upstream="not yet proposed: SwitchGLU's prefill as batched matmuls over padded expert groups (PATCH.md)",
)


@hookimpl
def glm53_patches():
    return [PATCH]

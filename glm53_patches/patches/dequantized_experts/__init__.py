"""dequantized_experts: prefill's routed-expert projections as dequantize + stock's bf16 gather_mm.

The replacement ``MoE.__call__`` lives in ``experts.py`` and the exactness
checks in ``verify.py``; both are imported on first use, so discovering this
plugin imports neither mlx nor mlx-vlm.
"""

from glm53_patches import config
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import GLM5_NEXT, Patch, lazy

_SWITCH = "mlx_vlm.models.switch_layers"

PATCH = Patch(
    name="dequantized_experts",
    summary=(
        "Glm5NextMoE at prefill (chunks of GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS tokens or more, "
        "default 256): the routed experts' three projections run as stock's SwitchLinear "
        "(gather_mm) over the weights dequantized once per call, instead of gather_qmm. Where "
        "`glm53-patches verify dequantized_experts` passed; bit-identical to stock there."
    ),
    targets={f"{_SWITCH}:MoE.__call__": lazy(f"{__name__}.experts", "make_call")},
    prefill_only=True,  # a decode step's single token is handed on untouched
    relies_on=(
        f"{_SWITCH}:SwitchGLU.__call__",
        f"{_SWITCH}:SwitchLinear.__call__",
        f"{_SWITCH}:QuantizedSwitchLinear.__call__",
        "mlx_vlm.models.linear:DECODE_BLOCK_SIZE",
        f"{GLM5_NEXT}:Glm5NextMoE.__init__",
    ),
    numerics="exact",
    needs_verify_on=("cuda", "metal", "cpu"),  # its fast path swaps a kernel: every backend verifies it
    upstream="not yet proposed: QuantizedSwitchLinear dequantizing for large sorted prefill batches (PATCH.md)",
    on_revert=lazy(f"{__name__}.experts", "clear", only_if_loaded=True),
    verify=lazy(f"{__name__}.checks.verify", "verify"),
    knobs={
        "fast_path": config.switch("on CUDA and the CPU where `verify` passed (auto, the default; never on Metal, unmeasured there), always (1), never (0)"),
        "min_tokens": config.integer(1, what="tokens", doc="the smallest prefill chunk it takes (default 256)"),
    },
)


@hookimpl
def glm53_patches():
    return [PATCH]

"""The replacement for ``MoE.__call__`` (mlx-vlm's shared MoE block), for ``Glm5NextMoE`` at prefill.

For a prefill chunk it calls stock's ``MoE.__call__`` on a shallow copy of
the block whose ``SwitchGLU`` holds stock ``SwitchLinear`` projections over
the quantized experts' weights, dequantized for this call. Stock's code then
does everything else (router, shared expert, sorting, activation, combine);
only ``gather_qmm`` becomes ``dequantize`` + ``gather_mm``. The model's own
modules are never modified. Every other model, decode and speculative
blocks, and weights it does not cover go to the stock ``__call__``.
"""

import copy
import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models import linear as _linear
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from glm53_patches import config
from glm53_patches.kernel_switch import KernelSwitch
from glm53_patches.backend import current as backend, sorted_gather_mm_overflows

from . import PATCH

stats = PATCH.stats
# GLM53_DEQUANTIZED_EXPERTS_FAST_PATH. `auto` stays off on Metal even after `verify` passes there:
# MLX's Metal gather_qmm has tuned kernels, and no one has measured which is faster on a Mac.
switch = KernelSwitch(PATCH.name, backends=("cuda", "metal", "cpu"), knob="fast_path", auto_backends=("cuda", "cpu"))
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_MIN_TOKENS = 256
_min_tokens = None


def min_tokens():
    """GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS: the smallest chunk (tokens per row) that dequantizes."""
    global _min_tokens
    if _min_tokens is None:
        _min_tokens = config.knob_value(PATCH.name, "min_tokens", PATCH.knobs["min_tokens"], DEFAULT_MIN_TOKENS)
    return _min_tokens


def dequantized(projection):
    """Stock's ``SwitchLinear`` over ``projection``'s weights, dequantized (lazily, for one call)."""
    plain = SwitchLinear.__new__(SwitchLinear)
    nn.Module.__init__(plain)
    plain.weight = mx.dequantize(projection["weight"], projection["scales"], projection.get("biases"),
                                 group_size=projection.group_size, bits=projection.bits)  # affine only
    if "bias" in projection:
        plain.bias = projection["bias"]
    return plain


def unsupported(moe, x):
    """Why this call stays on stock's path (None: it dequantizes)."""
    glu = moe.switch_mlp
    if not isinstance(glu, SwitchGLU) or glu.training:
        return "not a SwitchGLU in inference"
    if x.ndim != 3 or x.shape[1] <= max(_linear.DECODE_BLOCK_SIZE, 1) or x.shape[1] < min_tokens():
        return "not a prefill chunk"  # decode and speculative blocks have their own exact paths
    if x.shape[0] * x.shape[1] * moe.gate.top_k < 64:
        return "too few routes to be sorted"  # SwitchGLU sorts from 64 on; verify covers sorted rows
    for name in PROJECTIONS:
        p = getattr(glu, name)
        if type(p) is not QuantizedSwitchLinear or getattr(p, "mode", "affine") != "affine":
            return "weights not affine-quantized"
        if p["scales"].dtype != x.dtype:
            return "activation dtype differs from the weights' scales"  # gather_mm would promote
        if sorted_gather_mm_overflows(backend(), p.num_experts, p.output_dims, p.input_dims, x.dtype.size):
            return "too many experts for CUDA's sorted gather_mm (32-bit weight offsets)"
    if x.dtype == mx.bfloat16 and backend() == "cpu":
        return "bf16 gather_mm has no CPU kernel"
    return None


def dequantizing_copy(self, x):
    """A shallow copy of the glm5_next MoE block ``self`` whose experts are dequantized, for
    stock's ``MoE.__call__`` to run on; None where this chunk stays on stock's path."""
    if not isinstance(self, _lang.Glm5NextMoE):
        return None  # another model's MoE: not ours to count
    if not switch.wanted(backend()):
        stats.fallback("off on this backend (GLM53_DEQUANTIZED_EXPERTS_FAST_PATH)")
        return None
    reason = unsupported(self, x)
    if reason is not None:
        stats.fallback(reason)
        return None
    glu = copy.copy(self.switch_mlp)
    for name in PROJECTIONS:
        setattr(glu, name, dequantized(getattr(self.switch_mlp, name)))
    moe = copy.copy(self)
    moe.switch_mlp = glu
    stats.hit("dequantized")
    return moe


def clear():
    global _min_tokens
    switch.clear()
    _min_tokens = None


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x, *args, **kwargs):
        moe = dequantizing_copy(self, x)
        return original(self if moe is None else moe, x, *args, **kwargs)

    return __call__

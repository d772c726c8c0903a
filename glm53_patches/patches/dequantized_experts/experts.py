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
from glm53_patches.backend import current as backend, sorted_gather_mm_max_experts

from . import PATCH

stats = PATCH.stats
# GLM53_DEQUANTIZED_EXPERTS_FAST_PATH. `auto` stays off on Metal even after `verify` passes there:
# MLX's Metal gather_qmm has tuned kernels, and no one has measured which is faster on a Mac.
switch = KernelSwitch(PATCH.name, backends=("cuda", "metal", "cpu"), knob="fast_path", auto_backends=("cuda", "cpu"))
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_MIN_TOKENS = 256
# GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS: the smallest chunk (tokens per row) that dequantizes.
min_tokens = config.CachedKnob(PATCH, "min_tokens", DEFAULT_MIN_TOKENS)


def dequantized(projection):
    """Stock's ``SwitchLinear`` over ``projection``'s weights, dequantized (lazily, for one call);
    a ``SplitSwitchLinear`` where one sorted ``gather_mm`` cannot take all the experts."""
    weight = mx.dequantize(projection["weight"], projection["scales"], projection.get("biases"),
                           group_size=projection.group_size, bits=projection.bits)  # affine only
    limit = sorted_gather_mm_max_experts(backend(), projection.output_dims, projection.input_dims, weight.dtype.size)
    split = limit is not None and projection.num_experts > limit
    plain = SwitchLinear.__new__(SplitSwitchLinear if split else SwitchLinear)
    nn.Module.__init__(plain)
    plain.weight = weight
    if split:
        plain.experts_per_call = limit
    if "bias" in projection:
        plain.bias = projection["bias"]
    return plain


class SplitSwitchLinear(SwitchLinear):
    """Stock's ``SwitchLinear``, its sorted ``gather_mm`` split into calls of at most
    ``experts_per_call`` experts, each over its own contiguous rows: CUDA's sorted
    ``gather_mm`` wraps past 2**31 bytes of weights (``backend.py``). Each row meets the
    same kernel, weights and K order as in one call; ``verify`` checks that at 288 experts."""

    def __call__(self, x, indices, sorted_indices=False):
        if not sorted_indices:  # unsorted routes take gather_mv, whose offsets are 64-bit
            return super().__call__(x, indices, sorted_indices)
        experts = self.num_experts
        ends = mx.cumsum(mx.zeros((experts,), dtype=mx.int32).at[indices.astype(mx.int32)].add(1)).tolist()
        parts = []
        for lo in range(0, experts, self.experts_per_call):  # one host sync above: the rows of each call
            hi = min(lo + self.experts_per_call, experts)
            first, last = ends[lo - 1] if lo else 0, ends[hi - 1]
            if last > first:
                parts.append(mx.gather_mm(x[first:last], self.weight[lo:hi].swapaxes(-1, -2),
                                          rhs_indices=indices[first:last] - lo, sorted_indices=True))
        stats.hit("split calls")
        out = mx.concatenate(parts)
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out


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
    switch.clear()
    min_tokens.clear()


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x, *args, **kwargs):
        moe = dequantizing_copy(self, x)
        return original(self if moe is None else moe, x, *args, **kwargs)

    return __call__

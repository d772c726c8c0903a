"""The replacement for ``MoE.__call__`` (mlx-vlm's shared MoE block), for ``Glm5NextMoE`` at prefill.

Stock's ``SwitchGLU`` sorts a chunk's routes (token, expert) by expert and runs
each projection as one ``gather_mm`` over the sorted rows: on CUDA a CUTLASS
grouped GEMM, far from the GPU's matmul rate at prefill sizes (PATCH.md). This
lays the routes out as ``[experts, rows, hidden]``, each expert's routes
padded with zero rows up to the busiest expert's count, and runs each
projection as one batched ``matmul``. Stock's router, shared expert,
activation and combine still run: stock's ``MoE.__call__`` is called on a
shallow copy of the block whose ``switch_mlp`` is a ``BatchedExperts``, which
``MoE.__call__`` treats as any non-``SwitchGLU`` expert block (routed outputs
in, stock's ``_combine`` after). The model's own modules are never modified.
"""

import copy
import functools

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models import linear as _linear
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from glm53_patches.backend import current as backend, sorted_gather_mm_max_experts

from . import PATCH

stats = PATCH.stats
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# Padded rows per route at most. Beyond it the routing is too uneven for the
# padding to pay: extrapolating the H200 micro-benchmark (PATCH.md), the
# batched block stays ahead of stock's grouped GEMM up to about 5x padding at
# 64 experts and 7x at 288. It also bounds the padded activations' memory.
MAX_PADDING = 5


def weight(projection):
    """``projection``'s ``[experts, out, in]`` weight in the activation dtype (lazy)."""
    if type(projection) is SwitchLinear:
        return projection["weight"]
    return mx.dequantize(projection["weight"], projection["scales"], projection.get("biases"),
                         group_size=projection.group_size, bits=projection.bits)


def plain(glu):
    """A shallow copy of ``glu`` whose projections are stock ``SwitchLinear`` over ``weight``:
    stock's sorted ``gather_mm``, for routes too uneven to pad (``gather_qmm`` is far slower
    at prefill on CUDA, and dequantized_experts, which would have avoided it, never sees
    this block)."""
    copied = copy.copy(glu)
    for name in PROJECTIONS:
        linear = SwitchLinear.__new__(SwitchLinear)
        nn.Module.__init__(linear)
        linear.weight = weight(getattr(glu, name))
        setattr(copied, name, linear)
    return copied


def unsupported(moe, x):
    """Why this call stays on stock's path (None: it is batched)."""
    glu = moe.switch_mlp
    if not isinstance(glu, SwitchGLU) or glu.training or getattr(moe, "sharding_group", None) is not None:
        return "not a local SwitchGLU in inference"
    if x.ndim != 3 or x.shape[1] <= max(_linear.DECODE_BLOCK_SIZE, 1):
        return "not a prefill chunk"  # decode and speculative blocks have their own exact paths
    if backend() == "metal":
        return "metal (unmeasured there; stock's gather_qmm has tuned kernels)"
    if backend() == "cpu" and x.dtype != mx.float32:
        return "not float32 on the CPU (its gather_mm, the uneven-routing path, is float32 only)"
    for name in PROJECTIONS:
        p = getattr(glu, name)
        if "bias" in p:
            return "expert biases"
        if type(p) is not SwitchLinear and not (type(p) is QuantizedSwitchLinear and p.mode == "affine"):
            return "weights neither plain nor affine-quantized"
    return None


class BatchedExperts:
    """``switch_mlp(x, indices)`` for ``MoE.__call__``: the routed outputs ``[B, L, top_k, hidden]``."""

    def __init__(self, glu):
        self.glu = glu

    def __call__(self, x, indices):
        batch, length, hidden = x.shape
        top_k = indices.shape[-1]
        routes = indices.reshape(-1).astype(mx.int32)  # uint32 routes with int32 offsets would promote to int64
        experts = self.glu.down_proj.num_experts
        counts = mx.zeros((experts,), dtype=mx.int32).at[routes].add(1)
        rows = counts.max().item()  # one host sync per block: the padded shape depends on it
        if rows * experts > MAX_PADDING * routes.size:
            return self.uneven(x, indices)  # stock's routed outputs, combined by MoE.__call__ as stock does
        # The sorted routes fill each expert's block of `rows` rows in order; padded row p
        # takes token `source[p]`, or the zero row `tokens` where p is padding. Rows move
        # by gathers (the scatters are of indices only): 3.3 ms for the block against 3.9
        # with a row scatter, on the H200 (PATCH.md).
        tokens = batch * length
        order = mx.argsort(routes).astype(mx.int32)
        by_expert = routes[order]
        first = mx.cumsum(counts) - counts
        slot_sorted = by_expert * rows + mx.arange(routes.size) - first[by_expert]
        source = mx.full((experts * rows,), tokens, dtype=mx.int32).at[slot_sorted].add(order // top_k - tokens)
        slot = mx.zeros_like(slot_sorted).at[order].add(slot_sorted)  # route r's padded row
        rows_in = mx.concatenate([x.reshape(tokens, hidden), mx.zeros((1, hidden), dtype=x.dtype)])
        padded = rows_in[source].reshape(experts, rows, hidden)
        gate, up, down = (weight(getattr(self.glu, name)).swapaxes(-1, -2) for name in PROJECTIONS)
        activated = self.glu.activation(padded @ up, padded @ gate)
        out = (activated @ down).reshape(experts * rows, hidden)
        stats.hit("batched")
        return out[slot].reshape(batch, length, top_k, hidden)

    def uneven(self, x, indices):
        """Routes too uneven to pad: stock's sorted ``gather_mm`` over the dequantized weights, or
        stock's own ``SwitchGLU`` where CUDA's sorted ``gather_mm`` would overflow (``backend.py``)."""
        for p in (getattr(self.glu, name) for name in PROJECTIONS):
            limit = sorted_gather_mm_max_experts(backend(), p.output_dims, p.input_dims, x.dtype.size)
            if limit is not None and p.num_experts > limit:
                stats.fallback("routing too uneven to pad (stock's experts: CUDA's gather_mm would overflow)")
                return self.glu(x, indices)
        stats.fallback("routing too uneven to pad")
        return plain(self.glu)(x, indices)


def batching_copy(self, x):
    """A shallow copy of the glm5_next MoE block ``self`` whose routed experts are a
    ``BatchedExperts``; None where this chunk stays on stock's path."""
    if not isinstance(self, _lang.Glm5NextMoE):
        return None  # another model's MoE: not ours to count
    reason = unsupported(self, x)
    if reason is not None:
        stats.fallback(reason)
        return None
    moe = copy.copy(self)
    moe.switch_mlp = BatchedExperts(self.switch_mlp)
    return moe


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x, *args, **kwargs):
        moe = batching_copy(self, x)
        return original(self if moe is None else moe, x, *args, **kwargs)

    return __call__

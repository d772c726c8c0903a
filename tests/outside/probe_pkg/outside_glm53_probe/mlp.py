"""Glm5NextMLP.__call__ with its ops written out: the same calls in the same order."""

import functools

import mlx.core as mx
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.linear import linear

from . import PATCH

stats = PATCH.stats


def dense_mlp(self, x):
    """What Glm5NextMLP.__call__ returns, or None where this does not take the call."""
    if not isinstance(self, _lang.Glm5NextMLP):
        stats.fallback("module type")
        return None
    stats.hit()
    gate, up = mx.split(linear(self.gate_up_proj, x), 2, axis=-1)
    return linear(self.down_proj, _lang._limited_swiglu(gate, up, self.swiglu_limit))


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x):
        out = dense_mlp(self, x)
        return original(self, x) if out is None else out

    return __call__

"""The replacement for ``mlx_vlm.models.gated_delta.gated_delta_ops``: one launch instead of a loop.

``gated_delta_update`` calls ``gated_delta_ops`` off Metal (on Metal it has
its own fused kernel). On CUDA, where ``glm53-patches verify
exact_kda_prefill`` passed (or GLM53_EXACT_KDA_PREFILL_KERNEL=1), a call the
kernel covers (``kernel.unsupported``: KDA's per-key-dim gate, heads of at
most 128, two tokens or more) runs ``kernel.looped_gated_delta``; everything
else goes to stock's loop, counted by reason.
"""

import functools

from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from .kernel import cuda_here, looped_gated_delta, unsupported

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda",))


def looped(q, k, v, g, beta, state=None, mask=None, state_steps=None):
    """``gated_delta_ops(...)``'s result through the kernel, or None (nothing touched) where it does not run."""
    if not cuda_here():
        stats.fallback("not CUDA")
        return None
    if not switch.wanted("cuda"):
        stats.fallback("kernel off (not verified here)")
        return None
    reason = unsupported(q, k, v, g, beta, state, mask, state_steps)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    return looped_gated_delta(q, k, v, g, beta, state, mask, state_steps)


def make_call(original):
    """The replacement for ``gated_delta_ops``."""

    @functools.wraps(original)
    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None, state_steps=None):
        result = looped(q, k, v, g, beta, state, mask, state_steps)
        return original(q, k, v, g, beta, state, mask, state_steps) if result is None else result

    return gated_delta_ops


def clear():
    switch.clear()

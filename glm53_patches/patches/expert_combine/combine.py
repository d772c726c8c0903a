"""The replacement for ``MoE.__call__`` (mlx-vlm's shared MoE block), for ``Glm5NextMoE`` at decode.

For one token per row it makes stock's calls in stock's order (router,
shared expert, routed experts through ``SwitchGLU`` with no weights, which
returns the unweighted ``[B, 1, K, H]`` outputs) and then combines them in
one launch. Every other model, prefill, sharded or residual-fused calls, the
CPU and shapes the kernel does not cover go to the stock ``__call__``.
"""

import functools

from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.switch_layers import SwitchGLU

from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from .kernel import expert_combine, gpu_backend, unsupported

stats = PATCH.stats
switch = KernelSwitch(PATCH.name)


def kernel_wanted(backend):
    """GLM53_EXPERT_COMBINE_KERNEL, else this backend's verify record (``glm53_patches/kernel_switch.py``)."""
    return switch.wanted(backend)


def combine_call(self, x, args, residual, kwargs):
    """``MoE.__call__`` for a glm5_next decode token with the one-launch combine; None where it does not run."""
    if not isinstance(self, _lang.Glm5NextMoE):
        return None  # another model's MoE: not ours to count
    backend = gpu_backend()
    if not kernel_wanted(backend):
        stats.fallback("no GPU backend" if backend is None else "kernel off (not verified here)")
        return None
    if args or kwargs or residual is not None or getattr(self, "sharding_group", None) is not None:
        stats.fallback("call form")
        return None
    if x.ndim != 3 or x.shape[1] != 1 or self.training or not isinstance(self.switch_mlp, SwitchGLU):
        stats.fallback("not single-token decode")
        return None
    indices, weights = self.gate(x)
    shared = self.shared_experts(x)
    routed = self.switch_mlp(x, indices)  # no weights: the [B, 1, K, H] outputs, unsummed
    reason = unsupported(routed, weights, shared, backend)
    if reason is not None:
        stats.fallback(reason)
        return None  # stock recomputes; nothing above was evaluated
    stats.hit("kernel")
    return expert_combine(routed, weights, shared)


def clear():
    switch.clear()


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x, *args, residual=None, **kwargs):
        result = combine_call(self, x, args, residual, kwargs)
        return original(self, x, *args, residual=residual, **kwargs) if result is None else result

    return __call__

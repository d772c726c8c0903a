"""The replacement for ``MoE.__call__`` (mlx-vlm's shared MoE block), for ``Glm5NextMoE`` at decode.

For a decode token or a short block (``L <= DECODE_BLOCK_SIZE``, 8:
speculative verify blocks) it makes stock's calls in stock's order (router,
shared expert, routed experts through ``SwitchGLU`` with no weights, which
returns the unweighted ``[B, L, K, H]`` outputs) and then combines them in
one launch. A short block may bring the hyper-connection residual
(``apply_branch`` hands it over): it is expanded as ``SwitchGLU._combine``
does, with ``hc_expand``. Off Metal, a short block's routed outputs are
stock's whatever the call form: the paths that use the weights, shared
output or residual early are Metal kernels, so on Metal short blocks go to
stock. Every other model, prefill, sharded calls, the CPU and shapes the
kernel does not cover go to the stock ``__call__``.
"""

import functools

from mlx_vlm.models.deepseek_v4.hyper_connection import hc_expand
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE
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
    if args or kwargs or getattr(self, "sharding_group", None) is not None:
        stats.fallback("call form")
        return None
    if x.ndim != 3 or not 1 <= x.shape[1] <= DECODE_BLOCK_SIZE or self.training or not isinstance(self.switch_mlp, SwitchGLU):
        stats.fallback("not decode")
        return None
    if x.shape[1] == 1 and residual is not None:
        stats.fallback("call form")  # stock never fuses a single token's residual
        return None
    if x.shape[1] > 1 and backend == "metal":
        stats.fallback("metal verify block")  # stock's fused exact Metal kernels run there
        return None
    indices, weights = self.gate(x)
    shared = self.shared_experts(x)
    routed = self.switch_mlp(x, indices)  # no weights: the [B, L, K, H] outputs, unsummed
    reason = unsupported(routed, weights, shared, backend)
    if reason is not None:
        stats.fallback(reason)
        return None  # stock recomputes; nothing above was evaluated
    stats.hit("kernel" if x.shape[1] == 1 else "block")
    output = expert_combine(routed, weights, shared)
    return output if residual is None else hc_expand(output, *residual)


def clear():
    switch.clear()


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x, *args, residual=None, **kwargs):
        result = combine_call(self, x, args, residual, kwargs)
        return original(self, x, *args, residual=residual, **kwargs) if result is None else result

    return __call__

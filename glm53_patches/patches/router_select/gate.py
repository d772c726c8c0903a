"""The replacement for ``MoEGate.__call__``: stock's gate matmul, then the one-launch selection.

On the CPU, and for a router the kernel does not cover (grouped routing,
more than 1,024 experts or 32 picks), the stock ``__call__`` runs. On a GPU
the kernel runs where ``glm53-patches verify router_select`` passed, or with
GLM53_ROUTER_SELECT_KERNEL=1 (``glm53_patches/kernel_switch.py``).
"""

import functools

import mlx.core as mx

from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.kernel_switch import KernelSwitch
from glm53_patches.kernels.rowwise import block_matvecs, block_on_cuda

from . import PATCH
from .kernel import gpu_backend, router_select, unsupported

stats = PATCH.stats
switch = KernelSwitch(PATCH.name)


def kernel_wanted(backend):
    """GLM53_ROUTER_SELECT_KERNEL, else this backend's verify record (``glm53_patches/kernel_switch.py``)."""
    return switch.wanted(backend)


def gate_logits(self, x, backend):
    """Stock's ``tiled_linear(lambda x: x @ self.weight.T, x.astype(float32))``; for a CUDA block at
    batch 1, its per-position matmuls (``tokenwise``) as one launch with each position's bits
    (``kernels/rowwise.py``)."""
    if block_on_cuda(x, backend):
        return block_matvecs(x.astype(mx.float32), self.weight)
    return _lang.tiled_linear(lambda x: x @ self.weight.T, x.astype(mx.float32))


def select(self, x):
    """``MoEGate.__call__(self, x)`` through the kernel; None, having computed nothing, where it does not run."""
    backend = gpu_backend()
    if not kernel_wanted(backend):
        stats.fallback("no GPU backend" if backend is None else "kernel off (not verified here)")
        return None
    logits = gate_logits(self, x, backend)  # stock's gate matmul; only what follows it is fused
    reason = unsupported(logits, self.e_score_correction_bias, self.top_k, self.n_group, backend)
    if reason is not None:  # the lazy logits are never evaluated
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    return router_select(
        logits, self.e_score_correction_bias, self.top_k, self.norm_topk_prob, self.routed_scaling_factor
    )


def clear():
    switch.clear()


def make_call(original):
    @functools.wraps(original)
    def __call__(self, x):
        result = select(self, x)
        return original(self, x) if result is None else result

    return __call__

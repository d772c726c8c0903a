"""The replacement for glm5_next's ``gated_delta_update``: a verify block's recurrence through ``kernel.delta_block``.

glm5_next's KDA mixer calls ``gated_delta_update`` (looked up in its module)
with the layer's cache (stock's eager ``__call__``) or with the state and
``state_steps`` (compiled_kda_decode's and layer_decode's traced mixer). On
CUDA stock runs ``gated_delta_ops`` there. For 1 to 8 tokens from an existing
state, where the kernel is wanted (``verify kda_verify_kernel`` passed, or
GLM53_KDA_VERIFY_KERNEL_KERNEL=1), this computes stock's beta and gate with
stock's functions and runs the kernel instead; every other call goes to the
installed function, counted by reason where it was this patch's to take.
"""

import functools

import mlx.core as mx
from mlx_vlm.models import gated_delta as _gated

from glm53_patches.backend import gpu_backend
from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from . import kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda",))


def recurrence(q, k, v, a, b, A_log, dt_bias, state, mask, lower_bound, state_steps):
    """Stock's recurrence through the kernel, or None (nothing built) where the installed function must run."""
    if state is None or not 1 <= q.shape[1] <= kernel.MAX_TOKENS:
        return None  # a prompt's prefill: not this patch's call, not counted
    backend = gpu_backend()
    if backend != "cuda":
        stats.fallback("no CUDA")
        return None
    if not switch.wanted(backend):
        stats.fallback("kernel off (not verified here)")
        return None
    reason = kernel.unsupported(q, k, v, a, b, A_log, dt_bias, state, mask)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    # gated_delta_update's own first lines, on the same arrays
    beta = mx.sigmoid(b)
    if lower_bound is None:
        g = _gated.compute_g(A_log, a, dt_bias)
    else:
        g = _gated.compute_g_safe(A_log, a, dt_bias, lower_bound)
    return kernel.delta_block(q, k, v, g, beta, state, mask, state_steps)


def make_update(original):
    """The replacement for ``gated_delta_update`` in glm5_next's language module."""

    @functools.wraps(original)
    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, use_kernel=True,
                           lower_bound=None, state_steps=None, cache=None, cache_index=1):
        if cache is not None and state is None and state_steps is None:
            # stock's cache branch, with this function inside: the cache owns the state and the history
            return cache.update_recurrent(cache_index, q.shape[1], lambda initial, steps: gated_delta_update(
                q, k, v, a, b, A_log, dt_bias, state=initial, mask=mask, use_kernel=use_kernel,
                lower_bound=lower_bound, state_steps=steps))
        out = None
        if cache is None and use_kernel and (state_steps is None or 0 < state_steps <= q.shape[1]):
            out = recurrence(q, k, v, a, b, A_log, dt_bias, state, mask, lower_bound, state_steps)
        if out is None:
            return original(q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, use_kernel=use_kernel,
                            lower_bound=lower_bound, state_steps=state_steps, cache=cache, cache_index=cache_index)
        return out

    return gated_delta_update


def clear():
    switch.clear()

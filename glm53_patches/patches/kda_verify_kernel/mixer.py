"""The replacement for ``Glm5NextLinearAttention.__call__`` in a speculative verify block: projections, one kernel.

For a block of 1 to 8 tokens on a speculating cache, where the kernel is wanted
(``verify kda_verify_kernel`` passed, or GLM53_KDA_VERIFY_KERNEL_KERNEL=1)::

    front (fused_kda_kernel's: stock's projections, mx.compile'd)
        -> conv input = window + the block's qkv     cache.update_window records it, as stock's ShortConv1d
        -> kernel.mixer_block (conv ... gated output norm, the states for rollback)
                                                     inside cache.update_recurrent, which records them
        -> o_proj

Everything else (a decode token, a prompt, a ragged cache, a shape or dtype
the kernel does not cover) goes to the installed ``__call__`` below, whose
``gated_delta_update`` is this patch's recurrence kernel where that runs.
"""

import functools

import mlx.core as mx
from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.backend import gpu_backend
from glm53_patches.patches.compiled_kda_decode import step as _compiled
from glm53_patches.patches.fused_kda_kernel import kernel as _fused
from glm53_patches.patches.fused_kda_kernel import step as _fused_step

from . import PATCH, kernel
from .recurrence import switch

stats = PATCH.stats

_FRONTS = {}  # (layer configuration, mask or not) -> fused_kda_kernel's compiled front


def verify_block(attn, x, mask=None, cache=None):
    """``attn(x, mask, cache)`` for a verify block through the kernel; None, having touched nothing, elsewhere."""
    if not (x.ndim == 3 and 1 <= x.shape[1] <= kernel.MAX_TOKENS and getattr(cache, "is_speculating", False)):
        return None  # a decode token or a prompt: another patch's call
    backend = gpu_backend()
    if backend != "cuda" or not switch.wanted(backend):
        return None  # the recurrence counts these blocks' reason ("no CUDA", "kernel off")
    reason = _compiled.why_not(attn, x, mask, cache) or _fused.unsupported(
        x.dtype, cache[1], attn.num_heads, attn.head_dim, attn.lower_bound, (attn.A_log, attn.dt_bias),
        attn.qkv_conv.conv.weight, backend)
    if reason is not None:
        stats.fallback(f"verify block: {reason}")
        return None
    batch, length, _ = x.shape
    leaves = _compiled.layer_leaves(attn)
    key = (_compiled.layer_configuration(attn, leaves), mask is not None)
    front = _FRONTS.get(key)
    if front is None:
        front = _FRONTS[key] = _fused_step._build_front(attn, leaves, mask is not None)
    params = [dict(leaves[i]) for i in _fused_step._PROJECTIONS]
    qkv, a, b, gate = front(x, params) if mask is None else front(x, params, mask)
    # -- ShortConv1d.__call__'s window, through the cache's own call (it records the conv input) --
    keep = attn.qkv_conv.kernel_size - 1
    conv_input = mx.concatenate([cache[0], qkv.reshape(batch, length, -1)], axis=1)
    cache.update_window(0, conv_input, keep, lengths=None)
    conv_weight = attn.qkv_conv.conv.weight
    o_norm = attn.o_norm
    consts, scales = _fused.constants(1e-6 / attn.head_dim, o_norm.eps, attn.lower_bound, attn.scale)
    out, _ = cache.update_recurrent(1, length, lambda state, steps: kernel.mixer_block(
        conv_input, conv_weight.reshape(conv_weight.shape[0], -1), a.reshape(batch, length, -1),
        b.reshape(batch, length, -1), gate.reshape(batch, length, -1), state, attn.A_log, attn.dt_bias,
        o_norm.weight.astype(mx.bfloat16), consts, scales, mask, steps))
    cache.advance(length)
    stats.hit("block kernel")
    return _lang.linear(attn.o_proj, out)


def make_call(original):
    """The replacement for ``Glm5NextLinearAttention.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        output = verify_block(self, x, mask, cache)
        return original(self, x, mask, cache) if output is None else output

    return __call__


def clear():
    """Forget the compiled fronts and the kernel decision."""
    _FRONTS.clear()
    switch.clear()

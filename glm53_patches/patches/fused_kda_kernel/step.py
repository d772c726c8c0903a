"""The replacement for ``Glm5NextLinearAttention.__call__``: projections, then one kernel per KDA decode step.

For one token on a GPU where the kernel runs (``glm53-patches verify
fused_kda_kernel`` passed, or GLM53_FUSED_KDA_KERNEL_KERNEL=1):

    front (mx.compile'd: stock's projections)
        -> kernel (``kernel.py``: conv window and conv, SiLU ... gated
           output norm; new window and state)
        -> o_proj

The front reuses compiled_kda_decode's machinery (the skeleton modules bound
to traced weights, the configuration memo, the checks for when stock must
run), so both patches see a layer the same way. Everywhere else the call goes
to whatever is installed below this patch (compiled_kda_decode or stock).
"""

import functools

import mlx.core as mx

from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.kernel_switch import KernelSwitch
from glm53_patches.patches.compiled_kda_decode import step as _compiled

from . import PATCH
from .kernel import constants, fused_kda_step, gpu_backend, unsupported

stats = PATCH.stats
switch = KernelSwitch(PATCH.name)

# (layer configuration, mask or not) -> mx.compile'd front.
_FRONTS = {}


_PROJECTIONS = (0, 2, 3, 4)  # qkv_proj, fbg_a_proj, f_b_proj, g_b_proj among compiled_kda_decode's leaves


def _build_front(attn, leaves, has_mask):
    """Stock's projections (``Glm5NextLinearAttention.__call__``, ``ShortConv1d``'s mask), compiled."""
    skeletons = tuple(_compiled.skeleton(leaves[i]) for i in _PROJECTIONS)
    num_heads, head_dim = attn.num_heads, attn.head_dim
    linear = _lang.linear

    def front(x, params, mask=None):
        stats.hit("trace")  # Python runs only while mx.compile traces
        qkv_proj, fbg_a_proj, f_b_proj, g_b_proj = map(_compiled.bind, skeletons, params)
        batch = x.shape[0]
        if mask is not None:
            x = mx.where(mask[..., None], x, 0)
        qkv = linear(qkv_proj, x)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        f_a, b, g_a = mx.split(linear(fbg_a_proj, x), (head_dim, head_dim + num_heads), axis=-1)
        a = linear(f_b_proj, f_a)
        gate = linear(g_b_proj, g_a)
        flat = (batch, -1)
        return qkv.reshape(flat), a.reshape(flat), b.reshape(flat), gate.reshape(flat)

    if has_mask:
        return mx.compile(front)
    return mx.compile(functools.partial(front, mask=None))


def decode_step(attn, x, mask=None, cache=None):
    """``attn(x, mask, cache)`` for one decode token through the kernel; None, having touched nothing, elsewhere."""
    backend = gpu_backend()
    if not switch.wanted(backend):
        stats.fallback("no GPU backend" if backend is None else "kernel off (not verified here)")
        return None
    if x.ndim != 3 or x.shape[1] != 1:
        reason = "length"  # verify blocks: compiled_kda_decode (below this patch) records their history
    elif getattr(cache, "is_speculating", False):
        reason = "speculating"  # the kernel writes no history for rollback
    else:
        reason = _compiled.why_not(attn, x, mask, cache) or unsupported(
            x.dtype, cache[1], attn.num_heads, attn.head_dim, attn.lower_bound, (attn.A_log, attn.dt_bias),
            attn.qkv_conv.conv.weight, backend,
        )
    if reason is not None:
        stats.fallback(reason)
        return None
    leaves = _compiled.layer_leaves(attn)
    key = (_compiled.layer_configuration(attn, leaves), mask is not None)
    front = _FRONTS.get(key)
    if front is None:
        front = _FRONTS[key] = _build_front(attn, leaves, mask is not None)
    params = [dict(leaves[i]) for i in _PROJECTIONS]
    qkv, a, b, gate = front(x, params) if mask is None else front(x, params, mask)
    o_norm = attn.o_norm
    conv_weight = attn.qkv_conv.conv.weight
    consts, scales = constants(1e-6 / attn.head_dim, o_norm.eps, attn.lower_bound, attn.scale)
    out, state, window = fused_kda_step(
        qkv, cache[0], conv_weight.reshape(conv_weight.shape[0], -1), a, b, gate, cache[1], attn.A_log,
        attn.dt_bias, o_norm.weight.astype(mx.bfloat16), consts, scales,
        None if mask is None else mask.reshape(-1), backend=backend,
    )
    # What stock leaves in a non-speculating cache without lengths.
    cache[0] = window
    cache[1] = state
    cache.advance(1)
    stats.hit("kernel")
    return _lang.linear(attn.o_proj, out.reshape(x.shape[0], 1, -1))


def make_call(original):
    """The replacement for ``Glm5NextLinearAttention.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        output = decode_step(self, x, mask, cache)
        return original(self, x, mask, cache) if output is None else output

    return __call__


def clear():
    """Forget the compiled fronts and the kernel decision."""
    _FRONTS.clear()
    constants.cache_clear()
    switch.clear()

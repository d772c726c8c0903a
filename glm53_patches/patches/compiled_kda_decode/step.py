"""One compiled graph for a KDA (Glm5NextLinearAttention) decode step or verify block.

Stock decode builds ~90 small lazy ops per KDA layer and token. Here the whole
mixer is one ``mx.compile``d pure function

    (x, conv window, recurrent state, weights, scales[, mask])
        -> (output, new conv window, new recurrent state)

whose body repeats the stock ops in the stock order (``mixer`` in ``_build``).
Weights and the Python-float scales are *inputs*, never captured constants:
one trace serves every layer with the same configuration and shapes, a weight
update is seen without retracing, and no scale is printed into kernel source.
The cache is then updated exactly as stock leaves it.

A speculative verify block (the cache is speculating, ``L`` = 1 to 8 tokens:
the last accepted token and the drafts) runs the same graph with stock's
``state_steps = L - 1``, so it also returns the conv input and the ``L - 1``
intermediate recurrent states. They are handed to the cache's own
``update_window`` and ``update_recurrent``, which record them for rollback as
they do for stock. At ``1 < L <= 8`` stock's ``linear`` takes its
decode-equivalent per-position form; the graph calls the same ``linear``, so it
takes that form too.
"""

import copy
import functools
import weakref

import mlx.core as mx
import mlx.nn as nn

from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

from . import PATCH

stats = PATCH.stats

# (layer configuration, mask or not) -> mx.compile'd mixer. Inside each entry
# mx.compile keeps one trace per input shapes/dtypes (e.g. per batch size).
_COMPILED = {}
# id(attention module) -> (weakref to it, weakrefs to its leaves, configuration).
_CONFIGS = {}
_SCALARS = (bool, int, float, str, type(None))
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)


def layer_leaves(attn):
    """The modules whose parameters the mixer reads (a Module is a dict of its children)."""
    return (
        attn["qkv_proj"],
        attn["qkv_conv"]["conv"],
        attn["fbg_a_proj"],
        attn["f_b_proj"],
        attn["g_b_proj"],
        attn["o_norm"],
        attn["o_proj"],
    )


def _configuration(attn, leaves):
    """Everything static the trace depends on, besides input shapes and dtypes."""

    def leaf(module):  # class, parameter names, and e.g. bits/group_size/mode/eps
        settings = sorted((k, v) for k, v in vars(module).items() if k[0] != "_" and isinstance(v, _SCALARS))
        return type(module), tuple(module), tuple(settings)

    return (
        tuple(leaf(m) for m in leaves),
        attn.num_heads,
        attn.head_dim,
        attn.qkv_conv.kernel_size,
        attn.lower_bound,
        # Helpers are looked up where stock looks them up; if one is replaced
        # (e.g. monkeypatched), this layer gets a fresh trace, not a stale one.
        _lang.linear,
        _lang.gated_delta_update,
    )


def layer_configuration(attn, leaves):
    """``_configuration`` memoized per live module, validated by identity."""
    entry = _CONFIGS.get(id(attn))
    if (
        entry is not None
        and entry[0]() is attn
        and all(ref() is leaf for ref, leaf in zip(entry[1], leaves))
        and entry[2][-2] is _lang.linear
        and entry[2][-1] is _lang.gated_delta_update
    ):
        return entry[2]
    key = id(attn)
    configuration = _configuration(attn, leaves)
    _CONFIGS[key] = (
        weakref.ref(attn, lambda _, key=key: _CONFIGS.pop(key, None)),
        tuple(weakref.ref(leaf) for leaf in leaves),
        configuration,
    )
    return configuration


def skeleton(module):
    """A parameter-free copy of ``module``: its class and settings, no weights."""
    copy_ = copy.copy(module)
    dict.clear(copy_)
    return copy_


def bind(skeleton, params):
    """A copy of a parameter-free module with ``params`` (traced arrays) as parameters."""
    clone = copy.copy(skeleton)
    dict.update(clone, params)
    return clone


def _build(attn, leaves, has_mask, record, state_steps):
    """mx.compile the mixer for one layer configuration (it traces on first call).

    With ``record`` (a verify block) the graph returns what the speculating
    cache records, the conv input and, for ``state_steps``, the intermediate
    states, instead of the new window.
    """
    skeletons = tuple(skeleton(m) for m in leaves)
    num_heads, head_dim = attn.num_heads, attn.head_dim
    keep = attn.qkv_conv.kernel_size - 1
    lower_bound = attn.lower_bound
    linear, gated_delta_update = _lang.linear, _lang.gated_delta_update

    def mixer(x, window, state, params, A_log, dt_bias, scales, mask=None):
        stats.hit("trace")  # Python runs only while mx.compile traces
        qkv_proj, conv, fbg_a_proj, f_b_proj, g_b_proj, o_norm, o_proj = map(bind, skeletons, params)
        # -- Glm5NextLinearAttention.__call__ (L <= 8, not training) --
        batch, length, _ = x.shape
        if mask is not None:  # bool, checked by the caller
            x = mx.where(mask[..., None], x, 0)
        qkv = linear(qkv_proj, x)
        # -- ShortConv1d.__call__ with cache[0] --
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([window, qkv], axis=1)
        qkv = nn.silu(conv(conv_input))
        new_window = mx.contiguous(conv_input[:, length : length + keep])  # = update_window(0, ...)
        # -- back in Glm5NextLinearAttention.__call__ --
        shape = (batch, length, num_heads, head_dim)
        q, k, v = (value.reshape(shape) for value in mx.split(qkv, 3, axis=-1))
        eps = 1e-6 / head_dim
        # Stock multiplies by Python floats, which MLX rounds float64 -> float32
        # -> the operand's dtype. The inputs are float32, so cast them the same
        # way (without the cast a bf16 q would be promoted to float32).
        scale_sq, scale = (s.astype(q.dtype) for s in scales)
        q = scale_sq * mx.fast.rms_norm(q, None, eps)
        k = scale * mx.fast.rms_norm(k, None, eps)
        f_a, b, g_a = mx.split(
            linear(fbg_a_proj, x),
            (head_dim, head_dim + num_heads),
            axis=-1,
        )
        a = linear(f_b_proj, f_a).reshape(shape)
        b = b.reshape(batch, length, num_heads)
        # What ArraysCache.update_recurrent(1, ...) runs, with the state passed in.
        # Same function as stock, so the kernel/ops choice matches on every backend.
        result = gated_delta_update(
            q,
            k,
            v,
            a,
            b,
            A_log.reshape(num_heads, 1),
            dt_bias.reshape(num_heads, head_dim),
            state=state,
            mask=mask,
            use_kernel=True,  # = not self.training
            lower_bound=lower_bound,
            state_steps=state_steps,
        )
        output, new_state = result[:2]
        gate = linear(g_b_proj, g_a).reshape(shape)
        output = (o_norm(output) * mx.sigmoid(gate)).reshape(batch, length, -1)
        output = linear(o_proj, output)
        if record:  # (output, conv input, final state[, intermediate states])
            return (output, conv_input, new_state, *result[2:])
        return output, new_window, new_state

    if has_mask:
        return mx.compile(mixer)
    return mx.compile(functools.partial(mixer, mask=None))


@functools.lru_cache(maxsize=64)
def _scales(scale):
    return mx.array(scale**2, dtype=mx.float32), mx.array(scale, dtype=mx.float32)


def why_not(attn, x, mask, cache):
    """The reason to run stock code, or None when the fast path applies."""
    if x.ndim != 3 or not 1 <= x.shape[1] <= DECODE_BLOCK_SIZE:
        return "length"
    if x.shape[1] > 1 and not (cache is not None and cache.is_speculating):
        return "length"  # a prefill chunk: not a decode step or verify block
    if attn.training:
        return "training"
    if cache is None:
        return "no cache"
    if type(cache) is not ArraysCache or len(cache.cache) != 2:  # a subclass may record more
        return "cache type"
    window, state = cache.cache
    if window is None or state is None:
        return "no state"
    if cache.is_speculating and cache.history_capacity < x.shape[1]:
        return "history capacity"  # stock raises its own error
    if cache.lengths is not None:  # ragged rows: update_window gathers per row
        return "ragged"
    batch = x.shape[0]
    if mask is not None and (mask.dtype != mx.bool_ or mask.shape != x.shape[:2]):
        return "mask"
    if x.dtype not in _FLOATS or window.dtype not in _FLOATS or state.dtype not in _FLOATS:
        return "dtype"
    channels = 3 * attn.projection_dim
    if window.shape != (batch, attn.qkv_conv.kernel_size - 1, channels):
        return "shape"
    if state.shape != (batch, attn.num_heads, attn.head_dim, attn.head_dim):
        return "shape"
    return None


def decode_step(attn, x, mask=None, cache=None):
    """``attn(x, mask, cache)`` for a decode token or a verify block, as one compiled call.

    Returns None, having touched nothing, where the stock code must run.
    """
    reason = why_not(attn, x, mask, cache)
    if reason is not None:
        stats.fallback(reason)
        return None
    length = x.shape[1]
    record = cache.is_speculating
    state_steps = length - 1 if record and length > 1 else None  # what update_recurrent asks stock for
    leaves = layer_leaves(attn)
    key = (layer_configuration(attn, leaves), mask is not None, record, state_steps)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _build(attn, leaves, mask is not None, record, state_steps)
    params = [dict(m) for m in leaves]
    args = (x, cache[0], cache[1], params, attn.A_log, attn.dt_bias, _scales(attn.scale))
    result = fn(*args) if mask is None else fn(*args, mask)
    output = result[0]
    if record:
        # Stock's own cache calls, in stock's order: they record the window
        # and the states for rollback and check the history capacity.
        cache.update_window(0, result[1], attn.qkv_conv.kernel_size - 1, lengths=None)
        cache.update_recurrent(1, length, lambda _state, _steps: (output, *result[2:]))
        stats.hit("verify")
    else:
        # What stock leaves in a non-speculating cache without lengths:
        # update_window(0, ...), update_recurrent(1, ...), advance(1).
        cache[0] = result[1]
        cache[1] = result[2]
        stats.hit()
    cache.advance(length)
    return output


def make_call(original):
    """The replacement for ``Glm5NextLinearAttention.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        output = decode_step(self, x, mask, cache)
        return original(self, x, mask, cache) if output is None else output

    return __call__


def clear():
    """Drop every compiled function and memo."""
    _COMPILED.clear()
    _CONFIGS.clear()
    _scales.cache_clear()


def compiled_count():
    return len(_COMPILED)

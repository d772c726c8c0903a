"""A glm5_next decoder layer's decode as ``mx.compile``d pure functions: one token, or a speculative
verify block of up to ``DECODE_BLOCK_SIZE`` (8) tokens, the path stock itself takes for such blocks.

KDA layer (every shape fixed), one function::

    (x, [mask,] conv window, recurrent state, layer parameters)
        -> (x, new conv window, new recurrent state)          a decode token
        -> (x, conv input, final state[, intermediate states]) a verify block

    collapse(x) with attn_hc          hc_decode's compiled collapse (its kernel where it runs)
    self_attn(h, mask, cache)         the installed Glm5NextLinearAttention.__call__ chain
                                      (fused_kda_kernel, compiled_kda_decode, or stock) on a
                                      fresh ArraysCache that holds the traced window and state;
                                      in a verify block it speculates too, and what the mixer
                                      asks it to record for rollback is returned, for step.py to
                                      hand to the real cache's update_window / update_recurrent
    expand + collapse with ffn_hc     hc_decode's compiled expand_collapse
    mlp(h)                            the installed MoE.__call__ / MoEGate.__call__ chains
                                      (expert_combine, router_select, or stock), or the MLP
    hc_expand                         upstream's compiled _hc_expand_op (in a block an MoE is
                                      handed the residual and expands it itself, as stock's
                                      apply_branch has it)

DSA layer, two functions around what grows with the context:

    front (x, layer) -> h, q_resid, q, new latent, post, comb
        collapse, then Glm5NextAttention.__call__'s projections
    [eager, in step.py: latent KVCache update, the installed indexer (or the
     previous layer's top-k), one gather of every position's selected latent rows]
    back (q, selected, valid, x, post, comb, layer) -> x
        Glm5NextAttention._attend's decode attention, position by position as
        stock loops them, over each position's selected rows ([B, L, K, C]: a
        fixed width K, index_topk plus the tail), o_proj, expand + collapse,
        mlp, hc_expand

The bodies call the code that runs eagerly, on parameter-free copies of the
layer's modules bound to the traced parameters: weights are inputs, never
captured. Every decision the other patches make per call (their shape checks,
kernel switches) is made while tracing, once per input shape; MLX traces
again for any new shape, so a compiled call always does what the eager chain
does for that shape. What depends on state rather than shape (speculating or
ragged caches, cache types, kernel switches, which patches are installed) is
checked in step.py before a call.
"""

import contextlib
import copy
import itertools
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.switch_layers import MoE

from glm53_patches.patches.hc_decode import layer as _hc_decode

from . import PATCH

stats = PATCH.stats

_SCALARS = (bool, int, float, str, type(None))
# Settings a module keeps that never reach its decode arithmetic: leaving them
# out lets one trace serve every layer of a kind.
_NOT_CONFIG = ("layer_idx",)


class Unsupported(Exception):
    """A module tree this patch cannot rebuild from parameters (the layer then runs eagerly)."""


def _constant(value):
    return isinstance(value, _SCALARS) or (
        isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value)
    )


def skeleton(module):
    """A parameter-free copy of a module tree: classes and settings, no arrays."""
    clone = copy.copy(module)
    dict.clear(clone)
    for key, value in module.items():
        if isinstance(value, nn.Module):
            dict.__setitem__(clone, key, skeleton(value))
        elif _constant(value):
            dict.__setitem__(clone, key, value)
        elif not isinstance(value, mx.array):
            raise Unsupported(f"{type(module).__name__}.{key} holds a {type(value).__name__}")
    return clone


def bind(skeleton_, params):
    """A copy of ``skeleton_`` whose arrays are ``params`` (traced arrays, nested like the tree)."""
    clone = copy.copy(skeleton_)
    for key, value in skeleton_.items():
        if isinstance(value, nn.Module):
            dict.__setitem__(clone, key, bind(value, params.get(key, {})))
    for key, value in params.items():
        if isinstance(value, mx.array):
            dict.__setitem__(clone, key, value)
    return clone


def signature(module):
    """What a trace depends on besides input shapes and dtypes: classes, array names, settings."""
    settings = tuple(
        (k, v) for k, v in sorted(vars(module).items()) if k[0] != "_" and k not in _NOT_CONFIG and _constant(v)
    )
    arrays, children = [], []
    for key, value in sorted(module.items()):
        if isinstance(value, nn.Module):
            children.append((key, signature(value)))
        elif isinstance(value, mx.array):
            arrays.append(key)
        elif _constant(value):
            arrays.append((key, value))
        else:
            raise Unsupported(f"{type(module).__name__}.{key} holds a {type(value).__name__}")
    return type(module), tuple(arrays), settings, tuple(children)


# -- traces ----------------------------------------------------------------------------

# The layer whose call may trace: a trace binds the traced parameters into a
# skeleton of the live layer, so a module tree that changed since an earlier
# trace (its parameters then differ, and MLX traces again) is never rebuilt
# from a stale copy.
_CURRENT = [None]
_KEYS = itertools.count()
# function key -> the input signatures it has been traced for.
_TRACED = {}
# (label, input shapes, seconds of Python tracing, retrace or not), in order.
TRACES = []


def _shapes(arrays):
    return tuple((tuple(a.shape), str(a.dtype).rsplit(".", 1)[-1]) for a in arrays if isinstance(a, mx.array))


@contextlib.contextmanager
def _tracing(key, label, arrays, params):
    """Runs only while mx.compile traces: yields the bound layer, then counts a trace or a retrace."""
    start = time.perf_counter()
    shapes = _shapes(arrays)
    yield bind(skeleton(_CURRENT[0]), params)
    seen = _TRACED.setdefault(key, set())
    retrace = bool(seen)  # this function again, for a new input shape
    stats.hit("retrace" if retrace else "trace")
    seen.add(shapes)
    TRACES.append((label, shapes, time.perf_counter() - start, retrace))


# -- the hyper-connections, as hc_decode runs them ---------------------------------------


def _hc_kernel(hc_kernels, hc, x):
    """hc_decode's choice for this hyper-connection, where hc_decode is applied (else its compiled path)."""
    kernel = hc_kernels and _hc_decode.use_kernel(hc, x)
    if kernel:
        stats.hit("hc kernel traced")  # while tracing: proof the kernel is in the graph
    return kernel


def _collapse(hc_kernels, hc, norm, x):
    return _hc_decode.collapse(hc, norm, x, _hc_kernel(hc_kernels, hc, x))


def _expand_collapse(hc_kernels, hc, norm, out, x, post, comb):
    return _hc_decode.expand_collapse(hc, norm, out, x, post, comb, _hc_kernel(hc_kernels, hc, x))


def _ffn(hc_kernels, layer, out, x, post, comb):
    """apply_branch(x, post_attention_layernorm, mlp) after the attention branch's output."""
    x, h, post, comb = _expand_collapse(hc_kernels, layer.ffn_hc, layer.post_attention_layernorm, out, x, post, comb)
    if x.shape[1] > 1 and isinstance(layer.mlp, MoE):
        # apply_branch hands a short block's residual to the MoE, which expands it itself.
        return layer.mlp(h, residual=(x, post, comb))
    return _hc.hc_expand(layer.mlp(h), x, post, comb, use_kernel=True)


# -- the layer functions -------------------------------------------------------------------


def kda_function(label, hc_kernels, masked, record):
    """The compiled KDA layer: ``(x, [left padding, advance,] window, state, layer) -> (x, ...)``.

    Without ``record`` (a decode token) it returns the new window and state.
    With ``record`` (a speculating cache) its cache speculates over the block,
    and it returns what the mixer asked that cache to record: the conv input
    and the final state, then the intermediate states for a block of more than
    one token. With left padding, the mask is ``ArraysCache.make_mask(L)``'s,
    computed in the graph (integers, exact): ``arange(L) >= left_padding - advance``.
    """
    key = next(_KEYS)

    def body(x, left_padding, advance, window, state, params):
        with _tracing(key, label, (x, left_padding, advance, window, state), params) as layer:
            mask = None if left_padding is None else mx.arange(x.shape[1]) >= (left_padding - advance)[:, None]
            h, post, comb = _collapse(hc_kernels, layer.attn_hc, layer.input_layernorm, x)
            cache = ArraysCache(2)  # what the installed mixer reads and writes
            cache[0], cache[1] = window, state
            recorded = {}
            if record:
                cache.start_speculation(x.shape[1])
                # Stock's update_window / update_recurrent call these with what a rollback needs.
                cache.record_speculative_window = lambda index, source, width: recorded.update(conv_input=source)
                cache.record_speculative_states = lambda index, steps, final: recorded.update(steps=steps, final=final)
            out = layer.self_attn(h, mask, cache)
            x = _ffn(hc_kernels, layer, out, x, post, comb)
            if not record:
                return x, cache[0], cache[1]
            steps = () if recorded["steps"] is None else (recorded["steps"],)
            return (x, recorded["conv_input"], recorded["final"], *steps)

    if masked:
        return mx.compile(body)
    return mx.compile(lambda x, window, state, params: body(x, None, None, window, state, params))


def dsa_front_function(label, hc_kernels):
    """``(x, layer) -> (h, q_resid, q, new latent, post, comb)``."""
    key = next(_KEYS)

    def body(x, params):
        with _tracing(key, label, (x,), params) as layer:
            h, post, comb = _collapse(hc_kernels, layer.attn_hc, layer.input_layernorm, x)
            # -- Glm5NextAttention.__call__ up to the cache update --
            attn = layer.self_attn
            batch, length, _ = h.shape
            q_a, kv_a = mx.split(_lang.linear(attn.qkv_a_proj, h), (attn.q_lora_rank,), axis=-1)
            q_resid = attn.q_a_layernorm(q_a)
            q = (
                _lang.linear(attn.q_b_proj, q_resid)
                .reshape(batch, length, attn.num_heads, attn.q_head_dim)
                .transpose(0, 2, 1, 3)
            )
            new_latent = attn.kv_a_layernorm(kv_a)[:, None]
            return h, q_resid, q, new_latent, post, comb

    return mx.compile(body)


def dsa_back_function(label, hc_kernels):
    """``(q, selected, valid, x, post, comb, layer) -> x``; ``selected``: each position's rows, ``[B, L, K, C]``."""
    key = next(_KEYS)

    def body(q, selected, valid, x, post, comb, params):
        with _tracing(key, label, (q, selected, valid, x), params) as layer:
            attn = layer.self_attn
            # -- Glm5NextAttention._attend at L <= 8, over each position's selected latent rows --
            # cache=None: the caller checked the latent cache is a KVCache or
            # BatchKVCache, for which stock's cache argument selects nothing.
            # Stock's mx.async_eval per position in a block only schedules work;
            # nothing can be evaluated inside a trace, and no value depends on it.
            outputs = []
            for index in range(q.shape[2]):
                rows = selected[:, index : index + 1]  # [B, 1, K, C]: the latent's one head
                query = attn.embed_q(q[:, :, index : index + 1])
                out = _lang.scaled_dot_product_attention(query, rows, rows, cache=None, scale=attn.scale,
                                                         mask=valid[:, None, index : index + 1])
                outputs.append(attn.unembed_out(out))
            out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)
            batch, _, length, _ = out.shape
            out = _lang.linear(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
            return _ffn(hc_kernels, layer, out, x, post, comb)

    return mx.compile(body)


def clear():
    _CURRENT[0] = None
    _TRACED.clear()
    TRACES.clear()

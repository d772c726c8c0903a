"""A glm5_next decoder layer at decode, hyper-connections fused.

``decode_step(layer, x, mask, cache, prev_topk_indices)`` returns what
``DecoderLayer.__call__`` returns for a decode token or a short block
(``L <= DECODE_BLOCK_SIZE``, 8: speculative verify blocks), or None, having
touched nothing, where the stock code must run. Stock runs each decoder layer as
``attn_hc.apply_branch(x, input_layernorm, self_attn, ...)`` then
``ffn_hc.apply_branch(x, post_attention_layernorm, mlp)``. At ``L == 1`` each
``apply_branch`` builds, op by op, the hyper-connection collapse
(``HyperConnection.__call__``), the branch's input norm, the branch, and the
expand (``hc_expand``). Here the same code runs inside ``mx.compile``d pure
functions, so one graph is built once per shape and replayed:

    collapse(x)                     -> input_layernorm(collapsed), post, comb
    branch                          (self_attn: whatever is installed there,
                                     so a patched mixer still engages)
    expand + collapse(x)            -> x, post_attention_layernorm(collapsed),
                                       post, comb
    mlp
    hc_expand                       (the stock compiled _hc_expand_op)

A short block (1 < L <= 8) takes the same path, because off Metal stock's
``apply_branch`` does too: its exact short-block kernels are Metal-only, and
the mix matmul is ``HyperConnection._mix``'s (per position at batch 1) either way.
The one difference is kept: an MoE branch gets the residual and expands it
itself (``SwitchGLU._combine``). On Metal short blocks go to stock.

The functions *call* mlx-vlm's own ``HyperConnection.__call__``/``_mix``,
``hc_expand`` and the norm modules on parameter-free copies bound to traced
parameters (weights are inputs, never captured), so the arithmetic is the
stock code's by construction; ``mx.compile`` only fuses neighbouring
elementwise ops, which on the CPU changes no rounding. On a GPU backend where
the kernel is enabled (``kernel_wanted``), the Sinkhorn collapse inside
``collapse`` is the one-launch kernel of ``hc_sinkhorn`` instead of the stock
path's ~80 launches.
"""

import contextlib
import copy
import functools
import logging

import mlx.core as mx

from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.switch_layers import MoE

from glm53_patches import config, verify_records
from glm53_patches.log import once
from glm53_patches.kernels import hc_sinkhorn
from glm53_patches.kernels.rowwise import block_matvecs, block_on_cuda

from . import PATCH

stats = PATCH.stats

# Static signature -> mx.compile'd function (mx.compile keeps one trace per
# input shapes and dtypes inside each entry).
_COMPILED = {}
# Backend -> whether the kernel runs there (``kernel_setting``, asked once).
_KERNEL_DECISION = {}
_FORCED = [None]  # set by `forcing_kernel` (tests, device checks)
_SCALARS = (bool, int, float, str, type(None))
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

# The plugin's own wiring: its setting knob and the wrapper it installs.
WRAPPER_MARK = "_glm53_hc_decode"  # set on the replacement __call__
def kernel_setting(backend):
    """GLM53_HC_DECODE_KERNEL: auto (default: where `verify` passed on this backend), 1 or 0."""
    setting, error = config.knob("hc_decode", "kernel", PATCH.knobs["kernel"], None)
    if error:
        once(logging.ERROR, f"hc_decode: {error}; the kernel stays off")
        return False
    if setting is None:
        setting = verify_records.passed(PATCH.name, backend)
    return bool(setting)


def kernel_wanted(backend):
    """Does the one-launch kernel run on `backend` ('cuda', 'metal'; else never)?"""
    if backend not in ("cuda", "metal"):
        return False
    if _FORCED[0] is not None:
        return _FORCED[0]
    decision = _KERNEL_DECISION.get(backend)
    if decision is None:
        decision = _KERNEL_DECISION[backend] = bool(kernel_setting(backend))
    return decision


@contextlib.contextmanager
def forcing_kernel(on):
    """Within the block, the kernel runs (True), never runs (False) or follows the setting (None)."""
    previous = _FORCED[0]
    _FORCED[0] = on
    try:
        yield
    finally:
        _FORCED[0] = previous


# -- parameter-free copies of modules -------------------------------------------------


def _skeleton(module):
    """A copy of a module with its class and configuration but no parameters."""
    clone = copy.copy(module)
    dict.clear(clone)
    return clone


def _bind(skeleton, params):
    """The skeleton with ``params`` (traced arrays) as its parameters."""
    clone = copy.copy(skeleton)
    dict.update(clone, params)
    return clone


def _leaf_signature(module):
    scalars = tuple(
        (k, v) for k, v in sorted(vars(module).items()) if not k.startswith("_") and isinstance(v, _SCALARS)
    )
    return (type(module), tuple(sorted(module.keys())), scalars)


def _traced_callables():
    """mlx-vlm callables the traces bake in: a replaced one means a fresh trace."""
    cls = _hc.HyperConnection
    return (
        cls.__call__,
        cls._mix,
        _hc.hc_expand,
        _hc._hc_ops,
        _hc._hc_kernel,
        _hc._hc_expand_op,
        _hc._hc_split_sinkhorn_ops,
        id(_hc._hc_sinkhorn_collapse_kernel),
    )


# -- the collapse, two ways ----------------------------------------------------------------


def _stock_collapse(hc, x):
    """The stock ``HyperConnection.__call__`` (``_hc_ops`` or, on Metal, ``_hc_kernel``)."""
    return hc(x)


_STOCK_MIX = _hc.HyperConnection._mix


def mix(hc, z):
    """``hc._mix(z)``; for a CUDA block at batch 1, its per-position matmuls (``tokenwise``) as one
    launch with each position's bits (``kernels/rowwise.py``)."""
    if block_on_cuda(z, hc_sinkhorn.gpu_backend()) and type(hc)._mix is _STOCK_MIX:
        return block_matvecs(z, hc.fn)
    return hc._mix(z)


def _kernel_collapse(hc, x):
    """``HyperConnection.__call__`` with the Sinkhorn collapse as one kernel launch."""
    y = x.astype(mx.float32)
    z = mx.fast.rms_norm(y.flatten(-2), None, hc.norm_eps)
    mixes = mix(hc, z)
    collapsed, post, comb = hc_sinkhorn.hc_sinkhorn_collapse(
        x, mixes, hc.scale, hc.base, hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps
    )
    return collapsed, post, comb


def _build(role, hc, norm, use_kernel):
    hc_skeleton, norm_skeleton = _skeleton(hc), _skeleton(norm)
    collapse = _kernel_collapse if use_kernel else _stock_collapse

    def collapse_normed(x, hc_params, norm_params):
        stats.hit("trace")  # runs only while mx.compile traces: counts traces, not calls
        collapsed, post, comb = collapse(_bind(hc_skeleton, hc_params), x)
        return _bind(norm_skeleton, norm_params)(collapsed), post, comb

    if role == "collapse":
        return mx.compile(collapse_normed)

    def expand_collapse(out, x, post, comb, hc_params, norm_params):
        # apply_branch's hc_expand(output, x, post, comb, use_kernel=not training)
        x = _hc.hc_expand(out, x, post, comb, use_kernel=True)
        h, post, comb = collapse_normed(x, hc_params, norm_params)
        return x, h, post, comb

    return mx.compile(expand_collapse)


def _compiled(role, hc, norm, use_kernel):
    key = (role, use_kernel, str(mx.default_device()), _leaf_signature(hc), _leaf_signature(norm), _traced_callables())
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = _build(role, hc, norm, use_kernel)
    return fn


def use_kernel(hc, x):
    """Kernel for this hyper-connection? False (the compiled path runs) where it cannot cover the call."""
    backend = hc_sinkhorn.gpu_backend()
    if not kernel_wanted(backend):
        return False
    reason = hc_sinkhorn.unsupported(x, hc.hc_mult, backend)
    if reason is not None:
        stats.fallback(f"kernel: {reason} (compiled path ran)")
        return False
    hc_sinkhorn.compiled_constant(hc.hc_eps)  # probe (it evaluates) before any trace needs it
    return True


def collapse(hc, norm, x, kernel):
    """``norm(collapsed), post, comb`` of ``hc(x)`` as one compiled call (``kernel``: ``use_kernel``'s answer).

    Pure: layer_decode calls it inside its own traces, where it is inlined.
    """
    return _compiled("collapse", hc, norm, kernel)(x, dict(hc), dict(norm))


def expand_collapse(hc, norm, out, x, post, comb, kernel):
    """``hc_expand(out, x, post, comb)``, then ``collapse`` of the result with ``hc``: ``x, h, post, comb``."""
    return _compiled("expand_collapse", hc, norm, kernel)(out, x, post, comb, dict(hc), dict(norm))


def _why_not(layer, x):
    """The reason to run the stock layer, or None when the fused path applies."""
    if x.ndim != 4 or not 1 <= x.shape[1] <= _hc.DECODE_BLOCK_SIZE:
        return "length"
    if x.shape[1] > 1 and hc_sinkhorn.gpu_backend() == "metal":
        # On Metal stock's apply_branch runs short blocks through its own exact
        # kernels (exact_hc_norm, exact_hc_expand, the MoE's fused residual).
        return "metal verify block"
    if layer.training or layer.attn_hc.training or layer.ffn_hc.training:
        return "training"
    hc_class = _hc.HyperConnection
    if type(layer.attn_hc) is not hc_class or type(layer.ffn_hc) is not hc_class:
        return "module type"
    if x.shape[2] != layer.attn_hc.hc_mult or x.shape[2] != layer.ffn_hc.hc_mult:
        return "shape"
    if x.dtype not in _FLOATS:
        return "dtype"
    return None


def decode_step(layer, x, mask=None, cache=None, prev_topk_indices=None):
    """``layer(x, mask, cache, prev_topk_indices)`` for one decode token, fused.

    Returns None, having touched nothing, where the stock code must run.
    """
    reason = _why_not(layer, x)
    if reason is not None:
        stats.fallback(reason)
        return None
    attn_hc, ffn_hc = layer.attn_hc, layer.ffn_hc

    kernel = use_kernel(attn_hc, x)
    h, post, comb = collapse(attn_hc, layer.input_layernorm, x, kernel)
    stats.hit("kernel" if kernel else "compiled")
    if layer.is_linear:
        out = layer.self_attn(h, mask, cache)
        topk = prev_topk_indices
    else:
        out, topk = layer.self_attn(h, mask, cache, prev_topk_indices)

    kernel = use_kernel(ffn_hc, x)
    x, h, post, comb = expand_collapse(ffn_hc, layer.post_attention_layernorm, out, x, post, comb, kernel)
    stats.hit("kernel" if kernel else "compiled")
    stats.hit("layer" if x.shape[1] == 1 else "block")
    if x.shape[1] > 1 and isinstance(layer.mlp, MoE):
        # apply_branch hands a short block's residual to the MoE, which expands it itself.
        return layer.mlp(h, residual=(x, post, comb)), topk
    out = layer.mlp(h)
    return _hc.hc_expand(out, x, post, comb, use_kernel=True), topk


def make_call(original):
    """The replacement for ``DecoderLayer.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None, prev_topk_indices=None):
        output = decode_step(self, x, mask, cache, prev_topk_indices)
        return original(self, x, mask, cache, prev_topk_indices) if output is None else output

    setattr(__call__, WRAPPER_MARK, True)
    return __call__


def compiled_count():
    return len(_COMPILED)


def clear():
    """Drop compiled functions and kernel decisions."""
    _COMPILED.clear()
    _KERNEL_DECISION.clear()

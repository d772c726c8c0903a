"""The replacement for ``Glm5NextTextModel.__call__``: a decode step as compiled layer functions.

For one token per row, the stock step embeds, repeats the hidden state over
the hyper-connection streams, then calls every ``DecoderLayer`` through its
(possibly patched) ``__call__``, which checks, per call and per module, what
to run. Here the step runs the same embedding and final norm, and each layer
as ``layer.py``'s compiled functions. What those functions depend on beyond
input shapes is decided once per step, not once per layer call:

- the *composition* (``_token``): which upstream objects are installed where
  the layer functions call them (stock's, the project's patches', or a test's
  or a verify's swap), which patches are applied, the backend, and the GPU
  kernel switches of the patches whose code runs inside the traces. A change
  builds new functions (traced afresh); a patch this one does not know that
  touches model code makes it step aside altogether;
- the *plan* per model: each layer's kind (KDA, DSA with its own or a shared
  top-k selection; MoE or MLP) and its compiled functions, shared by every
  layer with the same module classes and settings, so there is one trace per
  layer kind and input shape.

A speculative verify block (2 to ``DECODE_BLOCK_SIZE`` tokens, the caches
speculating) takes the same functions: off Metal, stock runs such a block
through its decode path, position by position where it matters (hc_decode's
and dsa_decode's docstrings say where). A KDA layer's function then returns
what the mixer recorded for rollback, and the real cache records it through
its own ``update_window`` / ``update_recurrent``, as compiled_kda_decode does.

Per layer call only the cache's state is checked (a ragged KDA cache, an
unexpected cache type), and a hit is one in-place increment. Prefill, short
blocks while nothing speculates (a prompt's last chunk), blocks on Metal
(stock runs its own exact block kernels there), training and layers of
another shape of module run the installed stock chain.
"""

import functools
import itertools
import sys
import weakref
from collections import Counter

import mlx.core as mx

from mlx_vlm.models import gated_delta as _gated
from mlx_vlm.models import mla as _mla
from mlx_vlm.models import switch_layers as _switch
from mlx_vlm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache
from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches import registry
from glm53_patches.backend import gpu_backend
from glm53_patches.kernels import hc_sinkhorn

from . import PATCH
from . import layer as _layer
from .counts import Tally

stats = PATCH.stats

# Decode patches whose code this one traces, and how (the report lists the applied ones). A
# patch that declares `prefill_only` composes too: a step's single token passes it untouched.
COMPOSES = {
    "hc_decode": "hyper-connections, its kernel where it runs",
    "compiled_kda_decode": "traced in KDA layers",
    "fused_kda_kernel": "traced in KDA layers",
    "router_select": "traced in MoE layers",
    "expert_combine": "traced in MoE layers",
    "dsa_decode": "eager indexer, row gather",
    "exact_qmv": "traced: the decode projections' matvec",
    "block_qmv": "traced: a verify block's projections, each weight read once",
    "routed_experts": "traced in MoE layers: the routed experts' matvec",
    "kda_verify_kernel": "traced in KDA layers: a verify block's recurrence",
    "indexer_fp32": "eager indexer",
}
# Model code a decode step never calls: a patch on it alone (vault_cache's load-time
# weights fingerprint) leaves the step as it is.
OFF_THE_STEP = (":LanguageModel.sanitize", ":Model.sanitize")
# The patches whose kernel switch is read inside the traces: (module, what answers for a backend).
_SWITCHES = {
    "hc_decode": ("glm53_patches.patches.hc_decode.layer", lambda m: m.kernel_wanted),
    "fused_kda_kernel": ("glm53_patches.patches.fused_kda_kernel.step", lambda m: m.switch.wanted),
    "router_select": ("glm53_patches.patches.router_select.gate", lambda m: m.switch.wanted),
    "expert_combine": ("glm53_patches.patches.expert_combine.combine", lambda m: m.switch.wanted),
    "exact_qmv": ("glm53_patches.patches.exact_qmv.linear", lambda m: m.switch.wanted),
    "kda_verify_kernel": ("glm53_patches.patches.kda_verify_kernel.recurrence", lambda m: m.switch.wanted),
}


def _watched():
    """(namespace, name) of every upstream object the layer functions look up when they trace."""
    names = {
        _lang: ["linear", "tiled_linear", "_expert_select", "_limited_swiglu", "gated_delta_update",
                "scaled_dot_product_attention", "create_ssm_mask"],
        _lang.DecoderLayer: ["__call__"],
        _lang.Glm5NextLinearAttention: ["__call__"],
        _lang.ShortConv1d: ["__call__"],
        _lang.Glm5NextAttention: ["__call__", "_attend"],
        _lang.MoEGate: ["__call__"],
        _lang.Glm5NextMLP: ["__call__"],
        _lang.LimitedSwiGLU: ["__call__"],
        _switch.MoE: ["__call__"],
        _switch.SwitchGLU: ["__call__", "_combine"],
        _switch.SwitchLinear: ["__call__"],
        _switch.QuantizedSwitchLinear: ["__call__"],
        _hc.HyperConnection: ["__call__", "_mix"],
        _hc: ["hc_expand", "_hc_expand_op", "_hc_ops", "_hc_kernel", "_hc_split_sinkhorn_ops"],
        ArraysCache: ["update_window", "update_recurrent", "advance", "make_mask"],
        _gated: ["gated_delta_ops", "gated_delta_kernel", "compute_g_safe", "compute_g", "_gated_delta_step_ops"],
        _mla.MultiLinear: ["__call__"],
    }
    return tuple((vars(owner), name) for owner, attrs in names.items() for name in attrs)


_WATCHED = _watched()


def _token():
    """What the compiled functions depend on besides shapes; compared once per step."""
    installed = tuple([namespace.get(name) for namespace, name in _WATCHED])
    applied = tuple(registry.applied())
    backend = hc_sinkhorn.gpu_backend()
    decisions = ()
    if backend is not None:  # off a GPU no switch can turn a kernel on
        decisions = tuple(
            (name, getter(sys.modules[module])(backend))
            for name, (module, getter) in _SWITCHES.items()
            if name in applied and module in sys.modules
        )
    return installed, applied, str(mx.default_device()), decisions


# -- plans -----------------------------------------------------------------------------------


class Plan:
    """One model's layers under one composition: an entry per layer."""

    def __init__(self, model, token):
        self.model = weakref.ref(model, lambda _, key=id(model): _forget(key))
        self.token = token
        self.refused = _refusal(token[1])
        self.entries = [] if self.refused else [_entry(layer, token) for layer in model.layers]
        self.tallies = [t for e in self.entries for t in e.tallies]
        self.stale = False
        # Whether a block may take this path: a KDA cache says if the caches speculate.
        self.kda_index = next((i for i, e in enumerate(self.entries) if isinstance(e, Kda)), None)
        self.metal = gpu_backend() == "metal"
        stats.attach(self.tallies)

    def retire(self):
        stats.detach(self.tallies)


def _refusal(applied):
    """Why no step may take this path (a patch on model code that this one does not run), or None."""
    patches = registry.available()
    for name in applied:
        if name == PATCH.name or name in COMPOSES or name not in patches or patches[name].prefill_only:
            continue
        touched = [t for t in patches[name].targets
                   if t.startswith(("mlx_vlm.models.", "mlx.")) and not t.endswith(OFF_THE_STEP)]
        if touched:
            return f"{name} patches {touched[0].split(':')[-1]}"
    return None


_PLANS = {}  # id(model) -> Plan
_FUNCTIONS = {}  # (token, kind, signature) -> compiled functions; only the current tokens kept
_KEEP_TOKENS = 4  # e.g. verify alternating kernels on and off keeps its traces


def _plan(model):
    token = _token()
    plan = _PLANS.get(id(model))
    if plan is not None and not plan.stale and plan.token == token and plan.model() is model:
        return plan
    if plan is not None:
        plan.retire()
    plan = _PLANS[id(model)] = Plan(model, token)
    tokens = list(dict.fromkeys(key[0] for key in _FUNCTIONS))
    for old in tokens[:-_KEEP_TOKENS]:
        for key in [k for k in _FUNCTIONS if k[0] == old]:
            del _FUNCTIONS[key]
    return plan


def _forget(key):
    """A model was dropped: so is its plan (its functions stay while another model's plan shares them)."""
    plan = _PLANS.get(key)
    if plan is not None and plan.model() is None:
        del _PLANS[key]
        plan.retire()


def _function(token, kind, sig, make):
    key = (token, kind, sig)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = make()
    return fn


def _entry(layer, token):
    """The entry that runs ``layer``: compiled where its kind is covered, else the eager chain."""
    if type(layer) is not _lang.DecoderLayer:
        return Eager(layer, "layer type")
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer.attn_hc) is not _hc.HyperConnection or type(layer.ffn_hc) is not _hc.HyperConnection:
        return Eager(layer, "hyper-connection type")
    if type(mlp) not in (_lang.Glm5NextMoE, _lang.Glm5NextMLP):
        return Eager(layer, "mlp type")
    try:
        sig = _layer.signature(layer)
    except _layer.Unsupported as exc:
        return Eager(layer, f"module tree: {exc}")
    hc_kernels = "hc_decode" in token[1]
    ffn = "moe" if type(mlp) is _lang.Glm5NextMoE else "mlp"
    if layer.is_linear and type(attn) is _lang.Glm5NextLinearAttention:
        functions = {}
        for masked, record in itertools.product((False, True), repeat=2):
            kind = f"kda+{ffn}" + " masked" * masked + " recording" * record
            functions[masked, record] = _function(
                token, kind, sig, lambda kind=kind, masked=masked, record=record:
                _layer.kda_function(kind, hc_kernels, masked, record))
        return Kda(layer, functions)
    if not layer.is_linear and type(attn) is _lang.Glm5NextAttention:
        kind = f"{'dsa-shared' if attn.indexer is None else 'dsa'}+{ffn}"
        front = _function(token, kind + " front", sig, lambda: _layer.dsa_front_function(kind + " front", hc_kernels))
        back = _function(token, kind + " back", sig, lambda: _layer.dsa_back_function(kind + " back", hc_kernels))
        rows = _dsa_decode_rows() if "dsa_decode" in token[1] else stock_rows
        return Dsa(layer, front, back, rows, attn.indexer is None)
    return Eager(layer, "attention type")


def _dsa_decode_rows():
    from glm53_patches.patches.dsa_decode.decode import select_rows

    return select_rows


def stock_rows(latent, topk):
    """What ``Glm5NextAttention._attend`` gathers for each position of ``topk``: ``[B, L, K, C]`` rows
    (its ``take_along_axis`` per position, in one call), their validity ``[B, L, K]``."""
    batch, _, length, channels = latent.shape
    valid = (topk >= 0) & (topk < length)
    safe = mx.clip(topk, 0, max(length - 1, 0)).reshape(batch, 1, -1, 1)
    return mx.take_along_axis(latent, safe, axis=2).reshape(*topk.shape, channels), valid


# -- the layer entries -------------------------------------------------------------------------


def _eager(layer, h, mask, cache, topk, reason):
    """The layer as stock's loop calls it (through whatever DecoderLayer.__call__ is installed)."""
    stats.fallback(reason)
    if layer.block_type == "linear_attention" and cache is not None:
        mask = _lang.create_ssm_mask(h[:, :, 0], cache)
    return layer(h, mask, cache, topk)


class Eager:
    __slots__ = ("layer", "reason", "tallies")

    def __init__(self, layer, reason):
        self.layer, self.reason, self.tallies = weakref.ref(layer), reason, ()

    def run(self, plan, layer, h, mask, cache, topk):
        return _eager(layer, h, mask, cache, topk, self.reason)


class Kda:
    __slots__ = ("layer", "functions", "tallies")

    def __init__(self, layer, functions):
        self.layer, self.functions = weakref.ref(layer), functions  # (masked, recording) -> function
        self.tallies = Tally("kda layer"), Tally("kda block")

    def run(self, plan, layer, h, mask, cache, topk):
        if self.layer() is not layer or type(layer) is not _lang.DecoderLayer:
            plan.stale = True
            return _eager(layer, h, mask, cache, topk, "layer changed")
        # What the traced mixer cannot reproduce: stock gathers ragged windows
        # per row, makes the state itself, or raises its own capacity error.
        if type(cache) is not ArraysCache or len(cache.cache) != 2:
            return _eager(layer, h, mask, cache, topk, "kda cache type")
        if cache._lengths is not None:
            return _eager(layer, h, mask, cache, topk, "ragged")
        window, state = cache.cache
        if window is None or state is None:
            return _eager(layer, h, mask, cache, topk, "no state")
        length = h.shape[1]
        recording = cache.is_speculating
        if recording and cache.history_capacity < length:
            return _eager(layer, h, mask, cache, topk, "history capacity")
        _layer._CURRENT[0] = layer
        # create_ssm_mask(h[:, :, 0], cache) is cache.make_mask(L): None without
        # left padding, else built inside the graph from the padding and the advance.
        padding = cache._left_padding
        function = self.functions[padding is not None, recording]
        if padding is None:
            h, *updated = function(h, window, state, layer)
        else:
            advance = _advance(cache._left_padding_advance, padding.dtype)
            h, *updated = function(h, padding, advance, window, state, layer)
        if recording:
            # The cache's own calls, in stock's order, with what the mixer recorded: they keep
            # the window's and the states' history for the rollback, as they do for stock.
            conv_input, final, *steps = updated
            cache.update_window(0, conv_input, window.shape[1])
            cache.update_recurrent(1, length, lambda _state, _steps: (None, final, *steps))
        else:
            # What the stock mixer leaves in a cache without speculation or lengths:
            # update_window(0, ...), update_recurrent(1, ...), advance(1).
            cache[0], cache[1] = updated
        cache.advance(length)
        self.tallies[length > 1].hits += 1
        return h, topk


_ADVANCE = [None, None]  # (count, dtype), its array: every KDA cache of a step shares one


def _advance(count, dtype):
    if _ADVANCE[0] != (count, dtype):
        _ADVANCE[:] = (count, dtype), mx.array(count, dtype=dtype)
    return _ADVANCE[1]


class Dsa:
    __slots__ = ("layer", "front", "back", "rows", "shared", "tallies")

    def __init__(self, layer, front, back, rows, shared):
        self.layer, self.front, self.back, self.rows, self.shared = weakref.ref(layer), front, back, rows, shared
        self.tallies = Tally("dsa layer"), Tally("dsa block")

    def run(self, plan, layer, h, mask, cache, topk):
        if self.layer() is not layer or type(layer) is not _lang.DecoderLayer:
            plan.stale = True
            return _eager(layer, h, mask, cache, topk, "layer changed")
        if type(cache) is not CacheList or len(cache.caches) != (2 if self.shared else 4):
            return _eager(layer, h, mask, cache, topk, "dsa cache type")
        kv_cache = cache.caches[0]
        if type(kv_cache) not in (KVCache, BatchKVCache):  # quantized latents attend another way
            return _eager(layer, h, mask, cache, topk, "dsa cache type")
        if self.shared and topk is None:
            return _eager(layer, h, mask, cache, topk, "no top-k to share")  # stock raises
        _layer._CURRENT[0] = layer
        batch, length = h.shape[:2]
        x, q_resid, q, new_latent, post, comb = self.front(h, layer)
        # -- Glm5NextAttention.__call__'s growing part, eagerly, as stock runs it --
        offset = kv_cache.offset
        latent, _ = kv_cache.update_and_fetch(new_latent, mx.zeros((batch, 1, length, 0), dtype=new_latent.dtype))
        if not self.shared:
            topk = layer.self_attn.indexer(x, q_resid, mask, cache.caches[1], cache.caches[2], offset)
        selected, valid = self.rows(latent, topk)  # _attend's rows of every position, one gather
        h = self.back(q, selected, valid, h, post, comb, layer)
        self.tallies[length > 1].hits += 1
        return h, topk


# -- the step ----------------------------------------------------------------------------------


def decode_step(model, inputs, inputs_embeds=None, cache=None, attention_mask=None, hidden_sink=None):
    """``Glm5NextTextModel.__call__`` for one token per row or a verify block; None, having touched
    nothing, elsewhere."""
    tokens = inputs if inputs_embeds is None else inputs_embeds
    if tokens is None or tokens.ndim < 2 or not 1 <= tokens.shape[1] <= _lang.DECODE_BLOCK_SIZE:
        stats.fallback("length")  # prefill
        return None
    if model.training:
        stats.fallback("training")
        return None
    layers = model.layers
    if cache is None or len(cache) != len(layers) or any(c is None for c in cache):
        stats.fallback("no cache")
        return None
    plan = _plan(model)
    if plan.refused:
        stats.fallback(plan.refused)
        return None
    if tokens.shape[1] > 1:
        if plan.kda_index is None or not getattr(cache[plan.kda_index], "is_speculating", False):
            stats.fallback("length")  # a prefill chunk of a few tokens
            return None
        if plan.metal:
            stats.fallback("metal verify block")  # stock's exact Metal block kernels have no twin here
            return None
    # -- Glm5NextTextModel.__call__ --
    h = model.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
    if attention_mask is not None:
        attention_mask = attention_mask.astype(mx.bool_)
        if attention_mask.shape[-1] != h.shape[1]:
            attention_mask = attention_mask[..., -h.shape[1]:]
    h = mx.repeat(h[:, :, None], model.config.hc_mult, axis=2)
    topk = None
    for entry, layer, layer_cache in zip(plan.entries, layers, cache):
        h, topk = entry.run(plan, layer, h, attention_mask, layer_cache, topk)
    _layer._CURRENT[0] = None  # keep no layer alive
    h = model.norm(h.mean(axis=2))
    if hidden_sink is not None:
        hidden_sink.append(h)
    return h


def make_call(original):
    """The replacement for ``Glm5NextTextModel.__call__``."""

    @functools.wraps(original)
    def __call__(self, inputs, inputs_embeds=None, cache=None, attention_mask=None, hidden_sink=None):
        h = decode_step(self, inputs, inputs_embeds, cache, attention_mask, hidden_sink)
        if h is None:
            return original(self, inputs, inputs_embeds, cache, attention_mask, hidden_sink=hidden_sink)
        return h

    return __call__


# -- status ------------------------------------------------------------------------------------


def report():
    """One line for `status`: the layer kinds compiled, the traces, what composes."""
    kinds = Counter()
    for plan in list(_PLANS.values()):
        for entry in plan.entries:
            kinds[_kind_label(entry)] += 1
    traces = list(_layer.TRACES)
    seconds = sum(t[2] for t in traces)
    applied = [n for n in registry.applied() if n in COMPOSES]
    patches = registry.available()
    prefill = [n for n in registry.applied() if n in patches and patches[n].prefill_only]
    parts = []
    if kinds:
        parts.append("layers: " + ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    retraces = sum(t[3] for t in traces)
    parts.append(f"{len(traces) - retraces} traces + {retraces} retraces (new shapes), {seconds:.2f} s of Python tracing"
                 + (f", batch sizes {sorted({t[1][0][0][0] for t in traces})}" if traces else ""))
    if applied:
        parts.append("runs " + ", ".join(f"{n} ({COMPOSES[n]})" for n in applied))
    if prefill:
        parts.append("leaves to prefill " + ", ".join(prefill))
    return "; ".join(parts)


def _kind_label(entry):
    if isinstance(entry, Eager):
        return f"eager ({entry.reason})"
    if isinstance(entry, Kda):
        return "kda"
    return "dsa-shared" if entry.shared else "dsa"


def clear():
    """Drop every plan, compiled function and trace record."""
    for plan in list(_PLANS.values()):
        plan.retire()
    _PLANS.clear()
    _FUNCTIONS.clear()
    _ADVANCE[:] = None, None
    _layer.clear()

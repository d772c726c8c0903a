"""gathered_prefill is bit-identical to stock sparse prefill attention on this backend.

Exact means bit-identical: every comparison is on the raw bits (uint views).
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches import log as glm53_log
from glm53_patches.patches.gathered_prefill import PATCH, attention
from glm53_patches.patches.gathered_prefill.checks.verify import indexer_like
from glm53_patches.tiny_model import build_model, tiny_config
from glm53_patches.exactness import same_bits
from mlx_vlm.models.glm5_next import language

STOCK = language._sparse_prefill_attention
KNOB = "GLM53_GATHERED_PREFILL_MIN_CONTEXT"
BUDGET = "GLM53_GATHERED_PREFILL_MAX_ELEMENTS"


def assert_bitwise(ref, got, what):
    assert ref.shape == got.shape and ref.dtype == got.dtype, what
    assert same_bits(ref, got), what


@pytest.fixture
def patched(monkeypatch):
    """The patch's own factory installed over the module global _attend looks up."""
    PATCH.stats.reset()
    fast = PATCH.targets["mlx_vlm.models.glm5_next.language:_sparse_prefill_attention"](STOCK)
    monkeypatch.setattr(language, "_sparse_prefill_attention", fast)
    return fast


def inputs(dtype, batch=1, q_heads=4, kv_heads=4, q_length=37, kv_length=120, dim=32, v_dim=32,
           topk=24, kpool=4, seed=0, padded_rows=(), capacity=None):
    """capacity: K/V are views [..., :kv_length, :] of a longer buffer, as KVCache returns them."""
    mx.random.seed(seed)
    q = mx.random.normal((batch, q_heads, q_length, dim)).astype(dtype)
    capacity = capacity or kv_length
    k = mx.random.normal((batch, kv_heads, capacity, dim)).astype(dtype)[..., :kv_length, :]
    v = mx.random.normal((batch, kv_heads, capacity, v_dim)).astype(dtype)[..., :kv_length, :]
    indices = indexer_like(batch, q_length, kv_length, topk, kpool, seed, holes=0.05, beyond=0.01,
                           padded_rows=padded_rows)
    return q, k, v, indices, dim**-0.5


LAYER_CASES = {
    "b1": {},
    "b2-padded": {"batch": 2, "padded_rows": [(0, 5), (1, 11)]},
    "gqa": {"q_heads": 8, "kv_heads": 2},
    "v-dim": {"dim": 64, "v_dim": 32},
    "one-query": {"q_length": 1},
    "short-kv": {"kv_length": 40, "q_length": 40},  # fewer visible keys than slots
    "kv-cache-view": {"batch": 2, "capacity": 256},
}


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", LAYER_CASES)
@pytest.mark.parametrize("chunk", [1, 7, 16, None])  # queries per chunk; None: all at once
def test_layer_is_bitwise_stock(patched, monkeypatch, dtype, case, chunk):
    monkeypatch.setenv(KNOB, "0")
    q, k, v, indices, scale = inputs(dtype, **LAYER_CASES[case])
    batch, q_heads, _, dim = q.shape
    kv_heads, v_dim, topk = k.shape[1], v.shape[-1], indices.shape[-1]
    depth = max(kv_heads * topk * max(dim, v_dim), q_heads * topk) * batch
    if chunk is not None:  # the element budget that allows exactly `chunk` queries
        monkeypatch.setenv(BUDGET, str(depth * chunk + depth - 1))
        assert attention.query_chunk(batch, q_heads, kv_heads, dim, v_dim, topk) == chunk
    ref = STOCK(q, k, v, indices, scale)
    sdpa, gathered = mx.fast.scaled_dot_product_attention, []

    def spy(q, k, v, **kwargs):
        gathered.append((k.shape, v.shape))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    got = language._sparse_prefill_attention(q, k, v, indices, scale)
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)
    assert_bitwise(ref, got, f"{case} chunk {chunk}")
    assert PATCH.stats.snapshot() == {"hits": {"call": 1}, "fallbacks": {}}
    # Fewest chunks within the budget, none over it (chunk None: one call).
    q_length = q.shape[2]
    most = q_length if chunk is None else chunk
    assert len(gathered) == -(-q_length // most)
    assert sum(k_shape[0] for k_shape, _ in gathered) == batch * q_length
    budget = attention.element_budget()
    assert all(max(np.prod(a), np.prod(b)) <= budget for a, b in gathered)
    assert mx.all(mx.isfinite(ref.astype(mx.float32))).item()


def test_padding_rows_match_stock_exactly(patched, monkeypatch):
    """All -1 rows: stock's fused SDPA output for a fully masked row, bit for bit."""
    monkeypatch.setenv(KNOB, "0")
    q, k, v, indices, scale = inputs(mx.float32, batch=2, q_length=20, padded_rows=[(0, 20), (1, 3)])
    ref = STOCK(q, k, v, indices, scale)
    got = language._sparse_prefill_attention(q, k, v, indices, scale)
    assert_bitwise(ref, got, "padded rows")
    assert PATCH.stats.hits == 1


def test_query_chunk_stays_under_two_to_the_31():
    # GLM-5.3-Flash: 64 heads, K/V head dim 256, 2048 + 15 selected keys.
    for batch in (1, 2, 3):
        per_query = 64 * 2063 * 256 * batch
        chunk = attention.query_chunk(batch, 64, 64, 256, 256, 2048 + 15, attention.MAX_ELEMENTS)
        assert chunk * per_query < 2**31 <= (chunk + 1) * per_query
        budget = attention.element_budget()  # the default on this backend
        chunk = attention.query_chunk(batch, 64, 64, 256, 256, 2048 + 15)
        assert chunk * per_query <= budget < (chunk + 1) * per_query
    assert attention.balanced_chunk(512, 63) == 57  # 9 chunks of at most 57
    assert attention.balanced_chunk(10, 63) == 10


def test_short_context_runs_stock(patched, monkeypatch):
    monkeypatch.setenv(KNOB, "121")
    q, k, v, indices, scale = inputs(mx.float32)  # 120 keys
    got = language._sparse_prefill_attention(q, k, v, indices, scale)
    assert_bitwise(STOCK(q, k, v, indices, scale), got, "short context")
    assert PATCH.stats.snapshot() == {"hits": {}, "fallbacks": {"short context": 1}}


def test_defaults():
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert attention.min_context() == attention.default_min_context() == (2**62 if on_cuda else 0)
    assert attention.MAX_ELEMENTS == 2**31 - 1
    on_gpu = mx.default_device() == mx.gpu
    assert attention.element_budget() == (attention.MAX_ELEMENTS if on_gpu else attention.CPU_ELEMENTS)


@pytest.mark.parametrize("value, hit", [("120", True), ("121", False), ("0", True)])
def test_min_context_knob(patched, monkeypatch, value, hit):
    monkeypatch.setenv(KNOB, value)
    q, k, v, indices, scale = inputs(mx.float32)  # 120 keys
    got = language._sparse_prefill_attention(q, k, v, indices, scale)
    assert_bitwise(STOCK(q, k, v, indices, scale), got, value)
    assert PATCH.stats.hits == int(hit)


@pytest.mark.parametrize("knob, value, read", [
    (KNOB, "lots", attention.min_context),
    (KNOB, "-1", attention.min_context),
    (BUDGET, "0", attention.element_budget),
    (BUDGET, str(2**31), attention.element_budget),
])
def test_bad_knob_value_keeps_the_default(monkeypatch, caplog, knob, value, read):
    monkeypatch.setenv(knob, value)
    monkeypatch.setattr(glm53_log, "_said", set())
    caplog.set_level(logging.ERROR, logger="glm53_patches")
    monkeypatch.setattr(logging.getLogger("glm53_patches"), "propagate", True)
    monkeypatch.delenv(knob)
    default = read()
    monkeypatch.setenv(knob, value)
    assert read() == default
    assert knob in caplog.text and value in caplog.text


class _Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return STOCK(*args, **kwargs)


def test_metal_calls_the_original_untouched(monkeypatch):
    """Where Metal exists, stock's kernel check (and everything after it) runs as given."""
    monkeypatch.setenv(KNOB, "0")
    monkeypatch.setattr(attention.mx.metal, "is_available", lambda: True)
    spy = _Spy()
    fast = attention.make_sparse_prefill(spy)
    PATCH.stats.reset()
    q, k, v, indices, scale = inputs(mx.float32)
    fast(q, k, v, indices, scale, chunk_size=5, use_kernel=False)
    assert spy.calls == [((q, k, v, indices, scale), {"chunk_size": 5, "use_kernel": False})]
    assert PATCH.stats.snapshot() == {"hits": {}, "fallbacks": {"metal": 1}}


@pytest.mark.parametrize("reason", ["row too large", "shape", "index range"])
def test_steps_aside_with_stock_results(monkeypatch, reason):
    monkeypatch.setenv(KNOB, "0")
    q, k, v, indices, scale = inputs(mx.float32)
    if reason == "row too large":
        monkeypatch.setattr(attention, "MAX_ELEMENTS", 100)
    elif reason == "shape":
        indices = indices[..., :0]  # no key slots
    else:
        monkeypatch.setattr(attention, "INDEX_LIMIT", 4 * 120 - 1)
    spy = _Spy()
    fast = attention.make_sparse_prefill(spy)
    PATCH.stats.reset()
    got = fast(q, k, v, indices, scale)
    assert len(spy.calls) == 1
    if reason != "shape":
        assert_bitwise(STOCK(q, k, v, indices, scale), got, reason)
    assert PATCH.stats.snapshot() == {"hits": {}, "fallbacks": {reason: 1}}


# -- the whole tiny model --------------------------------------------------------

PROMPT_LENGTH = 150  # > index_topk (64 keys = 16 pools of 4): the indexer drops pools
DECODE_STEPS = 8


def _arrays(tree):
    """Every array in a cache (nested lists of cache objects), in a fixed order."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _arrays(item)]
    if isinstance(tree, dict):
        return [a for key in sorted(tree) for a in _arrays(tree[key])]
    if hasattr(tree, "__dict__"):
        return _arrays(vars(tree))
    return []


def _run(language_model, prompts, chunks):
    """Prefill (in `chunks` pieces), then greedy decode; logits and cache arrays."""
    from mlx_vlm.generate.ar import _make_cache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    cache = language_model.make_cache() if len(prompts) == 1 else _make_cache(language_model, padding)
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    mask = mx.array([[0] * pad + [1] * len(p) for pad, p in zip(padding, prompts)])
    logits = []
    for piece in np.array_split(np.arange(width), chunks):
        span = slice(int(piece[0]), int(piece[-1]) + 1)
        kwargs = {"attention_mask": mask[:, span]} if len(prompts) > 1 else {}
        logits.append(language_model(tokens[:, span], cache=cache, **kwargs).logits)
        mx.eval(logits[-1])
    prefill_cache = [mx.array(a) for a in _arrays(cache)]
    mx.eval(prefill_cache)
    for _ in range(DECODE_STEPS):
        token = mx.argmax(logits[-1][:, -1], axis=-1)
        logits.append(language_model(token[:, None], cache=cache).logits)
        mx.eval(logits[-1])
    return logits, prefill_cache, _arrays(cache)


# (batch, prefill calls, queries per patched chunk or None for the default budget)
MODEL_CASES = {"one-call": (1, 1, None), "two-calls-chunk-7": (1, 2, 7), "batch2-padded-chunk-5": (2, 1, 5)}


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()["text_config"]
    return build_model().language_model, config


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_prefill_and_decode_bitwise(tiny, monkeypatch, case):
    language_model, config = tiny
    batch, chunks, per_chunk = MODEL_CASES[case]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(20, 500, PROMPT_LENGTH - 31 * row).tolist() for row in range(batch)]
    stock = _run(language_model, prompts, chunks)

    monkeypatch.setenv(KNOB, "0")
    if per_chunk is not None:
        slots = config["index_topk"] + config["index_kpool"] - 1
        width = max(config["qk_nope_head_dim"], config["v_head_dim"])
        monkeypatch.setenv(BUDGET, str(batch * config["num_attention_heads"] * slots * width * per_chunk))
    PATCH.stats.reset()
    seen = []
    fast_fn = PATCH.targets["mlx_vlm.models.glm5_next.language:_sparse_prefill_attention"](STOCK)

    sdpa, sdpa_calls = mx.fast.scaled_dot_product_attention, []

    def counting(*args, **kwargs):
        sdpa_calls[-1] += 1
        return sdpa(*args, **kwargs)

    def recording(q, k, v, indices, *args, **kwargs):
        seen.append((indices, k.shape[2]))
        sdpa_calls.append(0)
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counting)
        try:
            return fast_fn(q, k, v, indices, *args, **kwargs)
        finally:
            monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", sdpa)

    monkeypatch.setattr(language, "_sparse_prefill_attention", recording)
    fast = _run(language_model, prompts, chunks)

    for i, (ref, got) in enumerate(zip(stock[0], fast[0])):
        assert_bitwise(ref, got, f"logits, call {i}")
    for name, ref_arrays, got_arrays in (("prefill", stock[1], fast[1]), ("final", stock[2], fast[2])):
        assert len(ref_arrays) == len(got_arrays) > 0
        for j, (ref, got) in enumerate(zip(ref_arrays, got_arrays)):
            assert_bitwise(ref, got, f"{name} cache array {j}")
    greedy = [tuple(mx.argmax(x[:, -1], axis=-1).tolist()) for x in stock[0][chunks:]]
    assert greedy == [tuple(mx.argmax(x[:, -1], axis=-1).tolist()) for x in fast[0][chunks:]]

    # Every DSA layer (full and shared indexer) took the patched path once per
    # prefill chunk; decode steps take the stock decode-block branch.
    dsa_layers = sum(t == "deepseek_sparse_attention" for t in config["layer_types"])
    assert PATCH.stats.snapshot() == {"hits": {"call": dsa_layers * chunks}, "fallbacks": {}}
    # Chunks of per_chunk queries (one chunk with the default budget).
    lengths = [indices.shape[1] for indices, _ in seen]
    assert sdpa_calls == [-(-n // (per_chunk or n)) for n in lengths]
    # The indexer really selected: the last query sees PROMPT_LENGTH keys but
    # at most index_topk + kpool - 1 of them are valid slots.
    indices, kv_length = seen[-1]
    valid = int(mx.sum(indices[0, -1] >= 0).item())
    assert kv_length == max(map(len, prompts)) and 0 < valid < kv_length
    assert valid <= config["index_topk"] + config["index_kpool"] - 1
    if batch == 2:  # left padding: the short row's first queries are all -1
        first = seen[0][0]
        assert mx.all(first[1, :31] == -1).item() and mx.any(first[1, 31:] >= 0).item()


def test_compile_and_grad_go_through(patched, monkeypatch):
    """mx.compile'd forward is bitwise stock; gradients flow (training uses this path).

    Gradients w.r.t. q are bitwise stock. Those w.r.t. k and v are scatter-adds
    over the gathered rows, accumulated per chunk: other chunk boundaries
    sum the same terms in another order, so they are compared with a
    tolerance (fp32 rounding), not bitwise. Inference never computes them.
    """
    monkeypatch.setenv(KNOB, "0")
    monkeypatch.setattr(attention, "MAX_ELEMENTS", 24 * 4 * 32 * 9)  # 9 queries per chunk
    q, k, v, indices, scale = inputs(mx.float32)
    ref = STOCK(q, k, v, indices, scale)
    compiled = mx.compile(lambda q, k, v: language._sparse_prefill_attention(q, k, v, indices, scale))
    assert_bitwise(ref, compiled(q, k, v), "compiled")

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, indices, scale) * mx.cos(mx.arange(32))).sum()

    stock_grads = mx.grad(loss(STOCK), argnums=(0, 1, 2))(q, k, v)
    fast_grads = mx.grad(loss(language._sparse_prefill_attention), argnums=(0, 1, 2))(q, k, v)
    assert_bitwise(stock_grads[0], fast_grads[0], "dq")
    for ref_grad, got_grad in zip(stock_grads[1:], fast_grads[1:]):
        assert mx.allclose(ref_grad, got_grad, rtol=1e-5, atol=1e-6).item()
    assert PATCH.stats.hits >= 2

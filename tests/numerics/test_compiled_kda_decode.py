"""compiled_kda_decode is bit-identical to stock KDA decode on this backend.

Exact means bit-identical: every comparison is on the raw bits (uint views),
so -0.0 vs 0.0 and NaN payloads would count as differences too.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map

from glm53_patches import registry
from glm53_patches.patches.compiled_kda_decode import PATCH, step
from glm53_patches.tiny_model import build_model, greedy_logits
from glm53_patches.exactness import same_bits
from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

NAME = "compiled_kda_decode"
HIDDEN = 128
STEPS = 64
STOCK = Glm5NextLinearAttention.__dict__["__call__"]
TARGET = "mlx_vlm.models.glm5_next.language:Glm5NextLinearAttention.__call__"


@pytest.fixture
def patched():
    """Install the patch's own factory over stock; yield the stock __call__.

    Installed directly rather than with ``registry.apply``, whose drift check
    re-parses the upstream sources (~0.8 s per apply here); the registry path
    is exercised by the revert and model-level tests below.
    """
    PATCH.stats.reset()
    Glm5NextLinearAttention.__call__ = PATCH.targets[TARGET](STOCK)
    yield STOCK
    Glm5NextLinearAttention.__call__ = STOCK
    PATCH.on_revert()


def assert_bitwise(ref, got, what):
    assert ref.shape == got.shape and ref.dtype == got.dtype, what
    assert same_bits(ref, got), what


def counts():
    snapshot = PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def make_layer(dtype=mx.float32, quantize_bits=None, seed=0):
    config = TextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        linear_attn_config={
            "head_dim": 64,  # a multiple of 32, as the Metal kernel requires
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
        },
    )
    layer = Glm5NextLinearAttention(config, layer_idx=0)
    mx.random.seed(seed)
    params = tree_map(lambda p: 0.3 * mx.random.normal(p.shape), layer.parameters())
    params["o_norm"]["weight"] = 1.0 + params["o_norm"]["weight"]
    params["dt_bias"] = params["dt_bias"] - 2.0  # gates around 0.8-0.95
    layer.update(params)
    if quantize_bits:
        nn.quantize(layer, group_size=64, bits=quantize_bits)
    if dtype != mx.float32:
        layer.set_dtype(dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def prefilled_pair(layer, batch, left_padding, dtype, prompt_length=5):
    """Two caches prefilled identically by stock code (prefill is L > 1)."""
    prompt = mx.random.normal((batch, prompt_length, HIDDEN)).astype(dtype)
    caches = []
    for _ in range(2):
        cache = ArraysCache(2, left_padding=left_padding)
        STOCK(layer, prompt, cache.make_mask(prompt_length), cache)
        caches.append(cache)
    assert_bitwise(caches[0][1], caches[1][1], "prefill state")
    return caches


def decode_and_compare(layer, caches, dtype, steps=STEPS):
    stock_cache, fast_cache = caches
    batch = stock_cache[0].shape[0]
    for i in range(steps):
        x = mx.random.normal((batch, 1, HIDDEN)).astype(dtype)
        ref = STOCK(layer, x, stock_cache.make_mask(1), stock_cache)
        got = layer(x, fast_cache.make_mask(1), fast_cache)
        assert_bitwise(ref, got, f"output, step {i}")
        assert_bitwise(stock_cache[0], fast_cache[0], f"conv window, step {i}")
        assert_bitwise(stock_cache[1], fast_cache[1], f"recurrent state, step {i}")


# -- layer level ---------------------------------------------------------------

DTYPES = {
    "fp32": (mx.float32, None),
    "q4": (mx.float32, 4),
    "bf16": (mx.bfloat16, None),
    "bf16-q4": (mx.bfloat16, 4),
}
# Batch 3, left-padded as the batch generator does it. Row 2's padding (7)
# outlasts the 5-token prefill, so its mask is False for the first two decode
# steps: the masked "keep the old state" path runs too.
BATCHES = {"batch1": (1, None), "batch3-masked": (3, [0, 2, 7])}


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_layer_decode_is_bitwise_stock(patched, dtype_name, batch_name):
    dtype, quantize_bits = DTYPES[dtype_name]
    batch, left_padding = BATCHES[batch_name]
    layer = make_layer(dtype, quantize_bits)
    caches = prefilled_pair(layer, batch, left_padding, dtype)
    if left_padding:
        assert not caches[1].make_mask(1).all().item()  # the masked path is exercised
    decode_and_compare(layer, caches, dtype)
    if left_padding:  # advance(1) per step, as stock
        assert caches[0].left_padding.tolist() == caches[1].left_padding.tolist()
    hits, fallbacks = counts()
    assert hits == {"call": STEPS, "trace": 1}, hits  # one trace serves every step
    assert fallbacks == {}


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_masked_rows_keep_their_state(patched, dtype_name):
    """Masks with False rows *after* real tokens (left padding only masks rows
    whose state is still zero, where keeping and updating agree)."""
    dtype, _ = DTYPES[dtype_name]
    layer = make_layer(dtype)
    stock_cache, fast_cache = prefilled_pair(layer, 3, None, dtype)
    pattern = mx.random.bernoulli(0.6, (16, 3, 1), key=mx.random.key(3))
    assert not pattern.all().item() and pattern.any().item()
    for i in range(16):
        x = mx.random.normal((3, 1, HIDDEN)).astype(dtype)
        ref = STOCK(layer, x, pattern[i], stock_cache)
        got = layer(x, pattern[i], fast_cache)
        assert_bitwise(ref, got, f"output, step {i}")
        assert_bitwise(stock_cache[0], fast_cache[0], f"conv window, step {i}")
        assert_bitwise(stock_cache[1], fast_cache[1], f"recurrent state, step {i}")
    assert counts()[0] == {"call": 16, "trace": 1}


def test_weights_are_inputs_not_captured(patched):
    """Changing a layer's weights in place is seen at once, without a retrace."""
    layer = make_layer()
    caches = prefilled_pair(layer, 1, None, mx.float32)
    decode_and_compare(layer, caches, mx.float32, steps=4)
    layer.update(tree_map(lambda p: p * 1.5, layer.parameters()))
    decode_and_compare(layer, caches, mx.float32, steps=4)
    assert counts()[0] == {"call": 8, "trace": 1}


def test_one_trace_per_shape_and_mask_form(patched):
    layer = make_layer()
    for batch, padding in [(1, None), (2, None), (2, [0, 1]), (1, None), (2, [1, 0])]:
        decode_and_compare(layer, prefilled_pair(layer, batch, padding, mx.float32), mx.float32, steps=2)
    # (batch 1), (batch 2), (batch 2, mask): three traces; repeats reuse them.
    assert counts()[0] == {"call": 10, "trace": 3}
    assert step.compiled_count() == 2  # mask and no mask


# -- steps aside -----------------------------------------------------------------


PREFILL = mx.random.normal((1, 3, HIDDEN), key=mx.random.key(7))


def _prefill(layer, cache):
    STOCK(layer, PREFILL, None, cache)


def _set_lengths(layer, cache):
    _prefill(layer, cache)
    cache.lengths = mx.array([7])


def _speculate_short(layer, cache):
    _prefill(layer, cache)
    cache.start_speculation(2)  # a history of 2 tokens, then a 3-token block


ASIDE = {
    # reason: (prepare the cache, input length, mask)
    "length": (_prefill, 3, None),  # a prefill chunk (not speculating)
    "no state": (lambda layer, cache: None, 1, None),
    "history capacity": (_speculate_short, 3, None),
    "ragged": (_set_lengths, 1, None),
    "mask": (_prefill, 1, mx.ones((1, 1), dtype=mx.float32)),  # not the bool (B, 1) form
}


@pytest.mark.parametrize("reason", ASIDE)
def test_steps_aside_with_stock_results(patched, reason):
    prepare, length, mask = ASIDE[reason]
    layer = make_layer()
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        prepare(layer, cache)
    x = mx.random.normal((1, length, HIDDEN), key=mx.random.key(8))
    if reason == "history capacity":  # stock refuses the block; so does the patched layer, through stock
        for cache in caches:
            with pytest.raises(ValueError, match="history capacity"):
                layer(x, mask, cache)
        assert counts() == ({}, {reason: 2})
        return
    ref = STOCK(layer, x, mask, caches[0])
    got = layer(x, mask, caches[1])
    assert_bitwise(ref, got, "output")
    for i in range(2):
        assert_bitwise(caches[0][i], caches[1][i], f"cache[{i}]")
    assert counts() == ({}, {reason: 1})


# -- speculative verify blocks -----------------------------------------------------


def records(cache):
    """The arrays a speculating cache holds for rollback, in a fixed order (stock's own structure)."""
    found = []
    for index, record in sorted(cache._speculation["records"].items()):
        found += [(f"record {index} {record[0]} {i}", v) for i, v in enumerate(record[1:]) if isinstance(v, mx.array)]
    return found


def verify_round(layer, caches, dtype, length, keep):
    """One verify block of ``length`` tokens on both caches, then both keep ``keep`` of them per row
    (None: the block is aborted, as when a request is cancelled mid-round)."""
    batch = caches[0][0].shape[0]
    x = mx.random.normal((batch, length, HIDDEN)).astype(dtype)
    for cache in caches:
        cache.start_speculation(length)
    ref = STOCK(layer, x, caches[0].make_mask(length), caches[0])
    got = layer(x, caches[1].make_mask(length), caches[1])
    assert_bitwise(ref, got, f"verify output, L={length}")
    recorded = [records(cache) for cache in caches]
    assert [n for n, _ in recorded[0]] == [n for n, _ in recorded[1]] and len(recorded[0]) >= 2
    for (name, a), (_, b) in zip(*recorded):
        assert_bitwise(a, b, f"{name}, L={length}")
    for cache in caches:
        cache.abort_speculation() if keep is None else cache.commit_speculation(keep)
    assert_bitwise(caches[0][0], caches[1][0], f"conv window after L={length}, keep {keep}")
    assert_bitwise(caches[0][1], caches[1][1], f"recurrent state after L={length}, keep {keep}")
    if caches[0].left_padding is not None:
        assert caches[0].left_padding.tolist() == caches[1].left_padding.tolist()


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_verify_blocks_are_bitwise_stock(patched, dtype_name, batch_name):
    """Blocks of 1 to 8 tokens, each kept in part (per row in a batch), whole, not at all, or aborted,
    with plain decode steps between: outputs, recorded history and caches after rollback match stock."""
    dtype, quantize_bits = DTYPES[dtype_name]
    batch, left_padding = BATCHES[batch_name]
    layer = make_layer(dtype, quantize_bits)
    caches = prefilled_pair(layer, batch, left_padding, dtype)
    rng = np.random.default_rng(0)
    lengths = [2, 3, 4, 5, 6, 7, 8, 1, 3, 2, 8, 4]
    for i, length in enumerate(lengths):
        keep = [int(k) for k in rng.integers(0, length + 1, batch)]  # ragged acceptance in a batch
        keep = {3: None, 5: [0] * batch, 6: [length] * batch}.get(i, keep)
        verify_round(layer, caches, dtype, length, keep)
        decode_and_compare(layer, caches, dtype, steps=1)
    hits, fallbacks = counts()
    assert hits["verify"] == len(lengths) and hits["call"] == len(lengths), hits
    assert fallbacks == {}


def test_steps_aside_in_training_and_without_cache(patched):
    layer = make_layer()
    x = mx.random.normal((1, 1, HIDDEN), key=mx.random.key(8))
    assert_bitwise(STOCK(layer, x, None, None), layer(x, None, None), "no cache")
    layer.train()
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        _prefill(layer, cache)
    assert_bitwise(STOCK(layer, x, None, caches[0]), layer(x, None, caches[1]), "training")
    assert_bitwise(caches[0][1], caches[1][1], "training state")
    assert counts() == ({}, {"no cache": 1, "training": 1})


# -- revert ------------------------------------------------------------------------


def test_revert_drops_every_compiled_function():
    PATCH.stats.reset()
    registry.apply([NAME], strict=True)
    layer = make_layer()
    caches = prefilled_pair(layer, 2, [1, 0], mx.float32)
    decode_and_compare(layer, caches, mx.float32, steps=1)
    assert counts()[0] == {"call": 1, "trace": 1}
    assert step.compiled_count() == 1 and step._CONFIGS
    registry.revert([NAME])
    assert step.compiled_count() == 0
    assert not step._CONFIGS and step._scales.cache_info().currsize == 0
    assert Glm5NextLinearAttention.__dict__["__call__"] is STOCK


# -- model level -----------------------------------------------------------------

PROMPT = [5, 17, 33, 101, 7, 250, 3]
BATCH_PROMPTS = [[5, 17, 33, 101, 7, 250, 3], [9, 8, 7], [44, 45, 46, 47, 48]]


def greedy_batch(language_model, prompts, steps=STEPS):
    """Greedy decoding; left-padded batches use the batch generator's caches."""
    from mlx_vlm.generate.ar import _make_cache

    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    if len(prompts) == 1:
        cache = language_model.make_cache()
    else:
        cache = _make_cache(language_model, padding)  # ArraysCache gets left_padding
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    return greedy_logits(language_model, tokens, steps, cache=cache)


MODEL_CASES = {"fp32": (None, [PROMPT]), "q4": (4, [PROMPT]), "fp32-batch3": (None, BATCH_PROMPTS)}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_greedy_logits_bitwise(case):
    quantize_bits, prompts = MODEL_CASES[case]
    model = build_model(quantize_bits=quantize_bits)
    language_model = model.language_model
    kda_layers = sum(layer.is_linear for layer in language_model.layers)
    stock = greedy_batch(language_model, prompts)
    PATCH.stats.reset()
    registry.apply([NAME], strict=True)
    try:
        fast = greedy_batch(language_model, prompts)
    finally:
        registry.revert([NAME])
    for i, (ref, got) in enumerate(zip(stock, fast)):
        assert_bitwise(ref, got, f"logits, token {i}")
    assert len({tuple(mx.argmax(x, axis=-1).tolist()) for x in stock}) > 8  # not stuck on one token
    hits, fallbacks = counts()
    # Every KDA layer decodes STEPS tokens through one shared trace.
    assert hits == {"call": kda_layers * STEPS, "trace": 1}, hits
    assert fallbacks == {"length": kda_layers}  # prefill only


def test_batch_generate_gives_identical_text(tiny_fp32_dir):
    from mlx_vlm import load
    from mlx_vlm.generate.ar import batch_generate

    model, processor = load(str(tiny_fp32_dir))
    prompts = ["The quick brown fox jumps", "Hi", "What is the capital of France? Paris is"]
    stock = batch_generate(model, processor, prompts=prompts, max_tokens=STEPS)
    PATCH.stats.reset()
    registry.apply([NAME], strict=True)
    try:
        fast = batch_generate(model, processor, prompts=prompts, max_tokens=STEPS)
    finally:
        registry.revert([NAME])
    assert fast.texts == stock.texts
    assert all(len(text) > 0 for text in stock.texts)
    kda_layers = sum(layer.is_linear for layer in model.language_model.layers)
    hits, _ = counts()
    # Batch decode (B = 3, left-padding masks) ran fast in every KDA layer;
    # a new batch size (a row finishing early) would add a trace.
    assert hits.get("call", 0) >= kda_layers * (STEPS // 2) and hits.get("trace", 0) >= 1, hits


# -- the backend assumption behind calling mx.sigmoid inside the trace -------------


def test_backend_compiles_sigmoid_exactly_like_eager():
    """Stock runs mx.sigmoid eagerly (beta, output gate); the trace compiles it.

    True for every bf16/fp16 value and 4M fp32 values on this backend. A
    rewrite such as 1 / (1 + exp(-|x|)) would not be (see PATCH.md).
    """
    every_half = mx.array(np.arange(1 << 16, dtype=np.uint16))
    key = mx.random.key(0)
    wide = mx.concatenate([s * mx.random.normal((1 << 20,), key=key) for s in (0.1, 1.0, 10.0, 100.0)])
    for x in (every_half.view(mx.bfloat16), every_half.view(mx.float16), wide):
        assert_bitwise(mx.sigmoid(x), mx.compile(mx.sigmoid)(x), str(x.dtype))


def test_verify_counts_cases_where_stock_differs_from_itself_as_inconclusive(monkeypatch):
    """On CUDA stock was not repeatable in one case: such a case neither passes nor fails."""
    from glm53_patches.patches.compiled_kda_decode.checks import verify as check

    real = check.check_case

    def flaky(stock, fast, dtype, bits, padding, seed, blocks):
        if bits == 4 and padding:
            return {"worst": 0.5, "control": "stock run twice differs in output at step 0", "patch": "output at step 0"}
        return real(stock, fast, dtype, bits, padding, seed, blocks=blocks)

    monkeypatch.setattr(check, "check_case", flaky)
    result = check.verify()
    assert result["exact"] and result["max_abs_diff"] == 0.0
    assert "4 case(s) inconclusive" in result["detail"]  # 4-bit batch 3 at decode and in verify blocks
    monkeypatch.setattr(check, "check_case", lambda *a, **k: {"worst": 0.0, "control": "differs"})
    assert not check.verify()["exact"]  # nothing comparable: not exact
    monkeypatch.setattr(check, "check_case", lambda *a, **k: {"worst": 0.25, "patch": "state at step 3"})
    result = check.verify()
    assert not result["exact"] and result["max_abs_diff"] == 0.25 and "16 case(s) differ" in result["detail"]

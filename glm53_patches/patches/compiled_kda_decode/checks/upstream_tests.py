"""glm5_next's compiled KDA decode step is bit-identical to the stock decode.

MLX_VLM_GLM5_COMPILED_KDA_DECODE=1 sends single-token decode of
Glm5NextLinearAttention through one mx.compile'd function. These tests turn
it on per test, compare outputs and caches with the stock code on raw bits,
and count the calls that the compiled path served.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map, tree_map_with_path

from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.glm5_next import compiled_kda_decode
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention, LanguageModel

HIDDEN = 128
STEPS = 16
KDA = {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}


@pytest.fixture
def served(monkeypatch):
    """Turn the compiled path on; yield the list of its results (True = served)."""
    calls = []
    decode_step = compiled_kda_decode.decode_step

    def counted(*args):
        output = decode_step(*args)
        calls.append(output is not None)
        return output

    monkeypatch.setattr(compiled_kda_decode, "decode_step", counted)
    monkeypatch.setattr(compiled_kda_decode, "ENABLED", True)
    yield calls
    compiled_kda_decode.clear()


def stock(fn, *args, **kwargs):
    """Call a layer or model (``fn``) with the compiled path off."""
    enabled = compiled_kda_decode.ENABLED
    compiled_kda_decode.ENABLED = False
    try:
        return fn(*args, **kwargs)
    finally:
        compiled_kda_decode.ENABLED = enabled


def assert_bitwise(expected, actual, what):
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, what
    view = {4: mx.uint32, 2: mx.uint16}[expected.itemsize]
    assert mx.array_equal(expected.view(view), actual.view(view)).item(), what


def init(path, p):
    """Random weights that keep activations O(1) and KDA gates around 0.8-0.95."""
    if path.endswith("A_log"):
        return mx.random.uniform(0.0, math.log(4.0), p.shape)
    if path.endswith("dt_bias"):
        return mx.random.uniform(-4.0, -1.0, p.shape)
    if "norm" in path and path.endswith("weight"):
        return 1.0 + 0.1 * mx.random.normal(p.shape)
    if path.endswith("bias"):
        return mx.zeros(p.shape)
    return mx.random.normal(p.shape) / math.sqrt(p.shape[-1])


def make_layer(dtype, bits, seed=0):
    config = TextConfig(hidden_size=HIDDEN, num_hidden_layers=4, linear_attn_config=KDA)
    layer = Glm5NextLinearAttention(config)
    mx.random.seed(seed)
    layer.update(tree_map_with_path(init, layer.parameters()))
    if bits:
        nn.quantize(layer, group_size=64, bits=bits)
    if dtype != mx.float32:
        layer.set_dtype(dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def prefilled(layer, batch, left_padding, dtype, length=5):
    """Two caches prefilled identically by the stock code."""
    prompt = mx.random.normal((batch, length, HIDDEN)).astype(dtype)
    caches = [ArraysCache(2, left_padding=left_padding) for _ in range(2)]
    for cache in caches:
        stock(layer, prompt, cache.make_mask(length), cache)
    return caches


def compare_step(layer, x, masks, caches, what):
    expected = stock(layer, x, masks[0], caches[0])
    actual = layer(x, masks[1], caches[1])
    assert_bitwise(expected, actual, f"output, {what}")
    assert_bitwise(caches[0][0], caches[1][0], f"conv window, {what}")
    assert_bitwise(caches[0][1], caches[1][1], f"recurrent state, {what}")


CASES = {
    # Batch 3 is left-padded as the batch generator does it; row 2's padding
    # outlasts the prefill, so its mask is False in the first decode steps.
    "fp32": (mx.float32, None, 1, None),
    "fp32-4bit-batch3": (mx.float32, 4, 3, [0, 2, 7]),
    "bf16-batch3": (mx.bfloat16, None, 3, [0, 2, 7]),
    "bf16-4bit": (mx.bfloat16, 4, 1, None),
}


@pytest.mark.parametrize("case", CASES)
def test_decode_matches_stock_bitwise(served, case):
    dtype, bits, batch, left_padding = CASES[case]
    layer = make_layer(dtype, bits)
    caches = prefilled(layer, batch, left_padding, dtype)
    for step in range(STEPS):
        x = mx.random.normal((batch, 1, HIDDEN)).astype(dtype)
        masks = [cache.make_mask(1) for cache in caches]
        compare_step(layer, x, masks, caches, f"step {step}")
    if left_padding:
        assert caches[0].left_padding.tolist() == caches[1].left_padding.tolist()
    assert served == [True] * STEPS
    assert compiled_kda_decode.compiled_count() == 1


def test_masked_rows_keep_their_state(served):
    """False mask entries after real tokens must leave that row's state alone."""
    layer = make_layer(mx.float32, None)
    caches = prefilled(layer, 3, None, mx.float32)
    pattern = mx.random.bernoulli(0.6, (STEPS, 3, 1), key=mx.random.key(3))
    assert not pattern.all().item() and pattern.any().item()
    for step in range(STEPS):
        x = mx.random.normal((3, 1, HIDDEN))
        compare_step(layer, x, [pattern[step]] * 2, caches, f"step {step}")
    assert served == [True] * STEPS


@pytest.mark.parametrize("case", CASES)
def test_verify_blocks_record_the_stock_history(served, case):
    """Speculative verify blocks of 2 to 8 tokens: outputs, and the caches after each commit of an
    accepted prefix (per row in a batch) or an abort, match the stock code bitwise."""
    dtype, bits, batch, left_padding = CASES[case]
    layer = make_layer(dtype, bits)
    caches = prefilled(layer, batch, left_padding, dtype)
    keeps = mx.random.randint(0, 9, (7, batch), key=mx.random.key(5)).tolist()
    for block, keep in zip(range(2, 9), keeps):
        x = mx.random.normal((batch, block, HIDDEN)).astype(dtype)
        for cache in caches:
            cache.start_speculation(block)
        masks = [cache.make_mask(block) for cache in caches]
        assert_bitwise(stock(layer, x, masks[0], caches[0]), layer(x, masks[1], caches[1]), f"L={block}")
        for cache in caches:
            if block == 5:
                cache.abort_speculation()
            else:
                cache.commit_speculation([min(k, block) for k in keep])
        for i in range(2):
            assert_bitwise(caches[0][i], caches[1][i], f"cache[{i}] after L={block}")
    assert served == [True] * 7


def test_weights_are_inputs_not_captured(served):
    """A weight update is seen at the next call, without a new compiled function."""
    layer = make_layer(mx.float32, None)
    caches = prefilled(layer, 1, None, mx.float32)
    for step in range(4):
        if step == 2:
            layer.update(tree_map(lambda p: 1.5 * p, layer.parameters()))
        compare_step(layer, mx.random.normal((1, 1, HIDDEN)), [None, None], caches, f"step {step}")
    assert served == [True] * 4
    assert compiled_kda_decode.compiled_count() == 1


def _fresh(layer, cache):
    pass


def _prefill(layer, cache):
    stock(layer, mx.random.normal((1, 3, HIDDEN), key=mx.random.key(7)), None, cache)


def _ragged(layer, cache):
    _prefill(layer, cache)
    cache.lengths = mx.array([7])


STOCK_CASES = {
    # name: (prepare the cache, tokens, mask, cache or not, training)
    "prefill": (_prefill, 3, None, True, False),
    "no state yet": (_fresh, 1, None, True, False),
    "ragged lengths": (_ragged, 1, None, True, False),
    "float mask": (_prefill, 1, mx.ones((1, 1)), True, False),
    "no cache": (_fresh, 1, None, False, False),
    "training": (_prefill, 1, None, True, True),
}


@pytest.mark.parametrize("case", STOCK_CASES)
def test_other_calls_run_the_stock_code(served, case):
    prepare, length, mask, with_cache, training = STOCK_CASES[case]
    layer = make_layer(mx.float32, None)
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        prepare(layer, cache)
    if training:
        layer.train()
    x = mx.random.normal((1, length, HIDDEN), key=mx.random.key(8))
    expected = stock(layer, x, mask, caches[0] if with_cache else None)
    actual = layer(x, mask, caches[1] if with_cache else None)
    assert_bitwise(expected, actual, "output")
    for i in range(2):
        if caches[0][i] is not None:
            assert_bitwise(caches[0][i], caches[1][i], f"cache[{i}]")
    assert served == [False]


def small_model():
    linear, sparse = "linear_attention", "deepseek_sparse_attention"
    config = TextConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        layer_types=[linear, linear, sparse, linear],
        index_topk_pattern="FFFF",
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=0,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
        index_kpool=4,
        linear_attn_config=KDA,
    )
    model = LanguageModel(config)
    mx.random.seed(1)
    model.update(tree_map_with_path(init, model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


def greedy_logits(model, prompt, steps):
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache).logits[:, -1]
    out = []
    for _ in range(steps):
        mx.eval(logits)
        out.append(logits)
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache).logits[:, -1]
    return out


def test_model_greedy_logits_bitwise(served):
    model = small_model()
    prompt = [5, 17, 33, 101, 7, 250, 3]
    expected = stock(greedy_logits, model, prompt, STEPS)
    actual = greedy_logits(model, prompt, STEPS)
    for step, (e, a) in enumerate(zip(expected, actual)):
        assert_bitwise(e, a, f"logits, token {step}")
    kda_layers = sum(layer.is_linear for layer in model.layers)
    # Prefill runs the stock code once per KDA layer; every decode step is served.
    assert served.count(False) == kda_layers
    assert served.count(True) == kda_layers * STEPS


def test_backend_compiles_sigmoid_like_eager():
    """The compiled step calls mx.sigmoid where stock calls it eagerly."""
    every_half = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16)
    wide = mx.concatenate(
        [s * mx.random.normal((1 << 18,), key=mx.random.key(0)) for s in (0.1, 1.0, 10.0, 100.0)]
    )
    for x in (every_half.view(mx.bfloat16), every_half.view(mx.float16), wide):
        assert_bitwise(mx.sigmoid(x), mx.compile(mx.sigmoid)(x), str(x.dtype))

"""dsa_decode: the indexer's decode selection and the model's outputs are bit-identical to stock.

Every expected value comes from running stock mlx-vlm in the same process.
The tiny model's indexers select 16 pools of 4 keys (64 keys) and always add
the tail, so contexts past 64 tokens make them really choose.
"""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import glm53_patches
from glm53_patches.patches.dsa_decode import PATCH
from glm53_patches.tiny_model import build_model, greedy_logits
from glm53_patches.exactness import same_bits
from mlx_vlm.models.glm5_next.language import Glm5NextIndexer

NAME = "dsa_decode"
STOCK = Glm5NextIndexer.__dict__["__call__"]
PROMPT = [(7 * i + 3) % 500 for i in range(40)]  # 40 tokens: decode crosses the 64-key selection width
STEPS = 72
CONTEXTS = 102


@pytest.fixture(scope="module")
def fp32_model():
    return build_model(seed=0)


@pytest.fixture(scope="module")
def q4_model():
    return build_model(quantize_bits=4, seed=1)


@pytest.fixture
def enabled():
    PATCH.stats.reset()
    state = glm53_patches.enable([NAME], strict=True)
    assert state[NAME]["state"] == "applied", state[NAME]
    yield
    glm53_patches.disable([NAME])
    assert Glm5NextIndexer.__dict__["__call__"] is STOCK


def assert_same(expected, actual, what):
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, what
    assert same_bits(expected, actual), what


def cache_state(cache):
    """Every array the caches hold, by path, trimmed to the filled part."""
    out = {}
    for i, layer_cache in enumerate(cache):
        for path, value in tree_flatten(layer_cache.state):
            if isinstance(value, mx.array):
                out[f"{i}.{path}"] = value
    return out


def left_padded(language_model, prompts):
    from mlx_vlm.generate.ar import _make_cache

    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    return tokens, _make_cache(language_model, padding)


def dsa_layers(language_model):
    return [layer for layer in language_model.model.layers if not layer.is_linear]


def full_indexer_layers(language_model):
    return [layer for layer in language_model.model.layers
            if not layer.is_linear and layer.self_attn.indexer is not None]


@pytest.mark.parametrize("which", ["fp32_model", "q4_model"])
def test_greedy_decode_bit_identical_batch_1(request, which):
    language_model = request.getfixturevalue(which).language_model
    prompt = mx.array([PROMPT])
    stock_cache = language_model.make_cache()
    expected = greedy_logits(language_model, prompt, STEPS, cache=stock_cache)

    request.getfixturevalue("enabled")
    cache = language_model.make_cache()
    actual = greedy_logits(language_model, prompt, STEPS, cache=cache)
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert_same(a, b, f"logits at step {step}")
    stock_state, state = cache_state(stock_cache), cache_state(cache)
    assert stock_state.keys() == state.keys()
    for path in stock_state:
        assert_same(stock_state[path], state[path], f"cache {path}")
    # Every decode step of every DSA layer took the fast paths (the indexer only
    # where the layer has its own); the prefill did not.
    indexers, dsa = len(full_indexer_layers(language_model)), len(dsa_layers(language_model))
    assert PATCH.stats.snapshot() == {"hits": {"indexer": STEPS * indexers, "attend": STEPS * dsa},
                                      "fallbacks": {"not decode": indexers + dsa}}


def test_batched_left_padding_bit_identical(fp32_model, request):
    language_model = fp32_model.language_model
    prompts = [PROMPT + PROMPT[:30], PROMPT[5:], PROMPT[:9]]  # 70, 35 and 9 tokens
    tokens, cache = left_padded(language_model, prompts)
    expected = greedy_logits(language_model, tokens, STEPS, cache=cache)

    request.getfixturevalue("enabled")
    tokens, cache = left_padded(language_model, prompts)
    actual = greedy_logits(language_model, tokens, STEPS, cache=cache)
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert_same(a, b, f"logits at step {step}")
    hits = PATCH.stats.snapshot()["hits"]
    assert hits["indexer"] == STEPS * len(full_indexer_layers(language_model))
    assert hits["attend"] == STEPS * len(dsa_layers(language_model))


def test_resumed_cache_bit_identical(fp32_model, request):
    """A cache filled by two prefill calls (a resumed conversation) then decoded."""
    language_model = fp32_model.language_model
    first, second = mx.array([PROMPT * 2]), mx.array([PROMPT[:13]])

    def resumed():
        cache = language_model.make_cache()
        mx.eval(language_model(first, cache=cache).logits)
        return greedy_logits(language_model, second, 24, cache=cache)

    expected = resumed()
    request.getfixturevalue("enabled")
    actual = resumed()
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert_same(a, b, f"logits at step {step}")


def select_both(attention, fast, caches, x, padding_mask):
    """Stock's indexer and ``fast`` on ``x`` (``[2, L, hidden]``), each with its own layer cache, the
    latent cache advanced by L as the attention would: ``[stock top-k, fast top-k]``."""
    length = x.shape[1]
    q_resid = attention.q_a_layernorm(mx.split(attention.qkv_a_proj(x), (attention.q_lora_rank,), axis=-1)[0])
    got = []
    for fn, cache in ((STOCK, caches[0]), (fast, caches[1])):
        offset = cache[0].offset
        cache[0].update_and_fetch(mx.zeros((2, 1, length, 1)), mx.zeros((2, 1, length, 0)))
        got.append(fn(attention.indexer, x, q_resid, padding_mask, cache[1], cache[2], offset))
    return got


def test_selection_equals_stock_at_every_context(fp32_model):
    """The indexer's own output, compared at each context from 1 to CONTEXTS keys: the pool
    boundaries, the tail, the switch to real selection and the compiled expansion."""
    from glm53_patches.patches.dsa_decode.decode import make_call

    attention = full_indexer_layers(fp32_model.language_model)[0].self_attn
    fast = make_call(STOCK)
    caches = [fp32_model.language_model.make_cache()[2] for _ in range(2)]  # layer 2: full indexer
    hidden = attention.qkv_a_proj.weight.shape[1]
    for step, key in enumerate(mx.random.split(mx.random.key(5), CONTEXTS)):
        x = mx.random.normal((2, 1, hidden), key=key)
        # Row 1 skips some tokens (a padded step): its key validity gets holes,
        # which the visible count and the tail's validity must respect.
        padding_mask = mx.array([[True], [step % 9 != 4]])
        got = select_both(attention, fast, caches, x, padding_mask)
        assert_same(got[0], got[1], f"top-k at context {step + 1}")
    # Really selecting at the end: 16 whole pools of 4 plus the partial pool's keys.
    assert (got[0] >= 0).sum(axis=-1).tolist()[0] == [64 + CONTEXTS % 4]


def test_block_selection_equals_stock_at_every_context(fp32_model):
    """The indexer's output for short blocks (speculative verify blocks, 2 to 8 positions), compared as
    the context grows block by block past the switch to real selection: each position's candidate
    pools, visible count and tail, with holes in the key validity and padded positions."""
    from glm53_patches.patches.dsa_decode.decode import make_call

    attention = full_indexer_layers(fp32_model.language_model)[0].self_attn
    fast = make_call(STOCK)
    caches = [fp32_model.language_model.make_cache()[2] for _ in range(2)]
    hidden = attention.qkv_a_proj.weight.shape[1]
    context, blocks = 0, 0
    PATCH.stats.reset()
    for step, key in enumerate(mx.random.split(mx.random.key(7), 40)):
        length = 1 + step % 8
        x = mx.random.normal((2, length, hidden), key=key)
        # Row 1 has holes: some positions are padding, within and across blocks.
        padding_mask = mx.array([[True] * length, [(step + i) % 5 != 2 for i in range(length)]])
        got = select_both(attention, fast, caches, x, padding_mask)
        context += length
        blocks += length > 1
        assert_same(got[0], got[1], f"top-k of a {length}-token block at context {context}")
    # Really selecting at the end: the last position of row 0 (no holes) sees whole pools up to the
    # top-k width, plus the partial pool's keys.
    indexer = attention.indexer
    assert (got[0][0, -1] >= 0).sum().item() == indexer.index_topk + context % indexer.index_kpool
    assert PATCH.stats.snapshot()["hits"]["indexer block"] == blocks


def test_composes_with_indexer_fp32(q4_model):
    """dsa_decode scores pools through the module's _score_index_keys, so indexer_fp32's
    fused score serves its decode steps (bit-identical to stock on the CPU, where it compiles)."""
    from glm53_patches import registry

    language_model = q4_model.language_model
    prompt = mx.array([PROMPT + PROMPT[:32]])  # 72 tokens: real selection from the first decode step
    expected = greedy_logits(language_model, prompt, 16)
    fp32 = registry.available()["indexer_fp32"]
    fp32.stats.reset()
    PATCH.stats.reset()
    state = glm53_patches.enable([NAME, "indexer_fp32"], strict=True)
    try:
        assert all(state[n]["state"] == "applied" for n in (NAME, "indexer_fp32")), state
        actual = greedy_logits(language_model, prompt, 16)
    finally:
        glm53_patches.disable([NAME, "indexer_fp32"])
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert_same(a, b, f"logits at step {step}")
    indexers = len(full_indexer_layers(language_model))
    assert PATCH.stats.snapshot()["hits"]["indexer"] == 16 * indexers
    # Its fused score ran for the prefill (through _exact_pool_select) and every decode step.
    assert sum(fp32.stats.snapshot()["hits"].values()) == 17 * indexers


def test_selection_kernel_reference_equals_stock(fp32_model, monkeypatch):
    """``host_check.reference`` (what the selection kernel's body is checked against) is stock's selection.

    The kernel runs on GPUs only; its body runs on the host in
    ``dsa_decode/host_check.py`` against this numpy reference. Here the
    reference is fed what ``_kernel_topk`` would hand the kernel (scores as
    stock computes them, the key-validity row, the pool limit, each
    position's validity) for decode tokens at every context from 1 to
    CONTEXTS keys, then for blocks of 2 to 8 tokens as the context grows
    past the switch to real selection, and must give stock's top-k.
    """
    import numpy as np

    from glm53_patches.patches.dsa_decode import decode
    from glm53_patches.patches.dsa_decode.checks.host_check import reference

    seen = []

    def recorder(self, x, q_resid, key_valid, query_valid, pool_keys, pool_cache, select_k, tail_width):
        batch, pools = pool_keys.shape[:2]
        q, weights = self._project_queries(x, q_resid)
        scores = decode._lang._score_index_keys(q, pool_keys, weights, self.softmax_scale)
        limit = pool_cache.offset if isinstance(pool_cache.offset, mx.array) else mx.full((batch,), pools)
        seen.append([np.array(a) for a in (scores, key_valid, limit, query_valid)]
                    + [select_k, self.index_kpool, self.index_topk, tail_width])
        return None  # the compiled path answers

    monkeypatch.setattr(decode, "_kernel_topk", recorder)
    attention = full_indexer_layers(fp32_model.language_model)[0].self_attn
    fast = decode.make_call(STOCK)
    hidden = attention.qkv_a_proj.weight.shape[1]
    for blocks, steps in ((False, CONTEXTS), (True, 40)):
        caches = [fp32_model.language_model.make_cache()[2] for _ in range(2)]
        compared = context = 0
        for step, key in enumerate(mx.random.split(mx.random.key(6), steps)):
            length = 2 + step % 7 if blocks else 1
            x = mx.random.normal((2, length, hidden), key=key)
            # holes, and padded positions
            padding_mask = mx.array([[(step + i) % 7 != 3 for i in range(length)],
                                     [(step + i) % 9 != 4 for i in range(length)]])
            outputs = [np.array(topk) for topk in select_both(attention, fast, caches, x, padding_mask)]
            context += length
            if seen and seen[-1][1].shape[1] == context:  # this call reached the kernel's hand-off
                assert np.array_equal(reference(*seen[-1]), outputs[0]), f"context {context}"
                compared += 1
        assert compared >= steps - 4  # every call with at least one pool
        assert not blocks or (outputs[0][0] >= 0).sum(axis=-1).max() > attention.indexer.index_topk  # selecting


def test_selection_kernel_coverage():
    from glm53_patches.patches.dsa_decode.select_kernel import MAX_POOLS, unsupported

    assert unsupported(256, 4096, backend="cuda") is None
    assert unsupported(256, 4096, backend=None) == "no GPU backend"
    assert unsupported(256, 4096, mx.bfloat16, backend="cuda") == "score dtype"
    assert unsupported(0, 4096, backend="cuda") == "empty"
    assert unsupported(256, 0, backend="cuda") == "empty"
    assert unsupported(MAX_POOLS, 16 * MAX_POOLS, backend="cuda") is None
    assert unsupported(MAX_POOLS + 1, 16 * MAX_POOLS + 16, backend="cuda") is not None

"""Speculative verify blocks through the whole tiny model: with every exact decode patch on, the logits
of each block, the caches after each rollback and the decode steps between are bit-identical to stock.

The blocks are what mlx-vlm's MTP loop runs on the target: ``start_speculative_cache`` over the model's
caches, one forward of the bonus token and the drafts, then a commit of the accepted prefix per row.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_layer_decode import DECODE, PROMPT, assert_same, cache_state, left_padded_batch

import glm53_patches
from glm53_patches.patches import compiled_kda_decode
from glm53_patches.tiny_model import build_model
from mlx_vlm.speculative.cache_state import start_speculative_cache

ROUNDS = 10


@pytest.fixture(scope="module", params=["fp32", "q4"])
def language_model(request):
    return build_model(quantize_bits={"fp32": None, "q4": 4}[request.param], seed=0).language_model


def speculate(language_model, tokens, cache):
    """Prefill, then ROUNDS verify blocks (2 to 8 tokens, a random accepted prefix kept per row) each
    followed by one decode step: every block's and step's logits, and the cache at the end."""
    rng = np.random.default_rng(1)
    batch = tokens.shape[0]
    logits = [language_model(tokens, cache=cache).logits[:, -1]]
    for round_ in range(ROUNDS):
        length = 2 + round_ % 7
        block = mx.array(rng.integers(20, 500, (batch, length)), dtype=mx.int32)
        transaction = start_speculative_cache(cache, length)
        logits.append(language_model(block, cache=cache).logits)
        mx.eval(logits[-1])
        transaction.commit([int(k) for k in rng.integers(1, length + 1, batch)])  # accepted + bonus
        step = mx.argmax(logits[-1][:, -1], axis=-1)[:, None]
        logits.append(language_model(step, cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    return logits, cache


def assert_same_run(expected, actual):
    for i, (a, b) in enumerate(zip(expected[0], actual[0], strict=True)):
        assert_same(a, b, f"logits {i}")
    state_a, state_b = cache_state(expected[1]), cache_state(actual[1])
    assert [p for p, _ in state_a] == [p for p, _ in state_b]
    assert sum(isinstance(v, mx.array) for _, v in state_a) > 20
    for (path, a), (_, b) in zip(state_a, state_b):
        assert_same(a, b, path)


@pytest.mark.parametrize("batch", ["batch1", "batch3-left-padded"])
def test_verify_blocks_bit_identical_with_every_decode_patch(language_model, batch):
    def run():
        if batch == "batch1":
            return speculate(language_model, mx.array([PROMPT]), language_model.make_cache())
        return speculate(language_model, *left_padded_batch(language_model))

    stock = run()
    state = glm53_patches.enable([*DECODE, "layer_decode"], strict=True)
    assert all(state[name]["state"] == "applied" for name in [*DECODE, "layer_decode"]), state
    compiled_kda_decode.PATCH.stats.reset()
    try:
        patched = run()
    finally:
        glm53_patches.disable()
    assert_same_run(stock, patched)
    hits = compiled_kda_decode.PATCH.stats.snapshot()["hits"]
    kda = sum(layer.is_linear for layer in language_model.layers)
    assert hits["verify"] == ROUNDS * kda, hits  # every block's KDA layers ran compiled, recording history

"""Speculative verify blocks through the whole tiny model: with every exact decode patch on, the logits
of each block, the caches after each rollback and the decode steps between are bit-identical to stock.

The blocks are what mlx-vlm's MTP loop runs on the target: ``start_speculative_cache`` over the model's
caches, one forward of the bonus token and the drafts, then a commit of the accepted prefix per row.
"""

import mlx.core as mx
import pytest
from test_layer_decode import DECODE, PROMPT, assert_same, cache_state, left_padded_batch

import glm53_patches
from glm53_patches.patches import compiled_kda_decode, dsa_decode, hc_decode
from glm53_patches.tiny_model import build_model, speculative_logits

ROUNDS = 10


@pytest.fixture(scope="module", params=["fp32", "q4"])
def language_model(request):
    return build_model(quantize_bits={"fp32": None, "q4": 4}[request.param], seed=0).language_model


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
            return speculative_logits(language_model, mx.array([PROMPT]), ROUNDS)
        tokens, cache = left_padded_batch(language_model)
        return speculative_logits(language_model, tokens, ROUNDS, cache)

    stock = run()
    state = glm53_patches.enable([*DECODE, "layer_decode"], strict=True)
    assert all(state[name]["state"] == "applied" for name in [*DECODE, "layer_decode"]), state
    compiled_kda_decode.PATCH.stats.reset()
    hc_decode.PATCH.stats.reset()
    dsa_decode.PATCH.stats.reset()
    try:
        patched = run()
    finally:
        glm53_patches.disable()
    assert_same_run(stock, patched)
    hits = compiled_kda_decode.PATCH.stats.snapshot()["hits"]
    kda = sum(layer.is_linear for layer in language_model.layers)
    assert hits["verify"] == ROUNDS * kda, hits  # every block's KDA layers ran compiled, recording history
    hc = hc_decode.PATCH.stats.snapshot()
    assert hc["hits"]["block"] == ROUNDS * len(language_model.layers), hc  # every block's every layer, fused
    assert "metal verify block" not in hc["fallbacks"], hc
    dsa = dsa_decode.PATCH.stats.snapshot()
    dsa_layers = len(language_model.layers) - kda
    assert dsa["hits"]["block"] == ROUNDS * dsa_layers, dsa  # every block's DSA attention, row-gathered

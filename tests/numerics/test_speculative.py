"""Speculative verify blocks through the whole tiny model: with every exact decode patch on, the logits
of each block, the caches after each rollback and the decode steps between are bit-identical to stock.

The blocks are what mlx-vlm's MTP loop runs on the target: ``start_speculative_cache`` over the model's
caches, one forward of the bonus token and the drafts, then a commit of the accepted prefix per row.
"""

import mlx.core as mx
import pytest
from test_layer_decode import DECODE, PROMPT, assert_same, left_padded_batch

import glm53_patches
from glm53_patches.patches import compiled_kda_decode, dsa_decode, hc_decode, layer_decode
from glm53_patches.exactness import cache_fields
from glm53_patches.tiny_model import build_model, speculative_logits

ROUNDS = 10


@pytest.fixture(scope="module", params=["fp32", "q4"])
def language_model(request):
    return build_model(quantize_bits={"fp32": None, "q4": 4}[request.param], seed=0).language_model


def assert_same_run(expected, actual):
    for i, (a, b) in enumerate(zip(expected[0], actual[0], strict=True)):
        assert_same(a, b, f"logits {i}")
    state_a, state_b = cache_fields(expected[1]), cache_fields(actual[1])
    assert [p for p, _ in state_a] == [p for p, _ in state_b]
    assert sum(isinstance(v, mx.array) for _, v in state_a) > 20
    for (path, a), (_, b) in zip(state_a, state_b):
        assert_same(a, b, path)


@pytest.mark.parametrize("batch", ["batch1", "batch3-left-padded"])
@pytest.mark.parametrize("whole_layers", [False, True], ids=["per-module", "layer_decode"])
def test_verify_blocks_bit_identical_with_every_decode_patch(language_model, batch, whole_layers):
    def run():
        if batch == "batch1":
            return speculative_logits(language_model, mx.array([PROMPT]), ROUNDS)
        tokens, cache = left_padded_batch(language_model)
        return speculative_logits(language_model, tokens, ROUNDS, cache)

    stock = run()
    names = [*DECODE, "layer_decode"] if whole_layers else DECODE
    state = glm53_patches.enable(names, strict=True)
    assert all(state[name]["state"] == "applied" for name in names), state
    for patch in (compiled_kda_decode, hc_decode, dsa_decode, layer_decode):
        patch.PATCH.stats.reset()
    try:
        patched = run()
    finally:
        glm53_patches.disable()
    assert_same_run(stock, patched)
    kda = sum(layer.is_linear for layer in language_model.layers)
    dsa_layers = len(language_model.layers) - kda
    indexers = sum(not layer.is_linear and layer.self_attn.indexer is not None for layer in language_model.layers)
    dsa = dsa_decode.PATCH.stats.snapshot()
    assert dsa["hits"]["indexer block"] == ROUNDS * indexers, dsa  # every block's selection (eager in layer_decode)
    if whole_layers:
        # Every block's every layer ran as layer_decode's compiled functions, the KDA layers' recording
        # what the rollback needs; the patches inside them run only while tracing.
        layers = layer_decode.PATCH.stats.snapshot()
        assert layers["hits"]["kda block"] == ROUNDS * kda, layers
        assert layers["hits"]["dsa block"] == ROUNDS * dsa_layers, layers
        assert layers["fallbacks"] == {"length": 1}, layers  # the prompt's prefill, nothing else
        assert compiled_kda_decode.PATCH.stats.snapshot()["hits"]["verify"] < ROUNDS * kda
        return
    hits = compiled_kda_decode.PATCH.stats.snapshot()["hits"]
    assert hits["verify"] == ROUNDS * kda, hits  # every block's KDA layers ran compiled, recording history
    hc = hc_decode.PATCH.stats.snapshot()
    assert hc["hits"]["block"] == ROUNDS * len(language_model.layers), hc  # every block's every layer, fused
    assert "metal verify block" not in hc["fallbacks"], hc
    assert dsa["hits"]["block"] == ROUNDS * dsa_layers, dsa  # every block's DSA attention, row-gathered

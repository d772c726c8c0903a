"""hc_decode: patched decode is bit-identical to stock, engages, composes, reverts.

Every expected value here comes from running the stock mlx-vlm code (or MLX
itself) in the same process; nothing is copied from the code under test.
"""

import mlx.core as mx
import pytest

import glm53_patches
from glm53_patches import registry
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.hc_decode as hc_decode
from glm53_patches.exactness import same_bits

STEPS = 64
NAME = "hc_decode"
KDA = "compiled_kda_decode"
TARGET = "mlx_vlm.models.glm5_next.language:DecoderLayer.__call__"
PROMPT = [3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]


@pytest.fixture(scope="module")
def fp32_model():
    return build_model(quantize_bits=None, seed=0)


@pytest.fixture(scope="module")
def q4_model():
    return build_model(quantize_bits=4, seed=0)


def enable(*names):
    state = glm53_patches.enable(list(names), strict=True)
    for name in names:
        assert state[name]["state"] == "applied", state[name]


def assert_bit_identical(expected, actual):
    assert len(expected) == len(actual)
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert a.dtype == b.dtype and a.shape == b.shape, step
        assert same_bits(a, b), f"step {step} differs"


def left_padded_batch(language_model):
    """Three prompts of different lengths, left-padded, with mlx-vlm's batch caches."""
    from mlx_vlm.generate.ar import _make_cache

    prompts = [PROMPT, PROMPT[3:], PROMPT[:5]]
    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    return tokens, _make_cache(language_model, padding)


def layer_hits():
    return hc_decode.PATCH.stats.snapshot()["hits"].get("layer", 0)


@pytest.mark.parametrize("which", ["fp32_model", "q4_model"])
def test_greedy_decode_bit_identical_batch_1(request, which):
    language_model = request.getfixturevalue(which).language_model
    prompt = mx.array([PROMPT])
    expected = greedy_logits(language_model, prompt, STEPS)

    hc_decode.PATCH.stats.reset()
    enable(NAME)
    actual = greedy_logits(language_model, prompt, STEPS)
    assert_bit_identical(expected, actual)
    snapshot = hc_decode.PATCH.stats.snapshot()
    layers = len(language_model.layers)
    # Every decode step ran every layer, and both of its hyper-connections,
    # through the fused path; the prefill (L > 1) stayed stock.
    assert snapshot["hits"]["layer"] == STEPS * layers
    hc_hits = snapshot["hits"].get("compiled", 0) + snapshot["hits"].get("kernel", 0)
    assert hc_hits == 2 * STEPS * layers
    assert snapshot["fallbacks"] == {"length": layers}


def test_batched_left_padding_bit_identical(fp32_model):
    language_model = fp32_model.language_model
    tokens, cache = left_padded_batch(language_model)
    expected = greedy_logits(language_model, tokens, STEPS, cache=cache)

    enable(NAME)
    before = layer_hits()
    tokens, cache = left_padded_batch(language_model)
    actual = greedy_logits(language_model, tokens, STEPS, cache=cache)
    assert_bit_identical(expected, actual)
    assert layer_hits() - before == STEPS * len(language_model.layers)


def test_composes_with_compiled_kda_decode(q4_model):
    language_model = q4_model.language_model
    prompt = mx.array([PROMPT, PROMPT[::-1]])
    expected = greedy_logits(language_model, prompt, STEPS)

    kda = registry.available()[KDA]
    kda_before = kda.stats.hits
    before = layer_hits()
    enable(KDA, NAME)
    actual = greedy_logits(language_model, prompt, STEPS)
    assert_bit_identical(expected, actual)
    assert layer_hits() - before == STEPS * len(language_model.layers)
    assert kda.stats.hits > kda_before  # the KDA branch inside hc_decode's layer still engaged

    # Reverting one leaves the other engaged and the outputs unchanged.
    glm53_patches.disable([NAME])
    kda_before = kda.stats.hits
    before = layer_hits()
    again = greedy_logits(language_model, prompt, 8)
    assert_bit_identical(expected[:9], again)
    assert kda.stats.hits > kda_before
    assert layer_hits() == before


def test_revert_restores_the_original_object():
    from mlx_vlm.models.glm5_next import language

    original = language.DecoderLayer.__dict__["__call__"]
    enable(NAME)
    assert language.DecoderLayer.__dict__["__call__"] is not original
    glm53_patches.disable([NAME])
    assert language.DecoderLayer.__dict__["__call__"] is original
    assert TARGET in hc_decode.PATCH.targets


def test_fused_graph_has_fewer_primitives(fp32_model, tmp_path):
    """Graph primitives of one decode step (deterministic): fewer when patched."""
    import re

    language_model = fp32_model.language_model

    def primitives():
        cache = language_model.make_cache()
        mx.eval(language_model(mx.array([PROMPT]), cache=cache).logits)
        logits = language_model(mx.array([[PROMPT[0]]]), cache=cache).logits
        path = tmp_path / "step.dot"
        mx.export_to_dot(str(path), logits)
        return len(re.findall(r'shape=rectangle', path.read_text()))

    stock = primitives()
    enable(NAME)
    patched = primitives()
    assert patched < stock


def test_compiled_constant_matches_mlx_compile():
    """The eps the CUDA kernel reads is what MLX's fused kernels bake for a Python float."""
    from glm53_patches.kernels.hc_sinkhorn import compiled_constant

    x = mx.random.uniform(0.5, 2.0, (4096,), key=mx.random.key(0))
    for value in (1e-6, 1 / 3, 0.08838834764831845, 3.14159265358979, 1 / 16384):
        # exp(|x|) * value: a fused chain with the constant captured, on real data.
        baked = mx.compile(lambda a, v=value: mx.exp(mx.abs(a)) * v)(x)
        eager = mx.exp(mx.abs(x)) * mx.array(compiled_constant(value), dtype=mx.float32)
        assert same_bits(baked, eager), value


def test_kernel_stays_off_without_a_gpu(monkeypatch):
    from glm53_patches.patches.hc_decode import layer

    monkeypatch.setenv("GLM53_HC_DECODE_KERNEL", "1")
    layer.clear()
    assert layer.kernel_wanted(None) is False  # CPU: no kernel, whatever the knob says
    monkeypatch.setenv("GLM53_HC_DECODE_KERNEL", "bogus")
    layer.clear()
    assert layer.kernel_wanted("cuda") is False  # a bad value keeps the kernel off
    monkeypatch.setenv("GLM53_HC_DECODE_KERNEL", "auto")
    layer.clear()
    assert layer.kernel_wanted("cuda") is False  # no verify record in the test state dir
    layer.clear()


def test_verify_reports_exact_on_this_backend():
    result = hc_decode.PATCH.verify()
    assert set(result) == {"exact", "max_abs_diff", "cases", "detail", "case_results"}
    assert len(result["case_results"]) == result["cases"]
    assert result["exact"] is True, result["detail"]
    assert result["cases"] >= 8
    assert result["max_abs_diff"] == 0.0

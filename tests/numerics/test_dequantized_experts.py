"""dequantized_experts on the CPU (fp32, where MLX has gather_mm): bit for bit against stock.

Through the public enable(), on the tiny random-weight model quantized as
``convert`` does, with the chunk threshold lowered so its prompts dequantize:
logits of the prefill and of every greedy step, and every cache array, on
raw bits; batch 1, a batch of 2, and a cache resumed by a second prefill.
"""

import logging

import mlx.core as mx
import pytest

import glm53_patches
from glm53_patches.bench.synthetic import cache_arrays
from glm53_patches.exactness import compare_tiny_models, same_bits
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.dequantized_experts as dequantized_experts
from glm53_patches.patches.dequantized_experts import experts

PATCH = dequantized_experts.PATCH
PROMPT = mx.array([[(7 * i + 3) % 500 for i in range(80)]])  # 80 x top-2 routes: SwitchGLU sorts them


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", "1")
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "16")
    experts.clear()
    yield
    glm53_patches.disable([PATCH.name])
    experts.clear()


def run(language_model, tokens, steps, resume=None):
    """Greedy logits and the final cache arrays (``resume``: a first prefill before ``tokens``)."""
    cache = language_model.make_cache()
    if resume is not None:
        mx.eval(language_model(resume, cache=cache).logits)
    return greedy_logits(language_model, tokens, steps, cache=cache), cache_arrays(cache)


def hits():
    return PATCH.stats.snapshot()["hits"].get("dequantized", 0)


@pytest.mark.parametrize("quantize_bits", [4, 8])
@pytest.mark.parametrize("case", ["batch 1", "batch 2", "resumed"])
def test_bit_for_bit_with_stock(fast_path, quantize_bits, case):
    language_model = build_model(quantize_bits=quantize_bits, seed=3).language_model
    tokens, resume = PROMPT, None
    if case == "batch 2":
        tokens = mx.concatenate([PROMPT, PROMPT[:, ::-1]])
    if case == "resumed":
        tokens, resume = PROMPT[:, 40:], PROMPT[:, :40]
    expected = run(language_model, tokens, 12, resume)
    assert glm53_patches.enable([PATCH.name], strict=True)[PATCH.name]["state"] == "applied"
    before = hits()
    actual = run(language_model, tokens, 12, resume)
    for group_expected, group_actual in zip(expected, actual):
        assert len(group_expected) == len(group_actual) > 0
        assert all(same_bits(a, b) for a, b in zip(group_expected, group_actual))
    moe_layers = sum(kind == "sparse" for kind in language_model.model.config.mlp_layer_types)
    prefills = 2 if case == "resumed" else 1
    assert hits() - before == moe_layers * prefills  # every prefill chunk dequantized, no decode step
    switch_mlp = next(l.mlp.switch_mlp for l in language_model.model.layers if hasattr(l.mlp, "switch_mlp"))
    assert type(switch_mlp.up_proj).__name__ == "QuantizedSwitchLinear"  # the model itself is untouched


def test_chunks_below_the_threshold_and_unquantized_weights_stay_stock(fast_path, monkeypatch):
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "81")
    experts.clear()
    glm53_patches.enable([PATCH.name], strict=True)
    before, hits_before = dict(PATCH.stats.snapshot()["fallbacks"]), hits()
    quantized = build_model(quantize_bits=4, seed=3).language_model
    greedy_logits(quantized, PROMPT, 1)  # 80 tokens < 81
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "16")
    experts.clear()
    greedy_logits(quantized, PROMPT[:, :20], 0)  # 20 tokens x top-2: unsorted routes
    greedy_logits(build_model(seed=3).language_model, PROMPT, 0)  # fp32 experts
    after = PATCH.stats.snapshot()["fallbacks"]
    for reason in ("not a prefill chunk", "too few routes to be sorted", "weights not affine-quantized"):
        assert after[reason] > before.get(reason, 0), reason
    assert PATCH.stats.snapshot()["hits"].get("dequantized", 0) == hits_before


def test_auto_without_a_verify_record_keeps_stock(monkeypatch):
    monkeypatch.delenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", raising=False)
    experts.clear()
    assert experts.switch.wanted("cpu") is False and experts.switch.wanted("cuda") is False
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", "0")
    experts.clear()
    assert experts.switch.wanted("cpu") is False
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", "1")
    experts.clear()
    assert all(experts.switch.wanted(b) for b in ("cpu", "cuda", "metal"))
    experts.clear()


def test_auto_takes_a_verify_record_on_cuda_and_the_cpu_but_not_on_metal(monkeypatch, tmp_path):
    from glm53_patches import verify_records

    monkeypatch.setenv("GLM53_PATCHES_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", raising=False)
    for backend in ("cpu", "cuda", "metal"):
        verify_records.record(PATCH.name, backend, {"passed": True, "exact": True})
    experts.clear()
    assert experts.switch.wanted("cpu") and experts.switch.wanted("cuda")
    assert not experts.switch.wanted("metal")  # its speed there is unmeasured
    experts.clear()


@pytest.mark.parametrize("variable, value", [("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", "sometimes"),
                                             ("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "many"),
                                             ("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "0")])
def test_bad_values_are_named_and_change_nothing(monkeypatch, caplog, variable, value):
    monkeypatch.setenv(variable, value)
    experts.clear()
    with caplog.at_level(logging.ERROR, logger="glm53_patches"):
        if variable.endswith("FAST_PATH"):
            assert experts.switch.wanted("cpu") is False
        else:
            assert experts.min_tokens() == experts.DEFAULT_MIN_TOKENS
    assert variable in caplog.text and "accepted" in caplog.text
    experts.clear()


def test_another_models_moe_is_left_alone(fast_path):
    from mlx_vlm.models.switch_layers import MoE

    class OtherMoE(MoE):
        pass

    before = PATCH.stats.snapshot()
    assert experts.dequantizing_copy(OtherMoE(), mx.zeros((1, 64, 8))) is None
    assert PATCH.stats.snapshot() == before  # not counted either way


def test_revert_restores_the_original_object():
    from mlx_vlm.models.switch_layers import MoE

    original = MoE.__dict__["__call__"]
    glm53_patches.enable([PATCH.name], strict=True)
    assert MoE.__dict__["__call__"] is not original
    glm53_patches.disable([PATCH.name])
    assert MoE.__dict__["__call__"] is original


def test_the_gpu_verify_model_is_wide_and_exact_here():
    """verify's GPU tiny model: every quantized matmul 128 wide in (and per MLA
    head out), the widths MLX's CUDA quantized kernels take; and its check runs
    and passes here (fp32 in place of the GPU's bf16)."""
    from mlx_vlm.models.switch_layers import MoE

    from glm53_patches.exactness import Tally
    from glm53_patches.patches.dequantized_experts.checks.verify import _forced_below_the_tiny_prompt
    from glm53_patches.tiny_model import gpu_widths

    model = build_model(seed=1, quantize_bits=4, **gpu_widths())
    for name, module in model.language_model.named_modules():
        if hasattr(module, "bits") and hasattr(module, "weight") and module.weight.ndim >= 2:
            assert module.weight.shape[-1] * 32 // module.bits % 128 == 0, name
            if module.weight.ndim == 3 and "switch_mlp" not in name:  # the MLA's per-head projections
                assert module.weight.shape[-2] % 128 == 0, name
    tally, before = Tally(), hits()
    stock = MoE.__dict__["__call__"]
    compare_tiny_models(tally, MoE, "__call__", stock, experts.make_call(stock), _forced_below_the_tiny_prompt,
                        variants=[("4-bit", 4, None)], config=gpu_widths())
    result = tally.result(0.0)
    assert result["exact"] and result["cases"] == 2 and hits() > before, result


def test_split_where_cuda_sorted_gather_mm_would_overflow(fast_path, monkeypatch):
    """GLM-5.3-Flash's 288 bf16 experts overflow CUDA's sorted gather_mm (backend.py): there each
    projection runs as several sorted gather_mm calls of fewer experts. The tiny model cannot
    overflow, so the limit is forced to 5 of its 8 experts; the model must stay bit for bit."""
    lm = build_model(quantize_bits=4, seed=3).language_model
    ref, ref_cache = run(lm, PROMPT, 4)
    asked = []

    def five(backend, out, inp, itemsize):  # calls of 5 and 3: MLX's CPU gather wraps an index past a
        asked.append((out, inp, itemsize))  # slice, which would hide a wrong offset in equal calls
        return 5

    monkeypatch.setattr(experts, "sorted_gather_mm_max_experts", five)
    glm53_patches.enable([PATCH.name], strict=True)
    split_before, hits_before = PATCH.stats.snapshot()["hits"].get("split calls", 0), hits()
    got, got_cache = run(lm, PROMPT, 4)
    assert all(same_bits(a, b) for a, b in zip(ref + ref_cache, got + got_cache))
    layers = sum(kind == "sparse" for kind in lm.model.config.mlp_layer_types)
    assert hits() - hits_before == layers
    assert PATCH.stats.snapshot()["hits"]["split calls"] - split_before == 3 * layers  # up, gate, down
    glu = lm.model.layers[-1].mlp.switch_mlp
    assert (glu.up_proj.output_dims, glu.up_proj.input_dims, 4) in asked  # fp32 dequantized weights

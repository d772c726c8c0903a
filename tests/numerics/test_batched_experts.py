"""batched_experts: prefill's routed experts as batched matmuls over padded routes, quality-gated against stock.

Numerics-changing by design (the same products summed in another order on a
GPU), so the checks are closeness to stock, a teacher-forced gate on the tiny
model (fp32 and 4-bit), and bit-identity wherever it steps aside.
"""

import mlx.core as mx
import numpy as np
import pytest

import glm53_patches
from glm53_patches.bench.synthetic import cache_arrays
from glm53_patches.exactness import logit_gate, same_bits
from glm53_patches.patches.batched_experts import PATCH, experts
from glm53_patches.tiny_model import build_model, greedy_logits
from mlx_vlm.models.switch_layers import MoE

STOCK = MoE.__dict__["__call__"]


@pytest.fixture
def applied():
    PATCH.stats.reset()
    assert glm53_patches.enable([PATCH.name], strict=True)[PATCH.name]["state"] == "applied"
    yield
    glm53_patches.disable([PATCH.name, "dequantized_experts"])


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def moe_layers(language_model):
    return sum(kind == "sparse" for kind in language_model.model.config.mlp_layer_types)


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_batched_experts_match_switch_glu(quantize_bits):
    """One block on uneven routes (an expert with none, one with most): stock's SwitchGLU vs BatchedExperts."""
    glu = next(l.mlp.switch_mlp for l in build_model(seed=2, quantize_bits=quantize_bits).language_model.model.layers
               if hasattr(l.mlp, "switch_mlp"))
    mx.random.seed(5)
    x = mx.random.normal((2, 30, glu.up_proj.input_dims))
    experts_n = glu.down_proj.num_experts
    indices = mx.random.randint(1, experts_n, (2, 30, 2))  # expert 0 gets no route
    indices = mx.where(mx.arange(30)[None, :, None] < 12, experts_n - 1, indices)  # the last gets many
    ref = glu(x, indices)  # [B, L, top_k, hidden], routes sorted (120 >= 64)
    got = experts.BatchedExperts(glu)(x, indices)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.abs(f64(got) - f64(ref)).max() < 1e-5 * np.abs(f64(ref)).max()


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_tiny_model_teacher_forced_quality(applied, quantize_bits):
    """Gate: 2 x 300 teacher-forced tokens, every MoE layer's prefill batched."""
    lm = build_model(seed=0, quantize_bits=quantize_bits).language_model
    mx.random.seed(0)
    tokens = mx.random.randint(0, 512, (2, 300))
    glm53_patches.disable([PATCH.name])
    ref = f64(lm(tokens, cache=lm.make_cache()).logits)
    glm53_patches.enable([PATCH.name], strict=True)
    got = f64(lm(tokens, cache=lm.make_cache()).logits)
    assert PATCH.stats.snapshot()["hits"] == {"batched": moe_layers(lm)}

    gate = logit_gate(ref, got)
    # Measured (CPU): KL 0 and 600/600 top-1 (bit-identical here), fp32 and 4-bit.
    assert gate["kl_mean"] < 1e-10 and gate["kl_max"] < 1e-9, gate
    assert gate["clear"] > 0.95 and gate["top1_on_clear"], gate  # top-1 off stock's near-ties


def test_decode_after_a_batched_prefill(applied):
    """Greedy steps after a batched prefill (decode itself is stock's) stay close to stock's, caches too."""
    lm = build_model(seed=1).language_model
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(90)], [(11 * i + 1) % 500 for i in range(90)]])
    runs = {}
    for arm in ("stock", "batched"):
        (glm53_patches.disable if arm == "stock" else glm53_patches.enable)([PATCH.name])
        cache = lm.make_cache()
        runs[arm] = greedy_logits(lm, prompt, 6, cache=cache), cache_arrays(cache)
    assert PATCH.stats.snapshot()["hits"]["batched"] == moe_layers(lm)  # the prefill only
    assert PATCH.stats.snapshot()["fallbacks"]["not a prefill chunk"] == 6 * moe_layers(lm)
    for group in (0, 1):
        for ref, got in zip(runs["stock"][group], runs["batched"][group]):
            assert np.abs(f64(got) - f64(ref)).max() <= 1e-4 * max(np.abs(f64(ref)).max(), 1.0)


def test_uneven_routing_and_short_chunks_are_stock_bit_for_bit(applied, monkeypatch):
    """Uneven routes take stock's sorted gather_mm over the dequantized weights (bit-identical to
    gather_qmm on the CPU, where dequantized_experts is verified), never the slow gather_qmm."""
    from mlx_vlm.models.switch_layers import QuantizedSwitchLinear

    lm = build_model(seed=3, quantize_bits=4).language_model
    prompt = mx.array([[(5 * i + 2) % 500 for i in range(70)]])
    glm53_patches.disable([PATCH.name])
    ref = greedy_logits(lm, prompt, 3)
    glm53_patches.enable([PATCH.name], strict=True)
    monkeypatch.setattr(experts, "MAX_PADDING", 0)  # no padding allowed: every prefill block falls back
    stock_qmm = QuantizedSwitchLinear.__call__

    def decode_only(self, x, indices, sorted_indices=False):
        assert not sorted_indices, "gather_qmm ran for a prefill block"  # prefill routes are sorted (>= 64)
        return stock_qmm(self, x, indices, sorted_indices)

    monkeypatch.setattr(QuantizedSwitchLinear, "__call__", decode_only)
    got = greedy_logits(lm, prompt, 3)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    stats = PATCH.stats.snapshot()
    assert stats["hits"] == {}
    assert stats["fallbacks"] == {"routing too uneven to pad": moe_layers(lm), "not a prefill chunk": 3 * moe_layers(lm)}


@pytest.mark.parametrize("inner", ["batched_experts", "dequantized_experts"])
def test_composes_with_dequantized_experts(applied, monkeypatch, inner):
    """Both replace MoE.__call__; in either order the prefill is batched, with the same bits as alone."""
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_FAST_PATH", "1")
    monkeypatch.setenv("GLM53_DEQUANTIZED_EXPERTS_MIN_TOKENS", "16")
    from glm53_patches.patches.dequantized_experts import experts as dequantized

    dequantized.clear()
    lm = build_model(seed=3, quantize_bits=4).language_model
    prompt = mx.array([[(5 * i + 2) % 500 for i in range(70)]])
    alone = greedy_logits(lm, prompt, 0)
    glm53_patches.disable([PATCH.name])
    order = [inner] + [n for n in (PATCH.name, "dequantized_experts") if n != inner]
    for name in order:  # the later one wraps the earlier
        assert glm53_patches.enable([name], strict=True)[name]["state"] == "applied"
    PATCH.stats.reset()
    both = greedy_logits(lm, prompt, 0)
    assert PATCH.stats.snapshot()["hits"] == {"batched": moe_layers(lm)}
    assert all(same_bits(a, b) for a, b in zip(alone, both))
    dequantized.clear()


def test_another_models_moe_is_left_alone():
    class OtherMoE(MoE):
        pass

    before = PATCH.stats.snapshot()
    assert experts.batching_copy(OtherMoE(), mx.zeros((1, 64, 8))) is None
    assert PATCH.stats.snapshot() == before  # not counted either way


def test_revert_restores_the_original_object():
    glm53_patches.enable([PATCH.name], strict=True)
    assert MoE.__dict__["__call__"] is not STOCK
    glm53_patches.disable([PATCH.name])
    assert MoE.__dict__["__call__"] is STOCK


def test_uneven_routing_keeps_stock_experts_where_cuda_gather_mm_would_overflow(applied, monkeypatch):
    """With GLM-5.3-Flash's 288 experts, CUDA's sorted gather_mm overflows (backend.py): uneven
    routes then take stock's SwitchGLU itself (gather_qmm on quantized experts), bit for bit.
    The tiny model cannot overflow, so the limit is forced to 3 of its 8 experts."""
    from mlx_vlm.models.switch_layers import QuantizedSwitchLinear

    lm = build_model(seed=3, quantize_bits=4).language_model
    prompt = mx.array([[(5 * i + 2) % 500 for i in range(70)]])
    glm53_patches.disable([PATCH.name])
    ref = greedy_logits(lm, prompt, 2)
    glm53_patches.enable([PATCH.name], strict=True)
    monkeypatch.setattr(experts, "MAX_PADDING", 0)
    monkeypatch.setattr(experts, "sorted_gather_mm_max_experts", lambda *args: 3)  # of its 8
    stock_qmm, sorted_calls = QuantizedSwitchLinear.__call__, []

    def counted(self, x, indices, sorted_indices=False):
        sorted_calls.append(sorted_indices)
        return stock_qmm(self, x, indices, sorted_indices)

    monkeypatch.setattr(QuantizedSwitchLinear, "__call__", counted)
    got = greedy_logits(lm, prompt, 2)
    assert all(same_bits(a, b) for a, b in zip(ref, got))
    assert sorted_calls.count(True) == 3 * moe_layers(lm)  # the prefill's three projections per block
    assert PATCH.stats.snapshot()["fallbacks"]["routing too uneven to pad (stock's experts: CUDA's gather_mm would overflow)"] \
        == moe_layers(lm)

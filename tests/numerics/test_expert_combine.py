"""expert_combine on the CPU: the wrapper hands every call to stock; the kernel's coverage and knob.

The kernel runs on a GPU only (``glm53-patches verify expert_combine`` on the
H200 / a Mac). Here: what the CPU user gets (stock, bit for bit, with the
fallback counted for glm5_next's MoE blocks only), the coverage rules and the
knob.
"""

import mlx.core as mx
import pytest

import glm53_patches
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.expert_combine as expert_combine

NAME = "expert_combine"
PROMPT = mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])


def bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16}[a.dtype.size])


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_on_the_cpu_the_stock_combine_runs_bit_for_bit(quantize_bits):
    language_model = build_model(quantize_bits=quantize_bits, seed=2).language_model
    expected = greedy_logits(language_model, PROMPT, 24)
    state = glm53_patches.enable([NAME], strict=True)
    assert state[NAME]["state"] == "applied", state[NAME]
    before = expert_combine.PATCH.stats.snapshot()["fallbacks"].get("no GPU backend", 0)
    actual = greedy_logits(language_model, PROMPT, 24)
    for a, b in zip(expected, actual):
        assert mx.array_equal(bits(a), bits(b)).item()
    stats = expert_combine.PATCH.stats.snapshot()
    moe_layers = sum(cfg == "sparse" for cfg in language_model.model.config.mlp_layer_types)
    assert stats["fallbacks"]["no GPU backend"] - before == moe_layers * 25  # prefill + 24 steps
    assert "kernel" not in stats["hits"]


def test_other_models_moe_blocks_are_not_ours():
    from mlx_vlm.models.switch_layers import MoE

    from glm53_patches.patches.expert_combine.combine import combine_call

    class OtherMoE(MoE):
        pass

    before = expert_combine.PATCH.stats.snapshot()
    assert combine_call(OtherMoE(), mx.zeros((1, 1, 8)), (), None, {}) is None
    assert expert_combine.PATCH.stats.snapshot() == before  # not even counted


def test_revert_restores_the_original_object():
    from mlx_vlm.models.switch_layers import MoE

    original = MoE.__dict__["__call__"]
    glm53_patches.enable([NAME], strict=True)
    assert MoE.__dict__["__call__"] is not original
    glm53_patches.disable([NAME])
    assert MoE.__dict__["__call__"] is original


def test_kernel_coverage():
    from glm53_patches.patches.expert_combine.kernel import unsupported

    routed, weights, shared = mx.zeros((2, 1, 8, 4096), mx.bfloat16), mx.zeros((2, 1, 8)), mx.zeros((2, 1, 4096), mx.bfloat16)
    assert unsupported(routed, weights, shared, backend="cuda") is None
    assert unsupported(routed, weights, shared, backend=None) == "no GPU backend"
    assert unsupported(routed, weights, None, backend="cuda") == "dtype"
    assert unsupported(routed, weights.astype(mx.bfloat16), shared, backend="cuda") == "weights"
    assert unsupported(routed, weights, shared[..., :64], backend="cuda") == "shape"
    odd = mx.zeros((2, 1, 8, 4092), mx.bfloat16)  # 8,184 bytes a row: stock sums it another way
    assert unsupported(odd, weights, mx.zeros((2, 1, 4092), mx.bfloat16), backend="cuda") == "not col_reduce_small's case"
    wide = mx.zeros((2, 1, 40, 4096), mx.bfloat16)
    assert unsupported(wide, mx.zeros((2, 1, 40)), shared, backend="cuda") == "not col_reduce_small's case"


def test_kernel_knob(monkeypatch):
    from glm53_patches.patches.expert_combine import combine

    combine.clear()
    assert combine.switch.wanted("cuda") is False  # auto, and no verify record in the test state dir
    monkeypatch.setenv("GLM53_EXPERT_COMBINE_KERNEL", "on")
    combine.clear()
    assert combine.switch.wanted("cuda") is True and combine.switch.wanted(None) is False
    combine.clear()


def test_verify_on_the_cpu():
    result = expert_combine.PATCH.verify()
    assert result["exact"] is True, result["detail"]
    assert result["cases"] == 4 and "steps aside" in result["detail"]

"""router_select on the CPU: the wrapper hands every call to stock; the kernel's gate and reference.

The kernel itself runs on a GPU only (``glm53-patches verify router_select``
on the H200 / a Mac; ``host_check`` runs its body with g++). Here: what the
CPU user gets (stock, bit for bit, with the fallback counted), the kernel's
coverage rules and knob, and the host check's numpy reference against the
stock ``_expert_select``.
"""

import logging

import mlx.core as mx
import numpy as np
import pytest

import glm53_patches
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.router_select as router_select

NAME = "router_select"
PROMPT = mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])


def bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16}[a.dtype.size])


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_on_the_cpu_the_stock_router_runs_bit_for_bit(quantize_bits):
    language_model = build_model(quantize_bits=quantize_bits, seed=2).language_model
    expected = greedy_logits(language_model, PROMPT, 24)
    state = glm53_patches.enable([NAME], strict=True)
    assert state[NAME]["state"] == "applied", state[NAME]
    before = router_select.PATCH.stats.snapshot()["fallbacks"].get("no GPU backend", 0)
    actual = greedy_logits(language_model, PROMPT, 24)
    for a, b in zip(expected, actual):
        assert mx.array_equal(bits(a), bits(b)).item()
    stats = router_select.PATCH.stats.snapshot()
    moe_layers = sum(cfg == "sparse" for cfg in language_model.model.config.mlp_layer_types)
    assert stats["fallbacks"]["no GPU backend"] - before == moe_layers * 25  # prefill + 24 steps
    assert "kernel" not in stats["hits"]


def test_revert_restores_the_original_object():
    from mlx_vlm.models.glm5_next import language

    original = language.MoEGate.__dict__["__call__"]
    glm53_patches.enable([NAME], strict=True)
    assert language.MoEGate.__dict__["__call__"] is not original
    glm53_patches.disable([NAME])
    assert language.MoEGate.__dict__["__call__"] is original


def test_kernel_coverage():
    from glm53_patches.patches.router_select.kernel import unsupported

    logits, bias = mx.zeros((2, 288)), mx.zeros((288,))
    assert unsupported(logits, bias, 8, 1, backend="cuda") is None
    assert unsupported(logits, bias, 8, 1, backend="metal") is None
    assert unsupported(logits, bias, 8, 1, backend=None) == "no GPU backend"
    assert unsupported(logits, bias, 8, 4, backend="cuda") == "grouped routing"
    assert unsupported(mx.zeros((2, 2048)), mx.zeros((2048,)), 8, 1, backend="cuda") == "expert count"
    assert unsupported(logits, bias, 33, 1, backend="cuda") == "top_k"
    assert unsupported(logits.astype(mx.bfloat16), bias, 8, 1, backend="cuda") == "dtype"


def test_kernel_knob(monkeypatch, caplog):
    from glm53_patches.patches.router_select import gate

    gate.clear()
    assert gate.switch.wanted("cuda") is False  # auto, and no verify record in the test state dir
    monkeypatch.setenv("GLM53_ROUTER_SELECT_KERNEL", "1")
    gate.clear()
    assert gate.switch.wanted("cuda") is True
    assert gate.switch.wanted(None) is False  # the CPU has no kernel, whatever the knob says
    monkeypatch.setenv("GLM53_ROUTER_SELECT_KERNEL", "sometimes")
    gate.clear()
    with caplog.at_level(logging.ERROR, logger="glm53_patches"):
        assert gate.switch.wanted("cuda") is False
    assert "GLM53_ROUTER_SELECT_KERNEL" in caplog.text and "accepted" in caplog.text
    gate.clear()


def test_host_check_reference_agrees_with_stock_expert_select():
    """The numpy reference the kernel body is checked against selects what stock selects.

    The CPU's argpartition does not sort, so the order is compared on the GPU
    only; here the set of experts and the weight of each expert.
    """
    from mlx_vlm.models.glm5_next import language

    from glm53_patches.patches.router_select.host_check import reference

    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (64, 288)).astype(np.float32)
    bias = rng.normal(0, 0.1, 288).astype(np.float32)
    indices, weights = language._expert_select(mx.array(logits), mx.array(bias), 8, 1, 1, 2.5, True)
    ref_indices, ref_weights = reference(logits, bias, 8, True, 2.5, order=0)
    indices, weights = np.array(indices), np.array(weights)
    by_index, ref_by_index = np.argsort(indices, -1), np.argsort(ref_indices, -1)
    assert np.array_equal(np.take_along_axis(indices, by_index, -1), np.take_along_axis(ref_indices, ref_by_index, -1))
    np.testing.assert_allclose(np.take_along_axis(weights, by_index, -1),
                               np.take_along_axis(ref_weights, ref_by_index, -1), rtol=1e-6)


def test_verify_on_the_cpu():
    result = router_select.PATCH.verify()
    assert result["exact"] is True, result["detail"]
    assert result["cases"] == 4 and "steps aside" in result["detail"]

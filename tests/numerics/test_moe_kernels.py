"""router_select and expert_combine on the CPU: the MoE kernels step aside, bit for bit.

Both patches are one GPU kernel each (``glm53-patches verify`` runs them on
the H200 / a Mac; ``router_select/host_check.py`` runs the router's body with
g++). Here: what the CPU user gets (stock, bit for bit, every call counted
as a fallback), each kernel's coverage rules, and the router host check's
numpy reference against the stock ``_expert_select``. The knobs:
``test_kernel_switches.py``.
"""

import mlx.core as mx
import numpy as np
import pytest

import glm53_patches
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.expert_combine as expert_combine
import glm53_patches.patches.hc_decode as hc_decode
import glm53_patches.patches.router_select as router_select
from glm53_patches.exactness import same_bits
from glm53_patches.kernels import hc_sinkhorn

PATCHES = {"router_select": router_select.PATCH, "expert_combine": expert_combine.PATCH}
PROMPT = mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])


@pytest.mark.parametrize("name", list(PATCHES))
@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_on_the_cpu_stock_runs_bit_for_bit(name, quantize_bits):
    patch = PATCHES[name]
    language_model = build_model(quantize_bits=quantize_bits, seed=2).language_model
    expected = greedy_logits(language_model, PROMPT, 24)
    state = glm53_patches.enable([name], strict=True)
    assert state[name]["state"] == "applied", state[name]
    before = patch.stats.snapshot()["fallbacks"].get("no GPU backend", 0)
    actual = greedy_logits(language_model, PROMPT, 24)
    for a, b in zip(expected, actual):
        assert same_bits(a, b)
    stats = patch.stats.snapshot()
    moe_layers = sum(cfg == "sparse" for cfg in language_model.model.config.mlp_layer_types)
    assert stats["fallbacks"]["no GPU backend"] - before == moe_layers * 25  # prefill + 24 steps
    assert "kernel" not in stats["hits"]


@pytest.mark.parametrize("name, owner", [("router_select", "MoEGate"), ("expert_combine", "MoE")])
def test_revert_restores_the_original_object(name, owner):
    from mlx_vlm.models.glm5_next import language
    from mlx_vlm.models import switch_layers

    cls = getattr(language, owner, None) or getattr(switch_layers, owner)
    original = cls.__dict__["__call__"]
    glm53_patches.enable([name], strict=True)
    assert cls.__dict__["__call__"] is not original
    glm53_patches.disable([name])
    assert cls.__dict__["__call__"] is original


@pytest.mark.parametrize("name", list(PATCHES))
def test_verify_on_the_cpu(name):
    result = PATCHES[name].verify()
    assert result["exact"] is True, result["detail"]
    assert result["cases"] == 8 and "steps aside" in result["detail"]  # fp32 and 4-bit, B=1 and 2, decode and verify blocks


# -- router_select ------------------------------------------------------------------------------


def test_router_kernel_coverage():
    from glm53_patches.patches.router_select.kernel import unsupported

    logits, bias = mx.zeros((2, 288)), mx.zeros((288,))
    assert unsupported(logits, bias, 8, 1, backend="cuda") is None
    assert unsupported(logits, bias, 8, 1, backend="metal") is None
    assert unsupported(logits, bias, 8, 1, backend=None) == "no GPU backend"
    assert unsupported(logits, bias, 8, 4, backend="cuda") == "grouped routing"
    assert unsupported(mx.zeros((2, 2048)), mx.zeros((2048,)), 8, 1, backend="cuda") == "expert count"
    assert unsupported(logits, bias, 33, 1, backend="cuda") == "top_k"
    assert unsupported(logits.astype(mx.bfloat16), bias, 8, 1, backend="cuda") == "dtype"


def test_host_check_reference_agrees_with_stock_expert_select():
    """The numpy reference the kernel body is checked against selects what stock selects.

    The CPU's argpartition does not sort, so the order is compared on the GPU
    only; here the set of experts and the weight of each expert.
    """
    from mlx_vlm.models.glm5_next import language

    from glm53_patches.patches.router_select.checks.host_check import reference

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


# -- expert_combine -----------------------------------------------------------------------------


def test_other_models_moe_blocks_are_not_ours():
    from mlx_vlm.models.switch_layers import MoE

    from glm53_patches.patches.expert_combine.combine import combine_call

    class OtherMoE(MoE):
        pass

    before = expert_combine.PATCH.stats.snapshot()
    assert combine_call(OtherMoE(), mx.zeros((1, 1, 8)), (), None, {}) is None
    assert expert_combine.PATCH.stats.snapshot() == before  # not even counted


def test_combine_kernel_coverage():
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


def _pretend_gpu(monkeypatch, backend):
    """expert_combine on a pretend ``backend`` whose "kernel" is stock's own ``SwitchGLU._combine``.

    The kernel is GPU-only and its arithmetic is ``verify``'s, run on a GPU. With stock's combine in its
    place what a CPU test checks is the wiring around it: which calls it takes and what it does with
    them.
    """
    from mlx_vlm.models.switch_layers import SwitchGLU

    from glm53_patches.patches.expert_combine import combine

    monkeypatch.setattr(combine, "gpu_backend", lambda: backend)
    monkeypatch.setattr(combine, "expert_combine", lambda routed, weights, shared: SwitchGLU._combine(routed, weights, shared))
    return combine.switch.forcing(True)


@pytest.mark.parametrize("with_hc_decode", [False, True], ids=["stock-apply_branch", "hc_decode"])
def test_verify_blocks_take_the_combine_and_expand_the_residual(monkeypatch, with_hc_decode):
    """In speculative verify blocks the MoE gets the hyper-connection residual (from stock's
    apply_branch, or from hc_decode): the combine takes those calls and expands the residual as
    ``SwitchGLU._combine`` does; every block's logits and the cache after its rollback are stock's."""
    from test_layer_decode import assert_same

    from glm53_patches.exactness import cache_fields
    from glm53_patches.tiny_model import speculative_logits

    language_model = build_model(quantize_bits=4, seed=2).language_model
    rounds, names = 7, ["expert_combine", "hc_decode"] if with_hc_decode else ["expert_combine"]
    expected = speculative_logits(language_model, PROMPT, rounds)
    state = glm53_patches.enable(names, strict=True)
    assert all(state[name]["state"] == "applied" for name in names), state
    expert_combine.PATCH.stats.reset()
    with _pretend_gpu(monkeypatch, "cuda"):
        try:
            actual = speculative_logits(language_model, PROMPT, rounds)
        finally:
            glm53_patches.disable()
    for i, (a, b) in enumerate(zip(expected[0], actual[0], strict=True)):
        assert_same(a, b, f"logits {i}")
    for (path, a), (_, b) in zip(cache_fields(expected[1]), cache_fields(actual[1]), strict=True):
        assert_same(a, b, path)
    stats = expert_combine.PATCH.stats.snapshot()
    moe_layers = sum(cfg == "sparse" for cfg in language_model.model.config.mlp_layer_types)
    assert stats["hits"]["block"] == rounds * moe_layers, stats  # every block's MoE layers
    assert stats["hits"]["kernel"] == rounds * moe_layers, stats  # and every decode step's
    assert stats["fallbacks"] == {"not decode": moe_layers}, stats  # the prefill only


def test_metal_verify_blocks_go_to_stock(monkeypatch):
    """On Metal stock runs a short block's MoE through its own fused exact kernels: both patches step
    aside there (and still take single-token steps)."""
    from glm53_patches.tiny_model import speculative_logits

    language_model = build_model(quantize_bits=4, seed=2).language_model
    rounds = 3
    expected = speculative_logits(language_model, PROMPT, rounds)[0]
    glm53_patches.enable(["expert_combine", "hc_decode"], strict=True)
    expert_combine.PATCH.stats.reset()
    hc_decode.PATCH.stats.reset()
    monkeypatch.setattr(hc_sinkhorn, "gpu_backend", lambda: "metal")
    with _pretend_gpu(monkeypatch, "metal"):
        try:
            actual = speculative_logits(language_model, PROMPT, rounds)[0]
        finally:
            glm53_patches.disable()
    assert all(same_bits(a, b) for a, b in zip(expected, actual, strict=True))
    moe_layers = sum(cfg == "sparse" for cfg in language_model.model.config.mlp_layer_types)
    combine, hc = expert_combine.PATCH.stats.snapshot(), hc_decode.PATCH.stats.snapshot()
    assert combine["fallbacks"]["metal verify block"] == rounds * moe_layers, combine
    assert combine["hits"] == {"kernel": rounds * moe_layers}, combine
    assert hc["fallbacks"]["metal verify block"] == rounds * len(language_model.layers), hc
    assert "block" not in hc["hits"] and hc["hits"]["layer"] == rounds * len(language_model.layers), hc

"""fused_kda_kernel on the CPU: the kernel steps aside, bit for bit.

The patch is one GPU kernel (``glm53-patches verify fused_kda_kernel`` runs
it against stock on the H200 / a Mac; ``host_check.py`` runs its CUDA text
with g++). Here: what the CPU user gets (whatever is installed below it, bit
for bit, every call counted), revert, ``verify``, the coverage rules, and the
float32 parameters the kernel relies on in verify's models. The knob:
``test_kernel_switches.py``.
"""

import mlx.core as mx
import pytest

import glm53_patches
from glm53_patches.exactness import same_bits
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.compiled_kda_decode as compiled_kda_decode
import glm53_patches.patches.fused_kda_kernel as fused_kda_kernel

PROMPT = mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])
STEPS = 24


def kda_layers(language_model):
    return sum(t == "linear_attention" for t in language_model.model.config.layer_types)


@pytest.mark.parametrize("quantize_bits", [None, 4])
@pytest.mark.parametrize("below", [[], ["compiled_kda_decode"]])
def test_on_the_cpu_the_call_goes_below_bit_for_bit(quantize_bits, below):
    language_model = build_model(quantize_bits=quantize_bits, seed=2).language_model
    expected = greedy_logits(language_model, PROMPT, STEPS)
    state = glm53_patches.enable(below + ["fused_kda_kernel"], strict=True)
    assert state["fused_kda_kernel"]["state"] == "applied", state
    fused_before = fused_kda_kernel.PATCH.stats.snapshot()["fallbacks"].get("no GPU backend", 0)
    compiled_before = compiled_kda_decode.PATCH.stats.snapshot()["hits"].get("call", 0)
    actual = greedy_logits(language_model, PROMPT, STEPS)
    for a, b in zip(expected, actual):
        assert same_bits(a, b)
    calls = kda_layers(language_model) * (STEPS + 1)  # prefill + each step
    stats = fused_kda_kernel.PATCH.stats.snapshot()
    assert stats["fallbacks"]["no GPU backend"] - fused_before == calls
    assert "kernel" not in stats["hits"]
    compiled_hits = compiled_kda_decode.PATCH.stats.snapshot()["hits"].get("call", 0) - compiled_before
    assert compiled_hits == (kda_layers(language_model) * STEPS if below else 0)  # decode steps only


@pytest.mark.parametrize("length", [1, 3])
def test_speculative_blocks_go_below_where_the_kernel_runs(monkeypatch, length):
    """Where the kernel runs (a GPU backend, here pretended: reaching the kernel on the CPU fails),
    speculative blocks still go below it, since the kernel records no history for rollback;
    compiled_kda_decode below records it, bit for bit as stock."""
    from test_compiled_kda_decode import STOCK, assert_bitwise, make_layer, prefilled_pair

    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    glm53_patches.enable(["compiled_kda_decode", "fused_kda_kernel"], strict=True)
    from glm53_patches.patches.fused_kda_kernel import step

    monkeypatch.setattr(step, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(step.switch, "wanted", lambda backend: True)
    layer = make_layer()
    caches = prefilled_pair(layer, 1, None, mx.float32)
    x = mx.random.normal((1, length, 128))
    for cache in caches:
        cache.start_speculation(length)
    before = fused_kda_kernel.PATCH.stats.snapshot()["fallbacks"]
    assert_bitwise(STOCK(layer, x, None, caches[0]), Glm5NextLinearAttention.__call__(layer, x, None, caches[1]),
                   "output")
    for cache in caches:
        cache.commit_speculation([length - 1])
    assert_bitwise(caches[0][1], caches[1][1], "state after the commit")
    reason = "speculating" if length == 1 else "length"
    assert fused_kda_kernel.PATCH.stats.snapshot()["fallbacks"].get(reason, 0) == before.get(reason, 0) + 1


def test_revert_restores_the_original_object():
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    original = Glm5NextLinearAttention.__dict__["__call__"]
    glm53_patches.enable(["fused_kda_kernel"], strict=True)
    assert Glm5NextLinearAttention.__dict__["__call__"] is not original
    glm53_patches.disable(["fused_kda_kernel"])
    assert Glm5NextLinearAttention.__dict__["__call__"] is original


def test_verify_on_the_cpu():
    result = fused_kda_kernel.PATCH.verify()
    assert result["exact"] is True, result["detail"]
    assert result["cases"] == 4 and "steps aside" in result["detail"]


def test_kernel_coverage():
    from glm53_patches.patches.fused_kda_kernel.kernel import unsupported

    state = mx.zeros((2, 4, 64, 64))
    f32 = (mx.zeros((4,)), mx.zeros((256,)))
    conv = mx.zeros((768, 4, 1), mx.bfloat16)
    ok = dict(dtype=mx.bfloat16, state=state, heads=4, head_dim=64, lower_bound=-5.0, gate_params=f32, conv_weight=conv)
    for backend in ("cuda", "metal"):
        assert unsupported(**ok, backend=backend) is None
    assert unsupported(**ok, backend=None) == "no GPU backend"
    cases = {
        "dtype": [dict(dtype=mx.float32), dict(state=state.astype(mx.bfloat16)), dict(conv_weight=conv.astype(mx.float32))],
        "A_log / dt_bias not float32": [dict(gate_params=(f32[0].astype(mx.bfloat16), f32[1]))],
        "head dim": [dict(head_dim=60, state=mx.zeros((2, 4, 60, 60))), dict(head_dim=256)],
        "no lower bound (compute_g)": [dict(lower_bound=None)],
        "shape": [dict(heads=8), dict(conv_weight=mx.zeros((768, 4, 2), mx.bfloat16))],
    }
    for reason, changes in cases.items():
        for change in changes:
            assert unsupported(**{**ok, **change}, backend="cuda") == reason, change


def test_gpu_verify_models_are_served_as_converted():
    """verify's bf16 tiny model keeps what mlx-vlm's convert keeps in float32 (the kernel relies on it)."""
    from mlx.utils import tree_flatten

    from glm53_patches.exactness import _served_dtype

    model = _served_dtype(build_model(seed=1), mx.bfloat16)
    dtypes = dict((path, value.dtype) for path, value in tree_flatten(model.language_model.parameters()))
    assert dtypes["model.layers.0.self_attn.A_log"] == mx.float32
    assert dtypes["model.layers.0.self_attn.dt_bias"] == mx.float32
    assert dtypes["model.layers.0.attn_hc.fn"] == mx.float32
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == mx.bfloat16
    assert dtypes["model.layers.0.self_attn.o_norm.weight"] == mx.bfloat16

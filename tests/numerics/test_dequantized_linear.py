"""dequantized_linear on the CPU (fp32, the only dtype it takes here): bit for bit against stock.

Through the public enable(), on the tiny random-weight model quantized as
``convert`` does (4, 6 and 8 bits), with the chunk threshold lowered so its
prompts dequantize: logits of the prefill and of every greedy step, and every
cache array, on raw bits; batch 1, a batch of 2, and a cache resumed by a
second prefill. The expected hit counts come from the model itself: a counter
wrapped around glm5_next's ``linear`` records every quantized projection it
is handed.
"""

import collections
import contextlib
import logging

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm.models import linear as upstream
from mlx_vlm.models.glm5_next import language

import glm53_patches
from glm53_patches.bench.synthetic import cache_arrays
from glm53_patches.exactness import same_bits
from glm53_patches.tiny_model import build_model, greedy_logits

import glm53_patches.patches.dequantized_linear as dequantized_linear
from glm53_patches.patches.dequantized_linear import linear

PATCH = dequantized_linear.PATCH
PROMPT = mx.array([[(7 * i + 3) % 500 for i in range(80)]])
BELOW = "chunk below GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS"


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_FAST_PATH", "1")
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS", "16")
    linear.clear()
    yield
    glm53_patches.disable([PATCH.name])
    linear.clear()


@contextlib.contextmanager
def projections():
    """Whatever glm5_next's ``linear`` is now, wrapped by a counter: (module type, tokens) -> calls."""
    installed, seen = language.linear, collections.Counter()

    def counting(module, x):
        seen[type(module).__name__, x.shape[1]] += 1
        return installed(module, x)

    language.linear = counting
    try:
        yield seen
    finally:
        language.linear = installed


def run(language_model, tokens, steps, resume=None):
    """Greedy logits and the final cache arrays (``resume``: a first prefill before ``tokens``)."""
    cache = language_model.make_cache()
    if resume is not None:
        mx.eval(language_model(resume, cache=cache).logits)
    return greedy_logits(language_model, tokens, steps, cache=cache), cache_arrays(cache)


def assert_same(expected, actual):
    for group_expected, group_actual in zip(expected, actual):
        assert len(group_expected) == len(group_actual) > 0
        assert all(same_bits(a, b) for a, b in zip(group_expected, group_actual))


def counts():
    snapshot = PATCH.stats.snapshot()
    return collections.Counter(snapshot["hits"]), collections.Counter(snapshot["fallbacks"])


def hits():
    return PATCH.stats.snapshot()["hits"].get("dequantized", 0)


@pytest.mark.parametrize("quantize_bits", [4, 6, 8])
@pytest.mark.parametrize("case", ["batch 1", "batch 2", "resumed"])
def test_bit_for_bit_with_stock(fast_path, quantize_bits, case):
    """Logits and caches equal stock's bits, every prefill projection dequantized, no decode step."""
    language_model = build_model(quantize_bits=quantize_bits, seed=3).language_model
    tokens, resume = PROMPT, None
    if case == "batch 2":
        tokens = mx.concatenate([PROMPT, PROMPT[:, ::-1]])
    if case == "resumed":
        tokens, resume = PROMPT[:, 40:], PROMPT[:, :40]
    with projections() as seen:  # stock, counted
        expected = run(language_model, tokens, 12, resume)
    prefill = seen["QuantizedLinear", tokens.shape[1]]  # the resumed case: both prefills are 40 tokens
    assert prefill > 0 and seen["QuantizedLinear", 1] > 0 and sum(seen.values()) == prefill + seen["QuantizedLinear", 1]
    assert glm53_patches.enable([PATCH.name], strict=True)[PATCH.name]["state"] == "applied"
    before = hits()
    actual = run(language_model, tokens, 12, resume)
    assert_same(expected, actual)
    assert hits() - before == prefill  # every prefill projection, none of the decode steps'


@pytest.mark.parametrize("first", ["exact_qmv", "dequantized_linear"])
def test_composes_with_exact_qmv(fast_path, first):
    """Both wrap glm5_next's linear: in either order stock's bits, and dequantized_linear still serves prefill."""
    from glm53_patches.patches import exact_qmv

    language_model = build_model(quantize_bits=6, seed=4).language_model
    with projections() as seen:
        expected = run(language_model, PROMPT, 6)
    second = PATCH.name if first == "exact_qmv" else "exact_qmv"
    for name in (first, second):
        assert glm53_patches.enable([name], strict=True)[name]["state"] == "applied"
    before, qmv_before = hits(), exact_qmv.PATCH.stats.snapshot()["fallbacks"].get("not CUDA", 0)
    actual = run(language_model, PROMPT, 6)
    assert_same(expected, actual)
    assert hits() - before == seen["QuantizedLinear", PROMPT.shape[1]]
    qmv = exact_qmv.PATCH.stats.snapshot()  # it steps aside at every decode call (tiled_linear's too)
    assert not qmv["hits"] and qmv["fallbacks"]["not CUDA"] - qmv_before >= seen["QuantizedLinear", 1] > 0
    glm53_patches.disable([PATCH.name, "exact_qmv"])
    assert language.linear is upstream.linear


def test_fallbacks_are_counted_by_reason(fast_path):
    """A short chunk, bf16 on the CPU and unquantized weights each stay stock, counted once per projection."""
    quantized = build_model(quantize_bits=4, seed=3).language_model
    bf16 = build_model(quantize_bits=4, seed=3)
    bf16.set_dtype(mx.bfloat16)  # scales and activations in bf16: unverified on the CPU
    cases = [(quantized, PROMPT[:, :12], BELOW, "QuantizedLinear"),  # 12 tokens, above a decode block, < 16
             (bf16.language_model, PROMPT, "dtype", "QuantizedLinear"),
             (build_model(seed=3).language_model, PROMPT, "not a QuantizedLinear", "Linear")]
    for model, tokens, reason, kind in cases:
        expected = greedy_logits(model, tokens, 0)
        glm53_patches.enable([PATCH.name], strict=True)
        hits_before, fallbacks_before = counts()
        with projections() as seen:
            actual = greedy_logits(model, tokens, 0)
        hits_after, fallbacks_after = counts()
        glm53_patches.disable([PATCH.name])
        assert same_bits(expected[0], actual[0]), reason
        assert hits_after == hits_before, reason
        assert fallbacks_after - fallbacks_before == {reason: seen[kind, tokens.shape[1]]} and seen[kind, tokens.shape[1]] > 0


def test_decode_steps_and_speculative_blocks_are_not_counted(fast_path, monkeypatch):
    """Calls of one token and blocks up to mlx-vlm's decode block size are neither hits nor fallbacks."""
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS", "1")  # the threshold cannot be what leaves them
    linear.clear()
    language_model = build_model(quantize_bits=4, seed=3).language_model
    glm53_patches.enable([PATCH.name], strict=True)
    cache = language_model.make_cache()
    mx.eval(language_model(PROMPT[:, :40], cache=cache).logits)
    before = PATCH.stats.snapshot()
    block = upstream.DECODE_BLOCK_SIZE
    with projections() as seen:
        for tokens in (PROMPT[:, 40:41], PROMPT[:, 41:41 + block], PROMPT[:, 41 + block:42 + block]):
            mx.eval(language_model(tokens, cache=cache).logits)
        assert seen["QuantizedLinear", 1] > 0 and seen["QuantizedLinear", block] > 0
        assert PATCH.stats.snapshot() == before
        mx.eval(language_model(PROMPT[:, 50:51 + block], cache=cache).logits)  # one token past a block
    assert hits() - before["hits"].get("dequantized", 0) == seen["QuantizedLinear", block + 1] > 0


def test_auto_without_a_verify_record_keeps_stock(monkeypatch):
    """auto is the default, and with no verify record it runs stock on the CPU and CUDA; 1 forces it on."""
    linear.clear()
    assert linear.switch.wanted("cpu") is False and linear.switch.wanted("cuda") is False
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_FAST_PATH", "0")
    linear.clear()
    assert linear.switch.wanted("cpu") is False
    monkeypatch.setenv("GLM53_DEQUANTIZED_LINEAR_FAST_PATH", "1")
    linear.clear()
    assert all(linear.switch.wanted(b) for b in ("cpu", "cuda", "metal"))
    linear.clear()


def test_auto_without_a_verify_record_runs_stock_in_the_model():
    """Enabled with no knob and no record, the model's prefill is counted as off on this backend."""
    linear.clear()
    language_model = build_model(quantize_bits=4, seed=3).language_model
    glm53_patches.enable([PATCH.name], strict=True)
    before = counts()
    with projections() as seen:
        greedy_logits(language_model, PROMPT, 0)
    hits_after, fallbacks_after = counts()
    assert hits_after == before[0]
    assert fallbacks_after - before[1] == {"off on this backend (GLM53_DEQUANTIZED_LINEAR_FAST_PATH)":
                                           seen["QuantizedLinear", PROMPT.shape[1]]}
    linear.clear()


def test_auto_takes_a_verify_record_on_cuda_only(monkeypatch, tmp_path):
    """A passed verify record turns auto on where dequantizing was measured faster: CUDA, not the CPU or Metal."""
    from glm53_patches import verify_records

    monkeypatch.setenv("GLM53_PATCHES_STATE_DIR", str(tmp_path))
    for backend in ("cpu", "cuda", "metal"):
        verify_records.record(PATCH.name, backend, {"passed": True, "exact": True})
    linear.clear()
    assert linear.switch.wanted("cuda")
    assert not linear.switch.wanted("cpu")  # slower than quantized_matmul there
    assert not linear.switch.wanted("metal")  # its speed there is unmeasured
    linear.clear()


@pytest.mark.parametrize("variable, value", [("GLM53_DEQUANTIZED_LINEAR_FAST_PATH", "sometimes"),
                                             ("GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS", "many"),
                                             ("GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS", "0")])
def test_bad_values_are_named_and_change_nothing(monkeypatch, caplog, variable, value):
    """A bad knob is logged naming its variable and what it accepts, and what is unset holds."""
    from glm53_patches.log import forget

    def setting():
        linear.clear()
        return linear.switch.wanted("cpu") if variable.endswith("FAST_PATH") else linear.min_tokens()

    unset = setting()
    monkeypatch.setenv(variable, value)
    forget()  # a line said earlier in this process is said again
    with caplog.at_level(logging.ERROR, logger="glm53_patches"):
        assert setting() == unset
    assert variable in caplog.text and "accepted" in caplog.text
    if variable.endswith("FAST_PATH"):
        assert "its fast path stays off" in caplog.text  # not "the kernel": this patch has none
    linear.clear()


def test_revert_restores_the_original_object():
    """disable() puts back the very object mlx-vlm's glm5_next imported."""
    original = language.linear
    assert original is upstream.linear
    glm53_patches.enable([PATCH.name], strict=True)
    assert language.linear is not original and language.linear.__wrapped__ is original
    glm53_patches.disable([PATCH.name])
    assert language.linear is original


def test_verify_is_exact_on_the_cpu():
    """The module's own verify passes here (and its model check ran the dequantized path)."""
    from glm53_patches.patches.dequantized_linear.checks.verify import verify

    result = verify()
    assert result["exact"] and result["cases"] > 0, result["detail"]
    assert all(r["result"] == "exact" for r in result["case_results"])


def test_verify_catches_a_dequantized_weight_off_by_a_little(monkeypatch):
    """With the dequantized weight nudged by 1e-6 verify must report not exact: the check can fail."""
    from glm53_patches.patches.dequantized_linear.checks.verify import verify

    class Nudged:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def dequantize(*args, **kwargs):
            return mx.dequantize(*args, **kwargs) + 1e-6

    monkeypatch.setattr(linear, "mx", Nudged())
    result = verify()
    assert not result["exact"] and "MISMATCH" in result["detail"], result["detail"]
    assert any(r["result"] == "differs" and "tiny model" in r["case"] for r in result["case_results"])
    assert any(r["result"] == "differs" and "rows" in r["case"] for r in result["case_results"])


def test_cuda_takes_only_what_its_verify_covers():
    """On CUDA: half dtypes, 1,024 rows or more (batch folded in), and no projection narrower than s30's H200 allowed."""
    def quantized(out_dims, in_dims):
        module = nn.QuantizedLinear(in_dims, out_dims, bias=False, group_size=64, bits=6)
        module.update({k: module[k].astype(mx.bfloat16) for k in ("scales", "biases")})
        return module

    linear.clear()
    rows = linear.min_tokens()
    x = lambda batch, tokens, width, dtype=mx.bfloat16: mx.zeros((batch, tokens, width), dtype=dtype)  # noqa: E731
    narrowest_out, narrowest_in = linear.NARROWEST["cuda"]
    assert linear.unsupported(quantized(narrowest_out, narrowest_in), x(1, rows, narrowest_in), "cuda") is None
    assert linear.unsupported(quantized(narrowest_out, narrowest_in), x(2, rows // 2, narrowest_in), "cuda") is None
    assert linear.unsupported(quantized(narrowest_out, narrowest_in), x(1, rows - 1, narrowest_in), "cuda") == BELOW
    assert linear.unsupported(quantized(narrowest_out - 64, 4096), x(1, rows, 4096), "cuda") == "narrow projection"
    assert linear.unsupported(quantized(4096, narrowest_in // 2), x(1, rows, narrowest_in // 2), "cuda") == "narrow projection"
    assert linear.unsupported(quantized(4096, 4096), x(1, rows, 4096, mx.float32), "cuda") == "dtype"
    assert linear.unsupported(quantized(4096, 4096), x(1, rows, 4096), "cpu") == "dtype"  # half types: not exact there

"""exact_qmv on the CPU: the wrapper steps aside, and routes exactly the decode projections it covers.

The patch is one CUDA kernel behind glm5_next's ``linear`` and ``tiled_linear``
(``glm53-patches verify exact_qmv`` runs it against MLX's qmv on the H200;
``tests/metal/test_cuda_unchanged.py`` pins its text to what passed there).
There is no CUDA here, so:

* what the CPU user gets: stock, bit for bit, every decode call counted as
  "not CUDA"; revert; ``verify`` (it must say the patch steps aside);
* the coverage rules (``linear.unsupported``) on real ``QuantizedLinear``
  modules: which calls the kernel takes, and the reason for each it leaves;
* with CUDA pretended and the kernel replaced by a recorder that runs stock's
  ``quantized_matmul`` on what it is handed: the tiny 6-bit model's logits
  stay bit for bit, so the wrapper hands the kernel each module's own weight,
  scales, biases, bits and group size and adds its bias; only one-token calls
  reach it, and every 6-bit projection of a decode step does.

Exact means bit-identical: every comparison is on the raw bits.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

import glm53_patches
from glm53_patches.exactness import same_bits
from glm53_patches.patches import exact_qmv
from glm53_patches.patches.exact_qmv import kernel, linear
from glm53_patches.tiny_model import build_model, greedy_logits

NAME = "exact_qmv"
PROMPT = mx.array([[3, 17, 42, 99, 100, 7, 8, 200, 31, 64, 77, 5]])
STEPS = 6


def assert_bitwise(expected, actual, what):
    assert len(expected) == len(actual), what
    for i, (a, b) in enumerate(zip(expected, actual)):
        assert same_bits(a, b), f"{what} [{i}] differs (dtype, shape or bits)"


def counts():
    snapshot = exact_qmv.PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def six_bit_model():
    """The tiny model at 6 bits, served in bf16 (the kernel's dtypes), every quantized width 128 (as on a GPU)."""
    from glm53_patches.exactness import _served_dtype
    from glm53_patches.tiny_model import gpu_widths

    return _served_dtype(build_model(seed=2, quantize_bits=6, **gpu_widths()), mx.bfloat16).language_model


def quantized(out_dims, in_dims, bits=6, group=64, dtype=mx.bfloat16, bias=False):
    layer = nn.Linear(in_dims, out_dims, bias=bias)
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)


@pytest.fixture
def applied():
    glm53_patches.disable()
    exact_qmv.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    yield
    glm53_patches.disable()


def test_on_the_cpu_stock_runs_bit_for_bit():
    model = six_bit_model()
    glm53_patches.disable()
    expected = greedy_logits(model, PROMPT, STEPS)
    exact_qmv.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    try:
        actual = greedy_logits(model, PROMPT, STEPS)
    finally:
        glm53_patches.disable()
    assert_bitwise(expected, actual, "6-bit tiny model, exact_qmv applied on the CPU")
    hits, fallbacks = counts()
    assert not hits
    assert fallbacks.get("not CUDA", 0) >= STEPS  # every decode step's projections were offered, and declined


def test_revert_restores_the_original_object():
    from mlx_vlm.models import linear as upstream
    from mlx_vlm.models.glm5_next import language

    glm53_patches.disable()
    originals = (language.linear, language.tiled_linear)
    assert originals == (upstream.linear, upstream.tiled_linear)
    glm53_patches.enable([NAME])
    try:
        assert (language.linear, language.tiled_linear) != originals
        assert language.linear.__wrapped__ is originals[0] and language.tiled_linear.__wrapped__ is originals[1]
    finally:
        glm53_patches.disable()
    assert (language.linear, language.tiled_linear) == originals


def test_coverage():
    x = mx.zeros((1, 1, 256), mx.bfloat16)
    assert linear.unsupported(quantized(512, 256), x) is None
    assert linear.unsupported(quantized(512, 256, bits=3), x) is None
    assert linear.unsupported(quantized(512, 256, bits=5), x) is None
    assert linear.unsupported(quantized(512, 256, bias=True), x) is None  # its bias is added after the kernel
    assert linear.unsupported(quantized(512, 256, bits=4), x) == "4-bit (stock's qmv is as fast)"
    assert linear.unsupported(quantized(512, 256, bits=8), x) == "8-bit (stock's qmv is as fast)"
    assert linear.unsupported(quantized(512, 256, dtype=mx.float32), x.astype(mx.float32)) == "dtype"
    assert linear.unsupported(quantized(512, 256), x.astype(mx.float16)) == "dtype"  # scales in bf16
    assert linear.unsupported(quantized(512, 256, group=128), mx.zeros((1, 1, 128), mx.bfloat16)) == "shape"
    assert linear.unsupported(quantized(512, 128, group=128), mx.zeros((1, 1, 128), mx.bfloat16)) == "width"
    assert linear.unsupported(quantized(512, 256), mx.zeros((7, 1, 256), mx.bfloat16)) is None
    assert linear.unsupported(quantized(512, 256), mx.zeros((8, 1, 256), mx.bfloat16)) == "rows"
    assert linear.unsupported(nn.Linear(256, 512), x) == "module type"
    mxfp4 = nn.QuantizedLinear.from_linear(nn.Linear(256, 512), group_size=32, bits=4, mode="mxfp4")
    assert linear.unsupported(mxfp4, x) == "quantization"


def test_only_one_token_calls_are_offered(applied):
    """Prefill and speculative blocks go to the installed function without a count: they are not this patch's."""
    layer = quantized(512, 256)
    for shape in ((1, 2, 256), (1, 16, 256), (2, 256)):
        assert linear.project(layer, mx.zeros(shape, mx.bfloat16)) is None
    assert counts() == ({}, {})
    assert linear.project(layer, mx.zeros((1, 1, 256), mx.bfloat16)) is None
    assert counts() == ({}, {"not CUDA": 1})


def test_where_the_kernel_runs_it_gets_stocks_arguments(monkeypatch):
    """CUDA pretended; the "kernel" records what it is handed and returns stock's quantized_matmul on it."""
    model = six_bit_model()
    glm53_patches.disable()
    expected = greedy_logits(model, PROMPT, STEPS)

    seen = []

    def recorder(x, w, scales, biases, bits_, group_size):
        seen.append((x.shape, w.shape, bits_, group_size))
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits_)

    monkeypatch.setattr(linear, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kernel, "qmv", recorder)
    exact_qmv.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    try:
        with linear.switch.forcing(True):
            actual = greedy_logits(model, PROMPT, STEPS)
    finally:
        glm53_patches.disable()
    assert_bitwise(expected, actual, "6-bit tiny model, the kernel's calls answered by stock's quantized_matmul")
    assert seen and all(shape[1] == 1 for shape, *_ in seen), "only one-token calls reach the kernel"
    assert {(b, g) for *_, b, g in seen} == {(6, 64)}
    hits, fallbacks = counts()
    assert hits["kernel"] == len(seen)
    # Each decode step (the prompt's last token starts them) offers the same projections.
    per_step, rest = divmod(len(seen), STEPS)
    assert per_step > 0 and rest == 0
    assert set(fallbacks) <= {"module type", "shape", "width"}  # the only calls a 6-bit model leaves to stock


def test_verify_on_the_cpu():
    result = exact_qmv.PATCH.verify()
    assert result["exact"] and result["cases"] == 8, result["detail"]
    assert "steps aside" in result["detail"]


@pytest.mark.parametrize("width", kernel.BITS)
def test_mlx_packs_weights_as_the_kernel_unpacks_them(width):
    """The kernel reads value i of a row at bits [i * width, (i + 1) * width) of its bytes, little-endian
    (cutlass's arrays at 2, 4 and 8 bits, its own unpacking at 3, 5 and 6): MLX's quantize must pack so."""
    import numpy as np

    w = mx.random.normal((3, 256), key=mx.random.key(width))
    packed, scales, biases = mx.quantize(w, group_size=64, bits=width)
    expected = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=width))
    stream = np.unpackbits(np.array(packed).view(np.uint8), axis=-1, bitorder="little")
    values = stream.reshape(3, 256, width) @ (1 << np.arange(width))
    assert values.max() < (1 << width)
    rebuilt = values * np.repeat(np.array(scales), 64, -1) + np.repeat(np.array(biases), 64, -1)
    np.testing.assert_allclose(rebuilt, expected, rtol=0, atol=1e-5)

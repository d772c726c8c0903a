"""block_qmv on the CPU: the wrapper steps aside, and routes exactly the block projections stock computes
through its singleton (gather_qmv) path.

The patch is one kernel (a CUDA one and a Metal twin) behind glm5_next's
``linear`` and ``tiled_linear`` (``glm53-patches verify block_qmv`` runs it
against stock's block projection on a GPU; ``tests/metal/test_cuda_unchanged.py``
pins its CUDA text and launches, ``tests/metal`` type-checks and emulates the
Metal twin). There is no GPU here, so:

* what the CPU user gets: stock, bit for bit, in speculative verify blocks,
  every block call counted as "no GPU"; revert, also stacked on exact_qmv;
  ``verify`` (it must say the patch steps aside);
* the coverage rules (``linear.unsupported``) on real ``QuantizedLinear``
  modules: which calls the kernel takes, and the reason for each it leaves;
* with CUDA or Metal pretended and the kernel replaced by a recorder that runs stock's
  own call on what it is handed (``gather_qmm`` over the positions, or a
  one-row ``quantized_matmul`` per position at a width that is not a multiple
  of 512): the tiny model's verify blocks stay bit for bit, so the wrapper
  hands the kernel each module's weight, scales, biases, bits and group size,
  the block's rows in order, and shapes the result as stock does; blocks of 2
  to 7 positions reach it, and of 8 on CUDA at the narrower widths.

The tiny model here has a hidden size of 512 and is served in bf16: the
singleton path takes 16-bit inputs whose width is a multiple of 512; its
narrower quantized projections (128 and 256 wide) stock runs as one call per
position, which the kernel takes on CUDA only.
"""

import mlx.core as mx
import mlx.nn as nn
import pytest

import glm53_patches
from glm53_patches.patches import block_qmv
from glm53_patches.patches.block_qmv import kernel, linear
from glm53_patches.tiny_model import build_model, speculative_outputs
from test_exact_qmv import assert_bitwise  # the same bit-for-bit list comparison

NAME = "block_qmv"
PROMPT = mx.array([[(5 * i + 2) % 500 for i in range(24)]])


def counts():
    snapshot = block_qmv.PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


@pytest.fixture(scope="module")
def model():
    """The tiny model at 4 bits, served in bf16, its hidden size 512 and every other quantized width 128."""
    from glm53_patches.exactness import _served_dtype
    from glm53_patches.tiny_model import gpu_widths

    config = {**gpu_widths(), "hidden_size": 512}
    return _served_dtype(build_model(seed=2, quantize_bits=4, **config), mx.bfloat16).language_model


@pytest.fixture(scope="module")
def stock_outputs(model):
    glm53_patches.disable()
    return speculative_outputs(model, PROMPT)


def quantized(out_dims, in_dims, bits=8, group=64, dtype=mx.bfloat16, bias=False):
    layer = nn.Linear(in_dims, out_dims, bias=bias)
    layer.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)


@pytest.fixture
def applied():
    glm53_patches.disable()
    block_qmv.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    yield
    glm53_patches.disable()


def test_on_the_cpu_stock_runs_bit_for_bit(model, stock_outputs, applied):
    actual = speculative_outputs(model, PROMPT)
    assert_bitwise(stock_outputs, actual, "verify blocks, block_qmv applied on the CPU")
    hits, fallbacks = counts()
    assert not hits
    assert fallbacks.get("no GPU", 0) >= 7  # every block's projections were offered, and declined


def test_revert_restores_the_original_object():
    """Alone, and stacked on exact_qmv (which wraps the same two functions for one-token calls)."""
    from mlx_vlm.models import linear as upstream
    from mlx_vlm.models.glm5_next import language

    glm53_patches.disable()
    originals = (language.linear, language.tiled_linear)
    assert originals == (upstream.linear, upstream.tiled_linear)
    for names in ([NAME], ["exact_qmv", NAME]):
        glm53_patches.enable(names)
        try:
            assert (language.linear, language.tiled_linear) != originals
            wrapped = language.linear
            while hasattr(wrapped, "__wrapped__"):
                wrapped = wrapped.__wrapped__
            assert wrapped is originals[0]
        finally:
            glm53_patches.disable()
        assert (language.linear, language.tiled_linear) == originals


def test_coverage():
    x = mx.zeros((1, 4, 512), mx.bfloat16)
    assert linear.unsupported(quantized(256, 512), x) is None
    for bits in (2, 3, 4, 5, 6):
        assert linear.unsupported(quantized(256, 512, bits=bits), x) is None
    assert linear.unsupported(quantized(256, 512, bias=True), x) is None  # its bias is added after the kernel
    assert linear.unsupported(quantized(256, 512, group=32), x) is None
    assert linear.unsupported(quantized(256, 512), mx.zeros((1, 7, 512), mx.bfloat16)) is None
    assert linear.unsupported(quantized(256, 512), mx.zeros((1, 8, 512), mx.bfloat16)) == "positions"
    assert linear.unsupported(quantized(256, 512), mx.zeros((2, 4, 512), mx.bfloat16)) == "batch"
    assert linear.unsupported(quantized(256, 512, dtype=mx.float32), x.astype(mx.float32)) == "dtype"
    assert linear.unsupported(quantized(256, 512), x.astype(mx.float16)) == "dtype"  # scales in bf16
    # Other widths: stock runs each position as its own call, CUDA's one-row qmv (at 8 positions too)
    # where a row holds more than one group
    for width, group in ((768, 64), (128, 64), (256, 128)):
        for positions in (2, 8):
            block = mx.zeros((1, positions, width), mx.bfloat16)
            assert linear.unsupported(quantized(256, width, group=group), block) is None
            assert linear.unsupported(quantized(256, width, group=group), block, "metal") == "width"
    assert linear.unsupported(quantized(256, 128, group=128), mx.zeros((1, 4, 128), mx.bfloat16)) == "width"
    assert linear.unsupported(quantized(256, 1024), x) == "shape"
    assert linear.unsupported(nn.Linear(512, 256), x) == "module type"
    mxfp4 = nn.QuantizedLinear.from_linear(nn.Linear(512, 256), group_size=32, bits=4, mode="mxfp4")
    assert linear.unsupported(mxfp4, x) == "quantization"
    # Metal: stock's gather_qmv_fast (the twin's order) wants the rows a multiple of 8
    assert linear.unsupported(quantized(256, 512), x, "metal") is None
    assert linear.unsupported(quantized(260, 512), x, "metal") == "rows"
    assert linear.unsupported(quantized(260, 512), x, "cuda") is None


def test_only_block_calls_are_offered(applied):
    """One token, prefill, 2-D inputs and a module in training (stock's linear calls it directly) go to
    the installed function without a count: they are not this patch's calls."""
    layer = quantized(256, 512)
    assert layer.training and linear.project(layer, mx.zeros((1, 4, 512), mx.bfloat16)) is None
    layer.eval()
    for shape in ((1, 1, 512), (1, 9, 512), (1, 300, 512), (4, 512)):
        assert linear.project(layer, mx.zeros(shape, mx.bfloat16)) is None
    assert counts() == ({}, {})
    assert linear.project(layer, mx.zeros((1, 2, 512), mx.bfloat16)) is None
    assert counts() == ({}, {"no GPU": 1})


def test_without_mlx_metal_headers_metal_leaves_it_to_stock(monkeypatch, applied):
    """The Metal twin calls the installed MLX's own qdot and load_vector: where its headers are missing the
    call goes to stock, counted, even with the kernel forced on."""
    from glm53_patches.kernels import mlx_metal

    assert kernel.metal_header() is not None and "inline U qdot(" in kernel.metal_header()
    monkeypatch.setattr(mlx_metal, "HEADERS", mlx_metal.HEADERS / "missing")
    monkeypatch.setattr(linear, "gpu_backend", lambda: "metal")
    kernel.metal_header.cache_clear()
    try:
        layer = quantized(256, 512)
        layer.eval()
        with linear.switch.forcing(True):
            assert linear.project(layer, mx.zeros((1, 3, 512), mx.bfloat16)) is None
        assert counts() == ({}, {"no MLX Metal headers": 1})
    finally:
        kernel.metal_header.cache_clear()


def test_the_kernel_reads_the_block_in_place(monkeypatch):
    """The kernel is handed a view of the block's rows. MLX indexes with an integer (``x[0]``) through
    ``take``: a Gather, one more kernel per projection for the thread to encode (s44's layer probe: 293
    of them in a verify block)."""
    from glm53_patches.bench import measure

    seen = []

    def recorder(x, w, scales, biases, bits, group_size, backend):
        seen.append(measure.count_primitives([x])["by_primitive"])
        return mx.zeros((x.shape[0], w.shape[0]), x.dtype)

    monkeypatch.setattr(linear, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kernel, "block_qmv", recorder)
    layer = quantized(256, 512)
    layer.eval()
    block = mx.zeros((1, 3, 512), mx.bfloat16)
    mx.eval(block)
    with linear.switch.forcing(True):
        assert linear.project(layer, block).shape == (1, 3, 256)
    assert seen == [{"Squeeze": 1}]


def run_pretending(monkeypatch, model, names, backend="cuda"):
    """The verify blocks with ``names`` applied (their counters reset) and the kernel forced on, ``backend``
    pretended for the wrapper; the "kernel" records what it is handed and returns stock's own singleton
    gather (``singleton_quantized_linear``'s ``gather_qmm``) on it. Returns the outputs and the record."""
    from glm53_patches import registry

    seen = []

    def recorder(x, w, scales, biases, bits, group_size, backend):
        seen.append((x.shape, w.shape, backend, bits, group_size))
        if x.shape[1] % 512:  # stock's exact_quantized_linear: a one-row call per position
            return mx.concatenate([mx.quantized_matmul(row[None], w, scales, biases, transpose=True,
                                                       group_size=group_size, bits=bits) for row in x])
        indices = mx.zeros((1, x.shape[0], 1), dtype=mx.int32)
        out = mx.gather_qmm(x[None, :, None, None], w[None], scales[None], biases[None], rhs_indices=indices,
                            transpose=True, group_size=group_size, bits=bits, sorted_indices=False)
        return out.reshape(x.shape[0], -1)

    monkeypatch.setattr(linear, "gpu_backend", lambda: backend)
    monkeypatch.setattr(kernel, "block_qmv", recorder)
    for name in names:
        registry.available()[name].stats.reset()
    glm53_patches.enable(names, strict=True)
    try:
        with linear.switch.forcing(True):
            return speculative_outputs(model, PROMPT), seen
    finally:
        glm53_patches.disable()


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_where_the_kernel_runs_it_gets_stocks_arguments(monkeypatch, model, stock_outputs, backend):
    actual, seen = run_pretending(monkeypatch, model, [NAME], backend)
    assert_bitwise(stock_outputs, actual, "verify blocks, the kernel's calls answered by stock's own calls")
    gathered = {shape[0] for shape, *_ in seen if shape[1] == 512}
    assert gathered == set(range(2, 8)), "blocks of 2 to 7 positions reach it on the gather path"
    # the narrower projections (stock: a qmv per position) on CUDA only, at 8 positions too
    per_position = {shape[0] for shape, *_ in seen if shape[1] != 512}
    assert per_position == (set(range(2, 9)) if backend == "cuda" else set())
    assert {tuple(rest) for _, _, *rest in seen} == {(backend, 4, 64)}
    hits, fallbacks = counts()
    assert hits["kernel"] == len(seen)
    assert fallbacks["positions"] > 0  # the 8-position block: stock's gather takes its GEMM there
    # on Metal also "rows": the lm_head's 500 (stock's plain gather_qmv there)
    allowed = {"positions", "width", "module type", "shape"} | ({"rows"} if backend == "metal" else set())
    assert set(fallbacks) <= allowed


def test_layer_decode_traces_it_into_its_blocks(monkeypatch, model, stock_outputs):
    """With layer_decode (which names block_qmv among the patches it composes) every verify block of
    2 to 7 positions runs as layer_decode's compiled layers with the wrapper traced inside them."""
    from glm53_patches.patches import layer_decode

    actual, seen = run_pretending(monkeypatch, model, [NAME, "layer_decode"])
    assert_bitwise(stock_outputs, actual, "verify blocks, layer_decode with block_qmv traced in")
    layers = layer_decode.PATCH.stats.snapshot()
    assert "block_qmv patches linear" not in layers["fallbacks"]
    assert layers["hits"]["kda block"] > 0 and layers["hits"]["dsa block"] > 0
    assert seen and {shape[0] for shape, *_ in seen} <= set(range(2, 9))  # traced once per layer kind and shape


def test_verify_on_the_cpu():
    result = block_qmv.PATCH.verify()
    assert result["exact"] and result["cases"] == 8, result["detail"]
    assert "steps aside" in result["detail"]

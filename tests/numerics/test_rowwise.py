"""``glm53_patches.kernels.rowwise``: a short block's dense per-position matvecs as one batched gemv.

Whether its bits are each position's own call's is a property of MLX's CUDA
``Matmul`` dispatch: ``verify hc_decode`` and ``verify router_select`` compare
it with stock's path on a GPU. Here, on the CPU, it must compute ``x @ w.T``
(to float32 rounding: the CPU's BLAS sums in its own order), apply only
where stock goes position by position on CUDA, and be what hc_decode's mix
and router_select's logits take there, with the module's own weight.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.glm5_next import language as _lang
from mlx_vlm.models.linear import tokenwise

from glm53_patches import tiny_model
from glm53_patches.kernels import rowwise
from glm53_patches.patches.hc_decode import layer as hc_layer
from glm53_patches.patches.router_select import gate


def _normal(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


@pytest.mark.parametrize("length", [2, 4, 8])
def test_matvecs_is_the_blocks_matmul(length):
    x, w = _normal((1, length, 512), 1), _normal((24, 512), 2)
    out = rowwise.block_matvecs(x, w)
    assert out.shape == (1, length, 24)
    expected = tokenwise(lambda part: part @ w.T, x)  # stock's per-position calls
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-5, atol=1e-4)


def test_only_a_cuda_block_at_batch_1():
    block = mx.zeros((1, 4, 64))
    assert rowwise.block_on_cuda(block, "cuda")
    assert rowwise.block_on_cuda(mx.zeros((1, 8, 64)), "cuda")
    assert not rowwise.block_on_cuda(mx.zeros((1, 1, 64)), "cuda")  # a decode token: stock's own single call
    assert not rowwise.block_on_cuda(mx.zeros((1, 9, 64)), "cuda")  # past DECODE_BLOCK_SIZE: stock's tiled path
    assert not rowwise.block_on_cuda(mx.zeros((2, 4, 64)), "cuda")  # batch 2: stock's one matmul over B x L rows
    assert not any(rowwise.block_on_cuda(block, backend) for backend in ("metal", None))


@pytest.fixture
def cuda(monkeypatch):
    """CUDA pretended where hc_decode asks for the backend (nothing here launches a kernel)."""
    monkeypatch.setattr(hc_layer.hc_sinkhorn, "gpu_backend", lambda: "cuda")


@pytest.fixture(scope="module")
def layer():
    model = tiny_model.build_model(seed=0)
    return next(layer for layer in model.language_model.model.layers if isinstance(layer.mlp, _lang.Glm5NextMoE))


def _spy(monkeypatch, module):
    """Records the calls of ``block_matvecs`` made through ``module``."""
    calls = []
    monkeypatch.setattr(module, "block_matvecs", lambda x, w: calls.append((x, w)) or rowwise.block_matvecs(x, w))
    return calls


@pytest.mark.parametrize("shape, taken", [((1, 4), True), ((1, 1), False), ((2, 4), False)])
def test_hc_decode_mix_takes_it_for_a_cuda_block(cuda, monkeypatch, layer, shape, taken):
    hc = layer.attn_hc
    z = _normal((*shape, hc.fn.shape[1]), 3)
    calls = _spy(monkeypatch, hc_layer)
    out = hc_layer.mix(hc, z)
    assert len(calls) == taken and (not taken or calls[0][1] is hc.fn)
    np.testing.assert_allclose(np.array(out), np.array(hc._mix(z)), rtol=1e-5, atol=1e-4)


def test_hc_decode_mix_leaves_a_replaced_mix_alone(cuda, monkeypatch, layer):
    hc = layer.attn_hc
    monkeypatch.setattr(_hc.HyperConnection, "_mix", lambda self, z: z[..., :24] * 0)
    calls = _spy(monkeypatch, hc_layer)
    out = hc_layer.mix(hc, _normal((1, 4, hc.fn.shape[1]), 4))
    assert not calls and not mx.any(out).item()


@pytest.mark.parametrize("shape, taken", [((1, 4), True), ((1, 1), False), ((2, 4), False)])
def test_router_logits_take_it_for_a_cuda_block(monkeypatch, layer, shape, taken):
    router = layer.mlp.gate
    x = _normal((*shape, router.weight.shape[1]), 5).astype(mx.bfloat16)
    calls = _spy(monkeypatch, gate)
    out = gate.gate_logits(router, x, "cuda")
    assert len(calls) == taken and (not taken or calls[0][1] is router.weight)
    assert out.dtype == mx.float32 and out.shape == (*shape, router.weight.shape[0])
    expected = x.astype(mx.float32) @ router.weight.T
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-5, atol=1e-4)

"""glm5_next's chunked KDA prefill against the stock per-token recurrence.

MLX_VLM_GLM5_KDA_PREFILL_CHUNKED=1 runs KDA prefill off Metal in chunks with
matmuls instead of one compiled step per token. It is not bit-identical (the
sums run in another order), so these tests bound its error: the recurrent
state against a float64 recurrence, no worse than twice the stock loop's
error; the mixer's output and cache against stock's, for a left-padded batch
and a prefill resumed from the cache.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models import gated_delta
from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.glm5_next import kda_chunked, kda_prefill
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

LB = -5.0
KDA = {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": LB, "safe_gate": True}

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="Metal runs the stock fused kernel")


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def test_state_error_same_order_as_the_stock_loop():
    mx.random.seed(0)
    batch, length, heads, dim = 2, 200, 4, 64
    shape = (batch, length, heads, dim)
    q = dim**-1.0 * mx.fast.rms_norm(mx.random.normal(shape), None, 1e-6)
    k = dim**-0.5 * mx.fast.rms_norm(mx.random.normal(shape), None, 1e-6)
    v, a, b = mx.random.normal(shape), mx.random.normal(shape), mx.random.normal(shape[:3])
    A_log, dt_bias = mx.random.uniform(0.0, 1.4, (heads, 1)), mx.random.uniform(-4.0, -1.0, (heads, dim))
    state = 0.5 * mx.random.normal((batch, heads, dim, dim))
    mask = mx.arange(length)[None] >= mx.array([0, 29])[:, None]  # row 1 left-padded

    S = f64(state)  # float64, token by token; masked tokens leave the state alone
    g = np.exp(LB / (1.0 + np.exp(-np.exp(f64(A_log)) * (f64(a) + f64(dt_bias)))))
    beta, keep = f64(mx.sigmoid(b)), np.array(mask)
    for t in range(length):
        new = S * g[:, t, :, None, :]
        delta = (f64(v)[:, t] - (new * f64(k)[:, t, :, None, :]).sum(-1)) * beta[:, t, :, None]
        new = new + f64(k)[:, t, :, None, :] * delta[..., None]
        S = np.where(keep[:, t, None, None, None], new, S)

    _, stock = gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, lower_bound=LB)
    _, chunked = kda_chunked.chunked_gated_delta(
        q, k, v, kda_chunked.log_gate(A_log, a, dt_bias, LB), mx.sigmoid(b), state, mask,
        chunk=16, sub=kda_chunked.sub_block(16, LB),
    )
    stock_error, chunked_error = np.abs(f64(stock) - S).max(), np.abs(f64(chunked) - S).max()
    assert stock_error < 1e-5
    assert chunked_error <= 2.0 * stock_error, (stock_error, chunked_error)


def init(path, p):
    if path.endswith("A_log"):
        return mx.random.uniform(0.0, math.log(4.0), p.shape)
    if path.endswith("dt_bias"):
        return mx.random.uniform(-4.0, -1.0, p.shape)
    if "norm" in path and path.endswith("weight"):
        return 1.0 + 0.1 * mx.random.normal(p.shape)
    return mx.random.normal(p.shape) / math.sqrt(p.shape[-1])


def test_mixer_matches_stock_padded_and_resumed(monkeypatch):
    mx.random.seed(1)
    layer = Glm5NextLinearAttention(TextConfig(hidden_size=128, num_hidden_layers=4, linear_attn_config=KDA))
    layer.update(tree_map_with_path(init, layer.parameters()))
    layer.eval()
    x = mx.random.normal((2, 90, 128))

    def run(enabled):
        monkeypatch.setattr(kda_prefill, "ENABLED", enabled)
        cache = ArraysCache(2, left_padding=[0, 11])
        first = layer(x[:, :50], cache.make_mask(50), cache)
        second = layer(x[:, 50:], cache.make_mask(40), cache)
        mx.eval(first, second, cache.cache)
        return mx.concatenate([first, second], axis=1), cache

    expected, stock_cache = run(False)
    served = []
    prefill_call = kda_prefill.prefill_call
    monkeypatch.setattr(kda_prefill, "prefill_call", lambda *a: served.append(1) or prefill_call(*a))
    actual, cache = run(True)
    assert len(served) == 2
    valid = np.arange(90)[None, :, None] >= np.array([0, 11])[:, None, None]
    scale = np.abs(f64(expected)).max()
    assert np.abs(np.where(valid, f64(actual) - f64(expected), 0)).max() <= 2e-5 * scale
    assert mx.array_equal(cache[0], stock_cache[0]).item()  # the conv window is stock's
    assert np.abs(f64(cache[1]) - f64(stock_cache[1])).max() <= 1e-5 * np.abs(f64(stock_cache[1])).max()

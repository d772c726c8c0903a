"""Metal twins against the stock Metal kernels they mirror, emulated on the host, bit for bit (metal_check/emulate.py)."""


import mlx.core as mx
import numpy as np
import pytest

from glm53_patches.kernels.metal_check import emulate
from glm53_patches.patches.expert_combine import kernel as combine


def _combine_inputs(rows, k, hidden, dtype, seed=0):
    key = iter(mx.random.split(mx.random.key(seed), 3))
    routed = (3 * mx.random.normal((rows, 1, k, hidden), key=next(key))).astype(dtype)
    weights = 2.5 * mx.softmax(mx.random.normal((rows, 1, k), key=next(key)), axis=-1)
    shared = mx.random.normal((rows, 1, hidden), key=next(key)).astype(dtype)
    return routed, weights, shared


# verify's width (hidden 4096, top 8), the tiny model's (hidden 128, top 2, batch 1-3), and top 12 (rows split over 8 threads)
COMBINE_CASES = [(1, 8, 4096, mx.bfloat16), (3, 2, 128, mx.bfloat16), (1, 2, 128, mx.float32), (2, 12, 256, mx.bfloat16),
                 (4, 8, 256, mx.float16)]


@pytest.mark.parametrize("rows, k, hidden, dtype", COMBINE_CASES)
def test_expert_combine_matches_col_reduce_small(tmp_path, rows, k, hidden, dtype):
    stock, twin = emulate.expert_combine(tmp_path, *_combine_inputs(rows, k, hidden, dtype))
    assert stock.size == rows * hidden
    assert np.array_equal(stock, twin), f"{int((stock != twin).sum())} of {stock.size} outputs differ"


# main's Metal body (4ed0234): products summed into a float32 accumulator
MAIN_FLOAT_ACCUMULATOR = r"""
  const ulong i = thread_position_in_grid.x;
  const ulong total = (ulong)sizes[0] * H;
  if (i >= total) {
    return;
  }
  const ulong row = i / H;
  const ulong h = i - row * H;
  const device T* r = routed + row * K * H + h;
  const device float* w = weights + row * K;
  float acc = 0.0f;
  for (int k = 0; k < K; ++k) {
    acc = acc + static_cast<float>(T(r[(ulong)k * H] * static_cast<T>(w[k])));
  }
  out[i] = T(static_cast<T>(acc) + shared[i]);
"""


def test_expert_combine_float_accumulator_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(combine, "METAL_SOURCE", MAIN_FLOAT_ACCUMULATOR)
    stock, twin = emulate.expert_combine(tmp_path, *_combine_inputs(3, 8, 256, mx.bfloat16))
    assert (stock != twin).mean() > 0.1  # a third of bf16 outputs round differently


def test_excerpts_are_mlx_text():
    """The stock text comes from the installed MLX headers, unchanged."""
    text = emulate.expert_combine_stock()
    assert "[[kernel]] void col_reduce_small(" in text and "totals[i] = op(cast_to<U>(row[i]), totals[i]);" in text
    assert (emulate.HEADERS / "reduction/reduce_col.h").read_text().count(
        emulate.excerpt("reduction/reduce_col.h", "[[kernel]] void col_reduce_small(").split("\n", 1)[1].rstrip("\n")) == 1

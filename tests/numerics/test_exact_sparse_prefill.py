"""exact_sparse_prefill on the CPU: the wrapper steps aside, and its chunk plumbing is stock's.

The patch is two CUDA kernels behind ``language._sparse_prefill_attention``
(``glm53-patches verify exact_sparse_prefill`` runs them against stock on the
H200). There is no CUDA here, so:

* what the CPU user gets: stock's function, bit for bit, every call counted
  as "not CUDA"; and ``verify`` says the patch steps aside;
* the coverage rules (``attention.unsupported``);
* ``attention.attention`` with the two kernels replaced by what they stand
  for, written from stock's own pieces (``_sparse_head_gather``, the matmul
  of one query row, the mask's ``where``): bit for bit stock's result for
  batch 1 and 2, partial last chunks, strided K/V views and several launch
  blocks. So the scale, the chunking, the layouts and the concatenation
  around the kernels are stock's; a mutant that drops the scale must fail.

Exact means bit-identical: comparisons are on the raw bits.
"""

import mlx.core as mx
import pytest

from glm53_patches.exactness import same_bits
from glm53_patches.patches.exact_sparse_prefill import PATCH, attention, kernel
from glm53_patches.patches.exact_sparse_prefill.checks.verify import case_inputs
from glm53_patches.tiny_model import build_model, greedy_logits
from mlx_vlm.models.glm5_next import language

STOCK = language._sparse_prefill_attention
TARGET = "mlx_vlm.models.glm5_next.language:_sparse_prefill_attention"


def stock_scores(qs, k, idx, fma=None):
    """What ``kernel.scores`` stands for: stock's gathered keys, one query row per batch row, masked."""
    B, H, L, D = qs.shape
    N = k.shape[2]
    keys = language._sparse_head_gather(k, mx.clip(idx, 0, N - 1))  # [B*L, H, topk, D]
    rows = qs.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D) @ keys.swapaxes(-1, -2)
    valid = ((idx >= 0) & (idx < N)).reshape(B * L, 1, 1, -1)
    return mx.where(valid, rows, mx.array(mx.finfo(qs.dtype).min, qs.dtype)).reshape(B, L, H, -1)


def stock_values(v, idx):
    """What ``kernel.gathered_values`` stands for."""
    return language._sparse_head_gather(v, mx.clip(idx, 0, v.shape[2] - 1))


CASES = {  # (dtype, batch, heads, dim, queries, keys, topk, kpool, strided)
    "fp32 b1": (mx.float32, 1, 4, 64, 40, 160, 32, 4, False),
    "fp32 b2 strided": (mx.float32, 2, 4, 64, 40, 160, 32, 4, True),
    "bf16 b2 d48 strided": (mx.bfloat16, 2, 4, 48, 33, 160, 32, 4, True),
    "fp32 one chunk": (mx.float32, 1, 4, 64, 16, 160, 32, 4, False),
    "fp32 one query": (mx.float32, 1, 4, 64, 1, 160, 32, 4, False),
}


@pytest.fixture
def reference_kernels(monkeypatch):
    monkeypatch.setattr(kernel, "scores", stock_scores)
    monkeypatch.setattr(kernel, "gathered_values", stock_values)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [2**27, 4 * 32 * 16, 1])  # one launch; two chunks per launch; one chunk
def test_plumbing_around_the_kernels_is_stocks(reference_kernels, monkeypatch, case, block):
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", block)
    q, k, v, idx = case_inputs(*CASES[case], seed=3)
    scale = q.shape[-1] ** -0.5
    assert same_bits(STOCK(q, k, v, idx, scale), attention.attention(q, k, v, idx, scale))


def test_a_mutant_without_the_scale_fails(reference_kernels, monkeypatch):
    q, k, v, idx = case_inputs(*CASES["fp32 b1"], seed=3)
    expected = STOCK(q, k, v, idx, 0.125)
    assert same_bits(expected, attention.attention(q, k, v, idx, 0.125))
    assert not same_bits(expected, attention.attention(q, k, v, idx, 1.0))


def test_unsupported_says_why():
    q, k, v, idx = case_inputs(*CASES["fp32 b1"], seed=0)
    assert attention.unsupported(q, k, v, idx, 16) is None
    assert attention.unsupported(q, k[:, :2], v[:, :2], idx, 16) == "shape"  # grouped heads
    assert attention.unsupported(q, k.astype(mx.bfloat16), v, idx, 16) == "dtype"
    assert attention.unsupported(q, k, v, idx.astype(mx.int64), 16) == "index dtype"
    assert attention.unsupported(q, k, v, idx[:, :5], 16) == "shape"
    assert attention.unsupported(q, k, v, idx, 0) == "shape"


def test_on_the_cpu_stock_runs_and_is_counted():
    q, k, v, idx = case_inputs(*CASES["bf16 b2 d48 strided"], seed=1)
    PATCH.stats.reset()
    patched = PATCH.targets[TARGET](STOCK)
    assert same_bits(STOCK(q, k, v, idx, 0.25), patched(q, k, v, idx, 0.25))
    stats = PATCH.stats.snapshot()
    assert stats["hits"] == {} and stats["fallbacks"] == {"not CUDA": 1}


def test_the_tiny_model_is_unchanged_through_the_patch(monkeypatch):
    model = build_model(seed=2).language_model
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(30)]])
    expected = greedy_logits(model, prompt, 4)
    PATCH.stats.reset()
    monkeypatch.setattr(language, "_sparse_prefill_attention", PATCH.targets[TARGET](STOCK))
    assert same_bits(mx.stack(expected), mx.stack(greedy_logits(model, prompt, 4)))
    assert PATCH.stats.snapshot()["fallbacks"].get("not CUDA", 0) > 0  # the prefill went through the wrapper


def test_verify_on_the_cpu_says_it_steps_aside():
    result = PATCH.verify()
    assert result["exact"] and "steps aside" in result["detail"]

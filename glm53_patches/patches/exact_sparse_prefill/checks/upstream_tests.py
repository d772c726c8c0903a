"""glm5_next's exact sparse prefill attention is bit-identical to the current loop.

MLX_VLM_GLM5_EXACT_SPARSE_PREFILL=1 sends _sparse_prefill_attention through
exact_sparse_prefill.prefill_attention, which on CUDA scores the selected keys
in one kernel launch and elsewhere hands the call back (returns None). On a
CUDA machine these tests compare it with the current loop on raw bits; on
every backend they run its chunk plumbing with the two kernels replaced by
what they stand for (the current gather and one-row matmul), which must give
the current loop's bits, and check a small model's prefill and decode.
"""

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models.glm5_next import exact_sparse_prefill, language
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import LanguageModel

CONFIG = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention"],
    index_topk_pattern="FFFS", mlp_layer_types=["dense", "sparse", "sparse", "sparse"], first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, index_n_heads=4, index_head_dim=64, index_topk=16, index_kpool=4,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    hc_mult=4, vocab_size=512, tie_word_embeddings=False,
)
ON_CUDA = exact_sparse_prefill.gpu_backend() == "cuda"


def bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16}[a.dtype.size])


def stock(q, k, v, indices, scale):
    enabled = exact_sparse_prefill.ENABLED
    exact_sparse_prefill.ENABLED = False
    try:
        return language._sparse_prefill_attention(q, k, v, indices, scale)
    finally:
        exact_sparse_prefill.ENABLED = enabled


def inputs(dtype, strided, seed=7):
    keys = iter(mx.random.split(mx.random.key(seed), 4))
    batch, heads, q_length, kv_length, dim, width = 2, 4, 37, 90, 64, 19
    q = mx.random.normal((batch, heads, q_length, dim), key=next(keys)).astype(dtype)
    k = mx.random.normal((batch, heads, kv_length + 10, dim), key=next(keys)).astype(dtype)
    v = mx.random.normal((batch, heads, kv_length + 10, dim), key=next(keys)).astype(dtype)
    if strided:  # what KVCache.update_and_fetch returns before its buffer is full
        k, v = k[:, :, :kv_length], v[:, :, :kv_length]
    else:
        k, v = mx.array(k[:, :, :kv_length]), mx.array(v[:, :, :kv_length])
    indices = mx.random.randint(-1, kv_length + 3, (batch, q_length, width), key=next(keys))
    indices = mx.where(mx.arange(width) % 5 == 4, -1, indices).astype(mx.int32)
    return q, k, v, indices


def current_scores(qs, k, idx, fma=None):
    """What the scores kernel stands for: the current gathered keys, one query row per batch row, masked."""
    B, H, L, D = qs.shape
    N = k.shape[2]
    keys = language._sparse_head_gather(k, mx.clip(idx, 0, N - 1))
    rows = qs.transpose(0, 2, 1, 3).reshape(B * L, H, 1, D) @ keys.swapaxes(-1, -2)
    valid = ((idx >= 0) & (idx < N)).reshape(B * L, 1, 1, -1)
    return mx.where(valid, rows, mx.array(mx.finfo(qs.dtype).min, qs.dtype)).reshape(B, L, H, -1)


def current_values(v, idx):
    return language._sparse_head_gather(v, mx.clip(idx, 0, v.shape[2] - 1))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("block", [None, 2 * 4 * 19 * 16])  # one launch, and one 16-query chunk per launch
def test_chunk_plumbing_gives_the_current_bits(dtype, strided, block, monkeypatch):
    monkeypatch.setattr(exact_sparse_prefill.kernel, "scores", current_scores)
    monkeypatch.setattr(exact_sparse_prefill.kernel, "gathered_values", current_values)
    if block is not None:
        monkeypatch.setattr(exact_sparse_prefill, "BLOCK_ELEMENTS", block)
    q, k, v, indices = inputs(dtype, strided)
    expected = stock(q, k, v, indices, 0.125)
    actual = exact_sparse_prefill.attention(q, k, v, indices, 0.125)
    assert mx.array_equal(bits(expected), bits(actual)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("strided", [False, True])
def test_bit_identical_to_the_current_loop_where_it_runs(dtype, strided):
    q, k, v, indices = inputs(dtype, strided, seed=11)
    actual = exact_sparse_prefill.prefill_attention(q, k, v, indices, 0.125)
    if not ON_CUDA:
        assert actual is None  # handed back: the current code runs
        return
    expected = stock(q, k, v, indices, 0.125)
    assert mx.array_equal(bits(expected), bits(actual)).item()


def init(path, p):
    if "norm" in path and path.endswith("weight"):
        return 1.0 + 0.1 * mx.random.normal(p.shape)
    if path.endswith("bias"):
        return mx.zeros(p.shape)
    if path.endswith("A_log"):
        return mx.random.uniform(0.0, math.log(4.0), p.shape)
    if path.endswith("dt_bias"):
        return mx.random.uniform(-4.0, -1.0, p.shape)
    return mx.random.normal(p.shape) / math.sqrt(p.shape[-1])


def test_model_prefill_and_decode_bit_identical(monkeypatch):
    mx.random.seed(0)
    model = LanguageModel(TextConfig.from_dict(CONFIG))
    model.update(tree_map_with_path(init, model.parameters()))
    model.eval()
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(60)]])

    def run():
        cache = model.make_cache()
        logits = [model(prompt[:, :33], cache=cache).logits, model(prompt[:, 33:], cache=cache).logits]
        for _ in range(4):
            token = mx.argmax(logits[-1][:, -1], axis=-1)
            logits.append(model(token[:, None], cache=cache).logits)
        mx.eval(logits)
        return logits

    served = []
    prefill_attention = exact_sparse_prefill.prefill_attention

    def counted(*args):
        out = prefill_attention(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(exact_sparse_prefill, "ENABLED", False)
    expected = run()
    monkeypatch.setattr(exact_sparse_prefill, "prefill_attention", counted)
    monkeypatch.setattr(exact_sparse_prefill, "ENABLED", True)
    actual = run()
    for a, b in zip(expected, actual):
        assert mx.array_equal(bits(a), bits(b)).item()
    assert served and all(served) == ON_CUDA  # the hook was reached; it ran only where the kernels run

"""glm5_next's gathered sparse prefill attention is bit-identical to the stock loop.

MLX_VLM_GLM5_GATHERED_PREFILL=1 sends _sparse_prefill_attention, off Metal,
through gathered_prefill.prefill_attention: K/V flattened once per call,
query chunks sized from the shapes, the same fused SDPA per chunk. These
tests compare it with the stock loop on raw bits, for contiguous K/V and for
the strided views a KVCache returns, with -1 slots and tiny element budgets
that force many chunks, and through a small model's prefill and decode.
"""

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models.glm5_next import gathered_prefill, language
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

pytestmark = pytest.mark.skipif(mx.metal.is_available(), reason="Metal runs the stock kernel")


def bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16}[a.dtype.size])


def stock(q, k, v, indices, scale):
    enabled = gathered_prefill.ENABLED
    gathered_prefill.ENABLED = False
    try:
        return language._sparse_prefill_attention(q, k, v, indices, scale)
    finally:
        gathered_prefill.ENABLED = enabled


def selection(batch, q_length, kv_length, width, key):
    indices = mx.random.randint(-1, kv_length, (batch, q_length, width), key=key)
    return mx.where(mx.arange(width) % 5 == 4, -1, indices).astype(mx.int32)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("budget", [None, 2 * 4 * 19 * 64])  # default, and one query per chunk
def test_bit_identical_to_the_stock_loop(dtype, strided, budget, monkeypatch):
    if budget is not None:
        monkeypatch.setenv("MLX_VLM_GLM5_GATHERED_PREFILL_MAX_ELEMENTS", str(budget))
    monkeypatch.setattr(gathered_prefill, "ENABLED", True)
    keys = iter(mx.random.split(mx.random.key(7), 4))
    batch, heads, q_length, kv_length, dim, width = 2, 4, 37, 90, 64, 19
    q = mx.random.normal((batch, heads, q_length, dim), key=next(keys)).astype(dtype)
    k = mx.random.normal((batch, heads, kv_length + 10, dim), key=next(keys)).astype(dtype)
    v = mx.random.normal((batch, heads, kv_length + 10, dim), key=next(keys)).astype(dtype)
    if strided:  # what KVCache.update_and_fetch returns before its buffer is full
        k, v = k[:, :, :kv_length], v[:, :, :kv_length]
    else:
        k, v = mx.array(k[:, :, :kv_length]), mx.array(v[:, :, :kv_length])
    indices = selection(batch, q_length, kv_length, width, next(keys))
    expected = stock(q, k, v, indices, 0.125)
    actual = gathered_prefill.prefill_attention(q, k, v, indices, 0.125)
    assert actual is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
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
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(60)]])  # 60 keys: the indexer keeps 16 + tail

    def run():
        cache = model.make_cache()
        logits = [model(prompt[:, :33], cache=cache).logits, model(prompt[:, 33:], cache=cache).logits]
        for _ in range(4):
            token = mx.argmax(logits[-1][:, -1], axis=-1)
            logits.append(model(token[:, None], cache=cache).logits)
        mx.eval(logits)
        return logits

    served = []
    prefill_attention = gathered_prefill.prefill_attention

    def counted(*args):
        out = prefill_attention(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(gathered_prefill, "ENABLED", False)
    expected = run()
    monkeypatch.setattr(gathered_prefill, "prefill_attention", counted)
    monkeypatch.setattr(gathered_prefill, "ENABLED", True)
    actual = run()
    for a, b in zip(expected, actual):
        assert mx.array_equal(bits(a), bits(b)).item()
    assert served and all(served)

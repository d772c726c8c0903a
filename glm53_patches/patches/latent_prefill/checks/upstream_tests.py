"""glm5_next's DSA prefill in the latent space stays close to the stock prefill.

MLX_VLM_GLM5_LATENT_PREFILL=1 sends prefill chunks of Glm5NextAttention._attend
(more than DECODE_BLOCK_SIZE tokens) through latent_prefill.prefill_attend,
which attends over the selected latent rows with the absorbed query, as decode
does. Not bit-identical to the stock prefill (other rounding): these tests
gate the difference on a small model with prompts long enough that the
indexer drops keys, and check that short chunks are untouched.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models.glm5_next import latent_prefill
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import LanguageModel

CONFIG = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention", "deepseek_sparse_attention"],
    index_topk_pattern="FFFS", mlp_layer_types=["dense", "sparse", "sparse", "sparse"], first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, index_n_heads=4, index_head_dim=64, index_topk=64, index_kpool=4,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    hc_mult=4, vocab_size=512, tie_word_embeddings=False,
)


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


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    model = LanguageModel(TextConfig.from_dict(CONFIG))
    model.update(tree_map_with_path(init, model.parameters()))
    model.eval()
    return model


def logits(model, prompt, enabled, monkeypatch):
    monkeypatch.setattr(latent_prefill, "ENABLED", enabled)
    out = model(prompt, cache=model.make_cache()).logits
    return np.array(out.astype(mx.float32)).astype(np.float64)


def test_prefill_close_to_stock(model, monkeypatch):
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(150)], [(11 * i + 5) % 500 for i in range(150)]])
    stock, latent = logits(model, prompt, False, monkeypatch), logits(model, prompt, True, monkeypatch)
    p = stock - stock.max(-1, keepdims=True)
    p -= np.log(np.exp(p).sum(-1, keepdims=True))
    q = latent - latent.max(-1, keepdims=True)
    q -= np.log(np.exp(q).sum(-1, keepdims=True))
    kl = (np.exp(p) * (p - q)).sum(-1)
    assert kl.max() < 1e-9, kl.max()
    top = np.sort(stock, -1)
    clear = (top[..., -1] - top[..., -2]) > 1e-3
    assert np.array_equal(stock.argmax(-1)[clear], latent.argmax(-1)[clear])


def test_short_chunks_are_stock(model, monkeypatch):
    prompt = mx.array([[(5 * i + 1) % 500 for i in range(8)]])  # DECODE_BLOCK_SIZE: stock's decode branch
    stock, latent = logits(model, prompt, False, monkeypatch), logits(model, prompt, True, monkeypatch)
    assert np.array_equal(stock, latent)

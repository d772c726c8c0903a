"""glm5_next's decode-time indexer selection is identical to the stock selection.

MLX_VLM_GLM5_DSA_DECODE=1 sends single-token calls of Glm5NextIndexer through
dsa_decode.decode_topk. These tests compare its top-k with the stock code at
every context from 1 key to past the point where pools are really dropped,
with batch rows whose key validity has holes, and greedy decoding of a small
model bit for bit.
"""

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models.glm5_next import dsa_decode
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


@pytest.fixture
def enabled(monkeypatch):
    served = []
    decode_topk = dsa_decode.decode_topk

    def counted(*args):
        topk = decode_topk(*args)
        served.append(topk is not None)
        return topk

    monkeypatch.setattr(dsa_decode, "decode_topk", counted)
    monkeypatch.setattr(dsa_decode, "ENABLED", True)
    yield served
    dsa_decode.clear()


def greedy(model, prompt, steps):
    cache = model.make_cache()
    logits = [model(prompt, cache=cache).logits[:, -1]]
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        logits.append(model(token[:, None], cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    return logits


def test_greedy_decode_bit_identical(model, monkeypatch):
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(40)]] * 2)
    monkeypatch.setattr(dsa_decode, "ENABLED", False)
    expected = greedy(model, prompt, 40)  # 40 + 40 keys: past the 64 the indexer keeps
    monkeypatch.setattr(dsa_decode, "ENABLED", True)
    actual = greedy(model, prompt, 40)
    for step, (a, b) in enumerate(zip(expected, actual)):
        assert mx.array_equal(a.view(mx.uint32), b.view(mx.uint32)).item(), step
    dsa_decode.clear()


def test_selection_identical_with_validity_holes(model, enabled):
    attention = model.model.layers[1].self_attn
    caches = [model.make_cache()[1] for _ in range(2)]
    for step, key in enumerate(mx.random.split(mx.random.key(3), 90)):
        x = mx.random.normal((2, 1, 128), key=key)
        q_resid = mx.random.normal((2, 1, 64), key=key)
        padding_mask = mx.array([[True], [step % 7 != 2]])
        got = []
        for on, cache in ((False, caches[0]), (True, caches[1])):
            dsa_decode.ENABLED = on
            offset = cache[0].offset
            cache[0].update_and_fetch(mx.zeros((2, 1, 1, 1)), mx.zeros((2, 1, 1, 0)))
            got.append(attention.indexer(x, q_resid, padding_mask, cache[1], cache[2], offset))
        assert mx.array_equal(got[0], got[1]).item() and got[0].dtype == got[1].dtype, step
    assert all(enabled) and len(enabled) == 90

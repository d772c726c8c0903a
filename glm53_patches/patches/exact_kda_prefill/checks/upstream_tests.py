"""gated_delta_ops through exact_kda_prefill is bit-identical to the current loop.

MLX_VLM_EXACT_KDA_PREFILL=1 sends gated_delta_ops through
exact_kda_prefill.looped, which on CUDA runs the whole recurrence in one
kernel launch and elsewhere hands the call back (returns None). On a CUDA
machine these tests compare it with the current loop on raw bits (padded
batches, a carried state, the per-token history); on every backend they check
which calls it takes, and a small model's prefill and decode through the hook.
"""

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path

from mlx_vlm.models import exact_kda_prefill, gated_delta
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import LanguageModel

CONFIG = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
    layer_types=["linear_attention", "deepseek_sparse_attention", "linear_attention"],
    index_topk_pattern="FFF", mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=0,
    qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, index_n_heads=4, index_head_dim=64, index_topk=16, index_kpool=4,
    linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    hc_mult=4, vocab_size=512, tie_word_embeddings=False,
)
ON_CUDA = exact_kda_prefill.cuda_here()


def bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16, 1: mx.uint8}[a.dtype.size])


def current(*args):
    enabled = exact_kda_prefill.ENABLED
    exact_kda_prefill.ENABLED = False
    try:
        return gated_delta.gated_delta_ops(*args)
    finally:
        exact_kda_prefill.ENABLED = enabled


def op_inputs(batch, length, heads, dim, seed, padding=None):
    keys = iter(mx.random.split(mx.random.key(seed), 8))
    shape = (batch, length, heads, dim)
    q = (dim**-1.0 * mx.fast.rms_norm(mx.random.normal(shape, key=next(keys)), None, 1e-6)).astype(mx.bfloat16)
    k = (dim**-0.5 * mx.fast.rms_norm(mx.random.normal(shape, key=next(keys)), None, 1e-6)).astype(mx.bfloat16)
    v = mx.random.normal(shape, key=next(keys)).astype(mx.bfloat16)
    g = mx.exp(-mx.random.uniform(0.0, 0.5, shape, key=next(keys)))
    beta = mx.sigmoid(mx.random.normal((batch, length, heads), key=next(keys))).astype(mx.bfloat16)
    state = 0.3 * mx.random.normal((batch, heads, dim, dim), key=next(keys))
    mask = None if padding is None else mx.arange(length)[None] >= mx.array(padding)[:, None]
    return q, k, v, g, beta, state, mask


@pytest.mark.parametrize("batch,padding", [(1, None), (3, [0, 2, 5])])
@pytest.mark.parametrize("steps", [None, 3])
def test_bit_identical_to_the_current_loop_where_it_runs(batch, padding, steps):
    args = op_inputs(batch, 9, 2, 64, seed=batch, padding=padding)
    result = exact_kda_prefill.looped(*args, steps)
    if not ON_CUDA:
        assert result is None  # handed back: the current loop runs
        return
    expected = current(*args, steps)
    assert len(result) == len(expected)
    for a, b in zip(expected, result):
        assert a.shape == b.shape and mx.array_equal(bits(a), bits(b)).item()


def test_calls_it_does_not_cover_are_handed_back():
    q, k, v, g, beta, state, _ = op_inputs(1, 9, 2, 64, seed=0)
    assert exact_kda_prefill.unsupported(q, k, v, g, beta, state, None, None) is None
    assert exact_kda_prefill.unsupported(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state, None, None) == "length"
    assert exact_kda_prefill.unsupported(q, k, v, g[..., 0], beta, state, None, None) == "scalar gate"
    assert exact_kda_prefill.looped(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state) is None


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
    prompt = mx.array([[(7 * i + 3) % 500 for i in range(40)]])

    def run():
        cache = model.make_cache()
        logits = [model(prompt[:, :25], cache=cache).logits, model(prompt[:, 25:], cache=cache).logits]
        for _ in range(4):
            token = mx.argmax(logits[-1][:, -1], axis=-1)
            logits.append(model(token[:, None], cache=cache).logits)
        mx.eval(logits)
        return logits

    served = []
    looped = exact_kda_prefill.looped

    def counted(*args):
        out = looped(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(exact_kda_prefill, "ENABLED", False)
    expected = run()
    monkeypatch.setattr(exact_kda_prefill, "looped", counted)
    monkeypatch.setattr(exact_kda_prefill, "ENABLED", True)
    actual = run()
    for a, b in zip(expected, actual):
        assert mx.array_equal(bits(a), bits(b)).item()
    assert served and any(served) == ON_CUDA  # the hook was reached; the kernel ran only on CUDA

"""glm5_next's fused hyper-connection decode layer is bit-identical to the stock decode.

MLX_VLM_GLM5_HC_DECODE=1 sends decode of a DecoderLayer (one token, or a
short block of up to 8: a speculative verify block or a short prompt; off
Metal) through hc_decode.decode_step: the hyper-connection collapse, branch norm and expand
as mx.compile'd graphs (and, with MLX_VLM_GLM5_HC_DECODE_KERNEL=1 on CUDA,
the Sinkhorn collapse as one kernel launch). These tests turn it on per test,
compare logits, layer outputs and caches with the stock code on raw bits, and
count the calls that the fused path served.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.deepseek_v4.hyper_connection import HyperConnection
from mlx_vlm.models.glm5_next import hc_decode, hc_sinkhorn
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import DecoderLayer, LanguageModel

HIDDEN = 128
STEPS = 12
PROMPT = [5, 17, 33, 101, 7, 250, 3]
KDA = {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0}
LINEAR, SPARSE = "linear_attention", "deepseek_sparse_attention"


@pytest.fixture
def served(monkeypatch):
    """Turn the fused path on; yield the list of its results (True = served)."""
    calls = []
    decode_step = hc_decode.decode_step

    def counted(*args):
        output = decode_step(*args)
        calls.append(output is not None)
        return output

    monkeypatch.setattr(hc_decode, "decode_step", counted)
    monkeypatch.setattr(hc_decode, "ENABLED", True)
    yield calls
    hc_decode.clear()


def stock(fn, *args, **kwargs):
    """Call a layer or model (``fn``) with the fused path off."""
    enabled = hc_decode.ENABLED
    hc_decode.ENABLED = False
    try:
        return fn(*args, **kwargs)
    finally:
        hc_decode.ENABLED = enabled


def assert_bitwise(expected, actual, what):
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, what
    view = {4: mx.uint32, 2: mx.uint16, 1: mx.uint8}[expected.itemsize]
    assert mx.array_equal(expected.view(view), actual.view(view)).item(), what


def init(path, p):
    """Random weights that keep activations O(1) through the stack."""
    if path.endswith("A_log"):
        return mx.random.uniform(0.0, math.log(4.0), p.shape)
    if path.endswith("dt_bias"):
        return mx.random.uniform(-4.0, -1.0, p.shape)
    if path.endswith("_hc.base"):
        return 0.5 * mx.random.normal(p.shape)
    if path.endswith("_hc.scale"):
        return mx.random.uniform(0.5, 1.5, p.shape)
    if "norm" in path and path.endswith("weight"):
        return 1.0 + 0.1 * mx.random.normal(p.shape)
    if path.endswith("bias"):
        return mx.zeros(p.shape)
    if path.endswith("embed_tokens.weight"):
        return mx.random.normal(p.shape)
    return mx.random.normal(p.shape) / math.sqrt(p.shape[-1])


def config(**changes):
    fields = dict(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        # Layer 3 reuses layer 1's sparse-attention selection (prev_topk_indices).
        layer_types=[LINEAR, SPARSE, LINEAR, SPARSE],
        index_topk_pattern="FFFS",
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=0,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        index_n_heads=4,
        index_head_dim=64,
        index_topk=64,
        index_kpool=4,
        linear_attn_config=KDA,
    )
    fields.update(changes)
    return TextConfig(**fields)


def finish(module, dtype, bits, cast=None):
    """Quantize and cast like a converted checkpoint (hyper-connections stay fp32)."""
    if bits:
        nn.quantize(
            module,
            group_size=64,
            bits=bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
    if dtype != mx.float32:
        keep = cast or (lambda path: "_hc." not in f".{path}" and not path.endswith(("A_log", "dt_bias")))
        module.update(
            tree_map_with_path(
                lambda path, p: p.astype(dtype) if keep(path) and mx.issubdtype(p.dtype, mx.floating) else p,
                module.parameters(),
            )
        )
    module.eval()
    mx.eval(module.parameters())
    return module


def small_model(dtype=mx.float32, bits=None, seed=1):
    model = LanguageModel(config())
    mx.random.seed(seed)
    model.update(tree_map_with_path(init, model.parameters()))
    return finish(model, dtype, bits, model.cast_predicate)


def greedy_logits(model, prompts, steps=STEPS):
    """Prefill (left-padded like the batch generator), then greedy decode steps."""
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    if len(prompts) == 1:
        cache = model.make_cache()
    else:
        from mlx_vlm.generate.ar import _make_cache  # the batch generator's caches

        cache = _make_cache(model, padding)
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    logits = model(tokens, cache=cache).logits[:, -1]
    out = []
    for _ in range(steps):
        mx.eval(logits)
        out.append(logits)
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache).logits[:, -1]
    return out


MODEL_CASES = {
    "fp32": (mx.float32, None, [PROMPT]),
    "fp32-batch3": (mx.float32, None, [PROMPT, [9, 8, 7], [44, 45, 46, 47, 48]]),
    # bf16 quantized only (as real checkpoints): an unquantized bf16
    # MultiLinear needs GatherMM, which MLX's CPU backend runs in float32 only.
    "bf16-4bit": (mx.bfloat16, 4, [PROMPT]),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_greedy_logits_bitwise(served, case):
    dtype, bits, prompts = MODEL_CASES[case]
    model = small_model(dtype, bits)
    expected = stock(greedy_logits, model, prompts)
    actual = greedy_logits(model, prompts)
    for step, (e, a) in enumerate(zip(expected, actual)):
        assert_bitwise(e, a, f"logits, token {step}")
    layers = len(model.layers)
    # The prompts are short blocks (up to 8 tokens): the prefill is served too, like every step.
    assert max(map(len, prompts)) <= 8
    assert served == [True] * layers * (STEPS + 1)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_verify_blocks_match_stock_bitwise(served, case):
    """Speculative verify blocks of 2 to 8 tokens, each committed in part (a rollback): every block's
    logits and the caches after it equal the stock code's."""
    from mlx_vlm.speculative.cache_state import start_speculative_cache

    dtype, bits, prompts = MODEL_CASES[case]
    model = small_model(dtype, bits)

    def speculate():
        caches = model.make_cache() if len(prompts) == 1 else None
        if caches is None:
            from mlx_vlm.generate.ar import _make_cache

            width = max(map(len, prompts))
            caches = _make_cache(model, [width - len(p) for p in prompts])
        width = max(map(len, prompts))
        model(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=caches)
        out = []
        for length in range(2, 9):
            block = mx.array([[(7 * length + 3 * i + row) % 256 for i in range(length)] for row in range(len(prompts))])
            transaction = start_speculative_cache(caches, length)
            out.append(model(block, cache=caches).logits)
            mx.eval(out[-1])
            transaction.commit([1 + (length + row) % length for row in range(len(prompts))])
        return out, [a for _, a in tree_flatten([c.state for c in caches])]

    expected = stock(speculate)
    actual = speculate()
    for name, e, a in zip(("logits", "caches"), expected, actual):
        assert len(e) == len(a)
        for i, (x, y) in enumerate(zip(e, a)):
            if x is None or y is None:  # an empty cache slot
                assert x is y, f"{name} {i}"
            else:
                assert_bitwise(x, y, f"{name} {i}")
    assert served == [True] * len(model.layers) * 8  # the prefill (a short block) and 7 blocks


def kda_layer(dtype=mx.float32, seed=0):
    layer = DecoderLayer(config(layer_types=[LINEAR] * 4, mlp_layer_types=["dense"] * 4), 0)
    mx.random.seed(seed)
    layer.update(tree_map_with_path(init, layer.parameters()))
    return finish(layer, dtype, None)


def streams(batch, length, dtype, seed):
    return mx.random.normal((batch, length, 4, HIDDEN), key=mx.random.key(seed)).astype(dtype)


def compare_steps(layer, batch, dtype, steps, what, between=None):
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        stock(layer, streams(batch, 5, dtype, 0), None, cache)
    for step in range(steps):
        if between is not None:
            between(step)
        x = streams(batch, 1, dtype, 10 + step)
        expected, _ = stock(layer, x, None, caches[0])
        actual, _ = layer(x, None, caches[1])
        assert_bitwise(expected, actual, f"output, {what}, step {step}")
        for i in range(2):
            assert_bitwise(caches[0][i], caches[1][i], f"cache[{i}], {what}, step {step}")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
def test_layer_decode_matches_stock_bitwise(served, dtype):
    """Independent random streams (in a model they start as copies of one)."""
    layer = kda_layer(dtype)
    compare_steps(layer, 3, dtype, 4, str(dtype))
    assert served == [True] * 4
    assert hc_decode.compiled_count() == 2  # collapse, expand + collapse


def test_weights_are_inputs_not_captured(served):
    """A weight update is seen at the next call, without a new compiled function."""
    layer = kda_layer()

    def update(step):
        if step == 2:
            layer.attn_hc.update(tree_map(lambda p: 1.5 * p, layer.attn_hc.parameters()))
            layer.post_attention_layernorm.weight = 0.5 * layer.post_attention_layernorm.weight

    compare_steps(layer, 1, mx.float32, 4, "weights", between=update)
    assert served == [True] * 4
    assert hc_decode.compiled_count() == 2


class OtherHyperConnection(HyperConnection):
    pass


def _training(layer):
    layer.train()


def _other_module(layer):
    layer.ffn_hc.__class__ = OtherHyperConnection


STOCK_CASES = {
    # name: (prepare the layer, tokens)
    "prefill": (None, 9),  # longer than a short block
    "training": (_training, 1),
    "module type": (_other_module, 1),
}


@pytest.mark.parametrize("case", STOCK_CASES)
def test_other_calls_run_the_stock_code(served, case):
    prepare, length = STOCK_CASES[case]
    layer = kda_layer()
    if prepare is not None:
        prepare(layer)
    caches = [ArraysCache(2) for _ in range(2)]
    x = streams(1, length, mx.float32, 3)
    expected, _ = stock(layer, x, None, caches[0])
    actual, _ = layer(x, None, caches[1])
    assert_bitwise(expected, actual, "output")
    for i in range(2):
        assert_bitwise(caches[0][i], caches[1][i], f"cache[{i}]")
    assert served == [False]
    assert hc_decode.compiled_count() == 0


def test_kernel_switch_is_off_by_default_and_cuda_only(monkeypatch):
    monkeypatch.delenv("MLX_VLM_GLM5_HC_DECODE_KERNEL", raising=False)
    hc_decode.clear()
    assert not hc_decode.kernel_wanted("cuda") and not hc_decode.kernel_wanted("metal")
    monkeypatch.setenv("MLX_VLM_GLM5_HC_DECODE_KERNEL", "1")
    hc_decode.clear()
    assert hc_decode.kernel_wanted("cuda")
    assert not hc_decode.kernel_wanted("metal")  # not verified on Metal yet
    assert not hc_decode.kernel_wanted(None)  # no GPU: never
    with hc_decode.forcing_kernel(False):
        assert not hc_decode.kernel_wanted("cuda")
    hc_decode.clear()


def test_forced_kernel_matches_stock(served):
    """On a GPU: the one-launch kernel against the stock HyperConnection at real
    width, and the model decoding through it. Without a GPU there is no kernel:
    forcing it still decodes through the compiled path, bit-identical."""
    backend = hc_sinkhorn.gpu_backend()
    hc = HyperConnection(config(hidden_size=4096))
    hc.update(tree_map_with_path(lambda path, p: init(f"attn_hc.{path}", p), hc.parameters()))
    x = (3.0 * mx.random.normal((4, 1, 4, 4096), key=mx.random.key(0))).astype(mx.bfloat16)
    y = x.astype(mx.float32)
    mixes = hc._mix(mx.fast.rms_norm(y.flatten(-2), None, hc.norm_eps))
    args = (x, mixes, hc.scale, hc.base, hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps)
    if backend is None:
        assert hc_sinkhorn.unsupported(x, hc.hc_mult) == "no GPU backend"
        with pytest.raises(ValueError):
            hc_sinkhorn.hc_sinkhorn_collapse(*args)
    else:
        for dtype in (mx.bfloat16, mx.float32):
            x_dtype = x.astype(dtype)
            expected = hc(x_dtype)
            actual = hc_sinkhorn.hc_sinkhorn_collapse(x_dtype, *args[1:])
            for name, e, a in zip(("collapsed", "post", "comb"), expected, actual):
                assert_bitwise(e, a, f"kernel {backend} {dtype}: {name}")
    model = small_model()
    expected = stock(greedy_logits, model, [PROMPT], 6)
    with hc_decode.forcing_kernel(True):
        actual = greedy_logits(model, [PROMPT], 6)
    for step, (e, a) in enumerate(zip(expected, actual)):
        assert_bitwise(e, a, f"logits, token {step}")
    assert served == [True] * len(model.layers) * 7  # the 7-token prefill and 6 steps


def test_compiled_constant_is_what_mx_compile_bakes():
    """The eps the CUDA kernel reads is the float32 MLX's fused kernels use for a Python float."""
    x = mx.random.uniform(0.5, 2.0, (4096,), key=mx.random.key(0))
    for value in (1e-6, 1 / 3, 0.08838834764831845, 1 / 16384):
        baked = mx.compile(lambda a, v=value: mx.exp(mx.abs(a)) * v)(x)
        eager = mx.exp(mx.abs(x)) * mx.array(hc_sinkhorn.compiled_constant(value), dtype=mx.float32)
        assert_bitwise(baked, eager, str(value))

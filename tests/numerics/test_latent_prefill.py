"""latent_prefill: DSA prefill in the latent space, quality-gated against stock.

Numerics-changing by design (stock prefill rounds per-head projected keys and
values; this rounds the absorbed query and the projected output, as decode
does), so the checks are closeness to stock and a teacher-forced gate, plus
bit-identity wherever the patch steps aside.
"""

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches import registry
from glm53_patches.exactness import logit_gate, same_bits
from glm53_patches.patches.gathered_prefill.checks.verify import indexer_like
from glm53_patches.patches.latent_prefill import PATCH, attend
from glm53_patches.tiny_model import build_model
from mlx_vlm.models.cache import KVCache
from mlx_vlm.models.glm5_next import language
from mlx_vlm.models.glm5_next.language import Glm5NextAttention

NAME = "latent_prefill"
STOCK = Glm5NextAttention.__dict__["_attend"]


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.fixture(params=["dense", "gathered"])
def path(request, monkeypatch):
    """Each test runs on both paths: dense (the default at these sizes) and gathered."""
    if request.param == "gathered":
        monkeypatch.setattr(attend, "DENSE_KEYS_PER_SLOT", 0)
    return f"prefill ({request.param})"


@pytest.fixture
def fast(monkeypatch, path):
    PATCH.stats.reset()
    call = PATCH.targets[f"{language.__name__}:Glm5NextAttention._attend"](STOCK)
    monkeypatch.setattr(Glm5NextAttention, "_attend", call)
    return call


def dsa_layer(bits_=None):
    model = build_model(seed=1, quantize_bits=bits_)
    return next(l.self_attn for l in model.language_model.model.layers if not l.is_linear)


def attend_inputs(attn, batch, length, keys, padded_rows=(), seed=0):
    """q, latent and indexer-shaped topk (holes, keys past the end, padded rows)."""
    mx.random.seed(seed)
    q = mx.random.normal((batch, attn.num_heads, length, attn.q_head_dim))
    latent = mx.random.normal((batch, 1, keys, attn.kv_lora_rank))
    width = 64
    topk = mx.array(indexer_like(batch, length, keys, width - 3, 4, seed, holes=0.05, beyond=0.01,
                                 padded_rows=padded_rows))
    return q, latent, topk


@pytest.mark.parametrize("batch,padded", [(1, ()), (2, [(0, 5), (1, 11)])])
@pytest.mark.parametrize("last_only", [False, True])
def test_close_to_stock_prefill(fast, path, batch, padded, last_only):
    attn = dsa_layer()
    q, latent, topk = attend_inputs(attn, batch, 37, 150, padded)
    ref, ref_topk = STOCK(attn, q, latent, latent, topk, KVCache(), None, last_only)
    got, got_topk = fast(attn, q, latent, latent, topk, KVCache(), None, last_only)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.array_equal(np.array(got_topk), np.array(ref_topk))
    scale = np.abs(f64(ref)).max()
    assert np.abs(f64(got) - f64(ref)).max() < 1e-5 * scale
    assert PATCH.stats.snapshot()["hits"] == {path: 1}


def test_blocks_of_queries_give_the_same_bits(fast, path, monkeypatch):
    """The query block size is memory tiling only: every block size, the same output."""
    attn = dsa_layer()
    q, latent, topk = attend_inputs(attn, 1, 40, 120)
    whole, _ = fast(attn, q, latent, latent, topk, KVCache(), None)
    for rows in (1, 7, 16):
        if path == "prefill (dense)":
            monkeypatch.setattr(attend, "DENSE_ELEMENTS", rows * attn.num_heads * latent.shape[2])
        else:
            monkeypatch.setattr(attend, "GATHER_ELEMENTS", rows * topk.shape[-1] * attn.kv_lora_rank)
        tiled, _ = fast(attn, q, latent, latent, topk, KVCache(), None)
        assert same_bits(tiled, whole), rows


def test_short_chunks_run_stock(fast):
    attn = dsa_layer()
    q, latent, topk = attend_inputs(attn, 2, language.DECODE_BLOCK_SIZE, 90)
    ref, _ = STOCK(attn, q, latent, latent, topk, KVCache(), None)
    got, _ = fast(attn, q, latent, latent, topk, KVCache(), None)
    assert same_bits(got, ref)
    assert PATCH.stats.snapshot() == {"hits": {}, "fallbacks": {"decode path (short chunk)": 1}}


@pytest.mark.parametrize("quantize_bits", [None, 4])
def test_tiny_model_teacher_forced_quality(fast, path, quantize_bits):
    """Gate: prompts of 300 tokens (the indexer selects 64 of up to 300 keys)."""
    lm = build_model(seed=0, quantize_bits=quantize_bits).language_model
    mx.random.seed(0)
    tokens = mx.random.randint(0, 512, (2, 300))
    logits = {}
    for arm, call in (("stock", STOCK), ("fast", fast)):
        Glm5NextAttention._attend = call
        logits[arm] = f64(lm(tokens, cache=lm.make_cache()).logits)
    dsa_layers = sum(not l.is_linear for l in lm.model.layers)
    assert PATCH.stats.snapshot()["hits"] == {path: dsa_layers}
    gate = logit_gate(logits["stock"], logits["fast"])
    # Measured (CPU): KL mean 3.2e-13, max 1.5e-12 (fp32); 3.2e-13 / 1.2e-12 (4-bit), either path.
    assert gate["kl_mean"] < 1e-10 and gate["kl_max"] < 1e-9, gate
    assert gate["clear"] > 0.95 and gate["top1_on_clear"], gate  # top-1 off stock's near-ties


def test_decode_after_patched_prefill(fast):
    """The caches a patched prefill leaves decode like stock's (the projected cache,
    which only prefill reads, is left empty and rebuilt by stock prefill if needed)."""
    lm = build_model(seed=0).language_model
    mx.random.seed(3)
    prompt, steps = mx.random.randint(0, 512, (1, 120)), mx.random.randint(0, 512, (1, 6))
    outs = {}
    for arm, call in (("stock", STOCK), ("fast", fast)):
        Glm5NextAttention._attend = call
        cache = lm.make_cache()
        lm(prompt, cache=cache)
        outs[arm] = [f64(lm(steps[:, i:i + 1], cache=cache).logits) for i in range(steps.shape[1])]
    for ref, got in zip(outs["stock"], outs["fast"]):
        assert np.abs(ref - got).max() < 1e-4 * np.abs(ref).max()


def test_through_the_registry():
    PATCH.stats.reset()
    try:
        outcome = registry.apply([NAME], strict=True)[NAME]
        assert outcome["state"] == "applied", outcome
        attn = dsa_layer()
        q, latent, topk = attend_inputs(attn, 1, 20, 80)
        attn._attend(q, latent, latent, topk, KVCache(), None)
        assert PATCH.stats.snapshot()["hits"] == {"prefill (dense)": 1}
    finally:
        registry.revert([NAME])
    assert Glm5NextAttention.__dict__["_attend"] is STOCK


def test_composes_with_dsa_decode():
    """Both replace _attend: each hands the other what it does not handle."""
    from glm53_patches.patches.dsa_decode import PATCH as DSA

    lm = build_model(seed=0).language_model
    mx.random.seed(4)
    prompt, token = mx.random.randint(0, 512, (1, 90)), mx.random.randint(0, 512, (1, 1))
    PATCH.stats.reset(), DSA.stats.reset()
    try:
        applied = registry.apply([NAME, "dsa_decode"], strict=True)
        assert all(applied[n]["state"] == "applied" for n in (NAME, "dsa_decode")), applied
        cache = lm.make_cache()
        lm(prompt, cache=cache)
        lm(token, cache=cache)
        assert PATCH.stats.snapshot()["hits"]["prefill (dense)"] > 0 and DSA.stats.snapshot()["hits"]["attend"] > 0
    finally:
        registry.revert([NAME, "dsa_decode"])
    assert Glm5NextAttention.__dict__["_attend"] is STOCK

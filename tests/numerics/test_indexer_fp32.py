"""indexer_fp32: the compiled score is bit-identical to stock on this backend,
and the patch (and the GPU kernel's arithmetic, emulated) selects pools no
worse than stock, measured against a float64 reference indexer.

Exact means bit-identical: comparisons are on raw bits (uint views).
"""

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches import registry
from glm53_patches.patches.indexer_fp32 import PATCH, kernels, score
from glm53_patches.patches.indexer_fp32.checks import quality
from glm53_patches.tiny_model import build_model, greedy_logits
from glm53_patches.exactness import same_bits
from mlx_vlm.models.glm5_next import language

NAME = "indexer_fp32"
SCORE = "mlx_vlm.models.glm5_next.language:_score_index_keys"
SELECT = "mlx_vlm.models.glm5_next.language:_exact_pool_select"
STOCK_SCORE = vars(language)["_score_index_keys"]
STOCK_SELECT = vars(language)["_exact_pool_select"]
FILL = mx.finfo(mx.float32).min


@contextlib.contextmanager
def installed():
    """The patch's own factories over stock (the registry path is tested below)."""
    language._score_index_keys = PATCH.targets[SCORE](STOCK_SCORE)
    language._exact_pool_select = PATCH.targets[SELECT](STOCK_SELECT)
    try:
        yield
    finally:
        language._score_index_keys = STOCK_SCORE
        language._exact_pool_select = STOCK_SELECT


@pytest.fixture
def stats():
    PATCH.stats.reset()
    yield
    PATCH.on_revert()


def assert_bitwise(ref, got, what=""):
    assert ref.shape == got.shape and ref.dtype == got.dtype, what
    assert same_bits(ref, got), what


def counts():
    snapshot = PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def inputs(batch, length, heads, dim, pools, dtype, seed=0):
    kq, kk, kw = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, length, heads, dim), key=kq).astype(dtype)
    keys = mx.random.normal((batch, pools, dim), key=kk).astype(dtype)
    weights = mx.random.normal((batch, length, heads), key=kw) * heads**-0.5
    return q, keys, weights


# -- exactness of the compiled path ---------------------------------------------------


# Several shapes through one shapeless trace: decode, prefill chunks, batches,
# a single pool, the real 32 x 128 heads.
SHAPES = [(1, 1, 32, 128, 1024), (1, 7, 4, 64, 5), (2, 3, 4, 64, 17), (1, 16, 32, 128, 300), (1, 1, 4, 64, 1)]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=["fp32", "bf16", "fp16"])
def test_score_is_bitwise_stock(stats, dtype):
    for i, shape in enumerate(SHAPES):
        q, keys, weights = inputs(*shape, dtype, seed=i)
        scale = shape[3] ** -0.5
        expected = STOCK_SCORE(q, keys, weights, scale)
        with installed():
            assert_bitwise(expected, language._score_index_keys(q, keys, weights, scale), shape)
    assert counts() == ({"compiled": len(SHAPES)}, {})
    assert len(score._COMPILED) == 1


@pytest.mark.parametrize("chunk_size", [512, 5])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_select_is_bitwise_stock(stats, dtype, chunk_size):
    # Two rows with different numbers of valid pools (as a ragged cache gives),
    # queries that see only the pools that ended before them.
    batch, length, pools, kpool = 2, 12, 20, 4
    q, keys, weights = inputs(batch, length, 4, 64, pools, dtype)
    pool_ends = mx.broadcast_to(mx.arange(pools) * kpool + kpool - 1, (batch, pools))
    pool_valid = mx.arange(pools)[None] < mx.array([[pools], [pools - 6]])
    positions = pools * kpool - length * 3 + 3 * mx.arange(length)
    args = (q, keys, weights, pool_ends, pool_valid, positions, 3, 64**-0.5, chunk_size)
    expected = STOCK_SELECT(*args)
    with installed():
        got = language._exact_pool_select(*args)
    for ref, out in zip(expected, got):
        assert_bitwise(ref, out)
    hits, fallbacks = counts()
    assert hits == {"compiled": -(-length // chunk_size)} and fallbacks == {}


def test_steps_aside_with_stock_results(stats):
    q, keys, weights = inputs(1, 3, 4, 64, 8, mx.float32)
    wide = mx.concatenate([keys, keys + 1])  # another batch size: stock broadcasts
    qi = (q * 4).astype(mx.int32)  # integer queries: stock casts them
    ends, valid, positions = mx.zeros((1, 8), dtype=mx.int32), mx.ones((1, 8), dtype=mx.bool_), mx.arange(3)
    calls = [
        (language, "_score_index_keys", (q, wide, weights, 0.125)),
        (language, "_score_index_keys", (qi, keys, weights, 0.125)),
        # every pool selected: stock does not score at all
        (language, "_exact_pool_select", (None, keys, None, ends, valid, positions, 8, 0.125)),
    ]
    for module, name, args in calls:
        expected = getattr(module, name)(*args)
        with installed():
            got = getattr(module, name)(*args)
        for ref, out in zip(*(x if isinstance(x, tuple) else (x,) for x in (expected, got))):
            assert_bitwise(ref, out, name)
    assert counts() == ({}, {"shape": 1, "dtype": 1, "all pools": 1})


def test_kernel_switch_and_routing(stats, monkeypatch):
    """The GPU kernel cannot run here: a stand-in records what it would be given."""
    given = []

    def stand_in(backend, q, keys, ws, candidates=None):
        given.append((backend, q.shape[1], ws.dtype, candidates is not None))
        scores = STOCK_SCORE(q, keys, ws, 1.0)
        return scores if candidates is None else mx.where(candidates, scores, FILL)

    monkeypatch.setattr(kernels, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kernels, "scores", stand_in)
    q, keys, weights = inputs(1, 20, 4, 64, 12, mx.bfloat16)
    ends, valid = (mx.arange(12) * 4 + 3)[None], mx.ones((1, 12), dtype=mx.bool_)
    positions = 28 + mx.arange(20)

    def run():
        with installed():
            language._score_index_keys(q[:, :1], keys, weights[:, :1], 0.125)  # decode
            return language._exact_pool_select(q, keys, weights, ends, valid, positions, 3, 0.125, 16)

    expected = STOCK_SELECT(q, keys, weights, ends, valid, positions, 3, 0.125, 16)
    for value in ("0", None, "1"):  # off, default (off), on
        if value is None:
            monkeypatch.delenv("GLM53_INDEXER_FP32_KERNEL", raising=False)
        else:
            monkeypatch.setenv("GLM53_INDEXER_FP32_KERNEL", value)
        score.clear()  # the knob is read once per process
        for ref, out in zip(expected, run()):
            assert_bitwise(ref, out, value)
    # On: the decode call and the 4-query tail chunk go to the kernel with
    # float32 head weights; the 16-query chunk stays on the compiled path
    # (GLM53_INDEXER_FP32_KERNEL_MAX_QUERIES, default 16: 16 is served).
    assert given == [("cuda", 1, mx.float32, False), ("cuda", 16, mx.float32, True), ("cuda", 4, mx.float32, True)]
    monkeypatch.setenv("GLM53_INDEXER_FP32_KERNEL_MAX_QUERIES", "8")
    score.clear()
    given.clear()
    run()
    assert [g[1] for g in given] == [1, 4]
    hits, fallbacks = counts()
    assert hits == {"compiled": 2 * 3 + 1, "kernel-cuda": 3 + 2} and fallbacks == {"kernel queries": 1}


def test_tiny_model_bitwise_through_registry():
    model = build_model(index_topk=16, seed=1).language_model  # fp32: 4 of up to 27 pools
    prompt = mx.array([[(7 * i) % 480 + 20 for i in range(96)]])
    stock = greedy_logits(model, prompt, 12)
    PATCH.stats.reset()
    try:
        outcome = registry.apply([NAME], strict=True)[NAME]
        assert outcome["state"] == "applied", outcome
        patched = greedy_logits(model, prompt, 12)
    finally:
        registry.revert([NAME])
    for step, (a, b) in enumerate(zip(stock, patched)):
        assert_bitwise(a, b, step)
    hits, fallbacks = counts()
    # 2 DSA layers with their own indexer (layer 5 shares layer 2's), 13 calls each
    assert hits == {"compiled": 26} and fallbacks == {}, (hits, fallbacks)
    assert vars(language)["_score_index_keys"] is STOCK_SCORE
    assert vars(language)["_exact_pool_select"] is STOCK_SELECT
    assert not score._COMPILED


# -- quality gate ------------------------------------------------------------------------------


def reference_scores(q, keys, weights, scale):
    """The indexer score in float64, written out: sum_h relu(q_h . k) * w_h * scale."""
    q64 = np.array(q.astype(mx.float32), dtype=np.float64)
    k64 = np.array(keys.astype(mx.float32), dtype=np.float64)
    w64 = np.array(weights.astype(mx.float32), dtype=np.float64)
    out = np.zeros(q64.shape[:2] + (k64.shape[1],))
    for h in range(q64.shape[2]):
        dots = np.einsum("bld,bpd->blp", q64[:, :, h], k64)
        out += np.maximum(dots, 0.0) * (w64[:, :, h, None] * scale)
    return out


def overlap(selected, reference):
    selected = np.array(selected).reshape(-1, reference.shape[-1])
    reference = reference.reshape(-1, reference.shape[-1])
    return np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(selected, reference)])


QUERIES, SELECT_K = 8, 128
# Two swapped pools among all QUERIES x 128 selections. Measured
# (quality.py, 2 seeds x 64 queries x 256/1024/2048 pools): stock, patch and
# the kernel-order emulation all select exactly the float64 reference's pools
# (overlap 1.0); bf16 dot products (the positive control) lose 0.07-0.27 %.
OVERLAP_MARGIN = 2 / (QUERIES * SELECT_K)


@pytest.mark.parametrize("pools", [256, 1024, 2048])
def test_overlap_gate_real_dimensions(pools):
    # 32 heads x 128, bf16 q and pool keys, kpool 16: 4k / 16k / 32k keys.
    args = quality.real_inputs(pools, QUERIES, seed=pools)
    q, keys, weights, pool_ends, pool_valid, positions = args
    scale = 128**-0.5
    reference = reference_scores(q, keys, weights, scale)
    visible = np.array(pool_valid[:, None] & (pool_ends[:, None] <= positions[None, :, None]))
    reference = np.argsort(-np.where(visible, reference, -np.inf), axis=-1, kind="stable")[..., :SELECT_K]
    found = {}
    for name in ("stock", "patch", "kernel-order", "model-dtype"):
        with quality.arm(name):
            found[name] = overlap(language._exact_pool_select(*args, SELECT_K, scale)[0], reference)
    assert found["patch"] >= found["stock"] - OVERLAP_MARGIN, found
    assert found["kernel-order"] >= found["stock"] - OVERLAP_MARGIN, found
    assert found["stock"] >= 1 - OVERLAP_MARGIN, found  # float32 suffices here
    assert found["model-dtype"] < 1, found  # the measurement can see a change


# Teacher forcing: one 96-token prefill (24 pools, 4 selected per query,
# always-select-tail on), then 8 single-token steps through the caches.
KL_LENGTH, KL_PREFILL = 104, 96
# Measured (quality.py; 320 tokens x 2 seeds and 104 tokens x 3 seeds):
# KL(reference || stock) = KL(reference || patch) = KL(reference ||
# kernel-order) = 0 exactly (no selection differs from the float64
# reference). Positive control (bf16 dot products): one flipped selection
# costs 0.02-0.4 nats at its position, mean KL 2e-4 to 1e-2. The margin is
# 20x below one such flip over 104 positions, so it allows float-noise-level
# differences but not a changed selection that matters.
KL_MARGIN = 1e-5


def test_teacher_forced_kl_gate(monkeypatch):
    lm = quality.tiny_bf16_model(seed=0)  # 4-bit weights, bf16 activations, 4 pools selected
    tokens = mx.array(np.random.default_rng(0).integers(20, 512, size=(1, KL_LENGTH)))

    def run(name):
        if name == "reference":
            with monkeypatch.context() as m:
                m.setattr(language, "_score_index_keys", lambda q, k, w, s: mx.array(reference_scores(q, k, w, s)))
                return quality.teacher_forced_logits(lm, tokens, KL_PREFILL)
        with quality.arm(name):
            return quality.teacher_forced_logits(lm, tokens, KL_PREFILL)

    reference = run("reference")
    kl = {name: quality.kl(reference, run(name)).mean() for name in ("stock", "patch", "kernel-order", "model-dtype")}
    assert kl["patch"] <= kl["stock"] + KL_MARGIN, kl
    assert kl["kernel-order"] <= kl["stock"] + KL_MARGIN, kl
    assert kl["model-dtype"] > KL_MARGIN, kl  # the measurement can see a change

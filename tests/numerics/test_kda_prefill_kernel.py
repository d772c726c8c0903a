"""kda_prefill_kernel: chunked KDA prefill, quality-gated against stock.

The patch changes numerics (chunked matmuls instead of a per-token loop), so
nothing here is bitwise except the paths it must leave to stock. Errors are
measured against a float64 per-token recurrence written here in numpy; the
bounds are set from measurements (PATCH.md, "Quality"):

- recurrent state, float32 and bf16 inputs, T=300, chunks 16 and 64: the
  patch's max error was 0.37x-1.18x stock's (stock: 6e-7 to 1.1e-6 on states
  of magnitude ~2); bound 2x stock's.
- y (valid positions), float32: 0.75x-2.11x stock's (6e-8 to 8.5e-8 on
  |y| ~ 0.2); bound 3x. bf16: both are bf16's output rounding, 1.00x; bound 1.5x.
- tiny model, 2 x 320 teacher-forced tokens: KL(stock || patch) mean 1.2e-12,
  max 6e-12 nats, top-1 agreement 640/640; bounds 1e-9 and all positions
  whose stock top-1 margin exceeds 1e-3 (the measured minimum margin was 9e-4).
"""

import logging
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from glm53_patches import registry
from glm53_patches.exactness import logit_gate, same_bits
from glm53_patches.patches.kda_prefill_kernel import PATCH, chunked, cuda, mixer
from glm53_patches.tiny_model import build_model
from mlx_vlm.models import gated_delta
from mlx_vlm.models.cache import ArraysCache
from mlx_vlm.models.glm5_next.config import TextConfig
from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

NAME = "kda_prefill_kernel"
HIDDEN = 128
LB = -5.0
STOCK = Glm5NextLinearAttention.__dict__["__call__"]
TARGET = "mlx_vlm.models.glm5_next.language:Glm5NextLinearAttention.__call__"


@pytest.fixture
def patched():
    """Install the patch's factory over stock directly (the registry path has its own test)."""
    PATCH.stats.reset()
    Glm5NextLinearAttention.__call__ = PATCH.targets[TARGET](STOCK)
    yield STOCK
    Glm5NextLinearAttention.__call__ = STOCK
    PATCH.on_revert()


def counts():
    snapshot = PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def max_abs(a, b):
    return float(np.abs(f64(a) - f64(b)).max()) if isinstance(b, mx.array) else float(np.abs(f64(a) - b).max())


# -- the recurrence against float64 ---------------------------------------------


def reference(q, k, v, a, b, A_log, dt_bias, state, mask):
    """The gated delta rule token by token in float64 (stock semantics).

    The gate is computed in float64 from the same inputs; beta is stock's own
    sigmoid in the input dtype (both implementations share that rounding).
    """
    q, k, v, a, A_log, dt_bias, S = map(f64, (q, k, v, a, A_log, dt_bias, state))
    beta = f64(mx.sigmoid(b))
    g = np.exp(LB / (1.0 + np.exp(-np.exp(A_log) * (a + dt_bias))))
    keep = np.array(mask)
    ys = np.zeros(v.shape)
    for t in range(q.shape[1]):
        new = S * g[:, t, :, None, :]
        delta = (v[:, t] - (new * k[:, t, :, None, :]).sum(-1)) * beta[:, t, :, None]
        new = new + k[:, t, :, None, :] * delta[..., None]
        ys[:, t] = (new * q[:, t, :, None, :]).sum(-1)
        S = np.where(keep[:, t, None, None, None], new, S)  # masked: state unchanged
    return ys, S


def recurrence_inputs(dtype, seed, batch=2, length=300, heads=4, dim=64):
    mx.random.seed(seed)
    shape = (batch, length, heads, dim)
    # q, k normalized and scaled as the mixer does
    q = dim**-1.0 * mx.fast.rms_norm(mx.random.normal(shape), None, 1e-6)
    k = dim**-0.5 * mx.fast.rms_norm(mx.random.normal(shape), None, 1e-6)
    v, a = mx.random.normal(shape), mx.random.normal(shape)
    b = mx.random.normal(shape[:3])
    A_log = mx.random.uniform(0.0, 1.4, (heads, 1))
    dt_bias = mx.random.uniform(-4.0, -1.0, (heads, dim))
    state = 0.5 * mx.random.normal((batch, heads, dim, dim))
    mask = mx.arange(length)[None] >= mx.array([0, 37])[:, None]  # row 1 left-padded
    return [x.astype(dtype) for x in (q, k, v, a, b)] + [A_log, dt_bias, state, mask]


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_recurrence_error_same_order_as_stock(dtype, chunk):
    q, k, v, a, b, A_log, dt_bias, state, mask = inputs = recurrence_inputs(dtype, seed=chunk)
    y_ref, s_ref = reference(*inputs)
    valid = np.array(mask)[:, :, None, None]
    # stock on this backend (CPU: gated_delta_ops, the per-token loop)
    y_stock, s_stock = gated_delta.gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, lower_bound=LB
    )
    y_fast, s_fast = chunked.chunked_gated_delta(
        q, k, v, chunked.log_gate(A_log, a, dt_bias, LB), mx.sigmoid(b), state, mask,
        chunk=chunk, sub=chunked.sub_block(chunk, LB),
    )
    assert y_fast.dtype == dtype and s_fast.dtype == mx.float32
    assert y_fast.shape == y_stock.shape and s_fast.shape == s_stock.shape
    err = {}
    for name, y, s in (("stock", y_stock, s_stock), ("fast", y_fast, s_fast)):
        err[name] = (max_abs(s, s_ref), float(np.abs(np.where(valid, f64(y) - y_ref, 0)).max()))
    (s_stock_err, y_stock_err), (s_fast_err, y_fast_err) = err["stock"], err["fast"]
    # the bounds below are relative to stock's error; make sure that is small
    assert s_stock_err < 1e-5 and y_stock_err < (1e-6 if dtype == mx.float32 else 2e-3), err
    assert s_fast_err <= 2.0 * s_stock_err, err
    assert y_fast_err <= (3.0 if dtype == mx.float32 else 1.5) * y_stock_err, err
    # masked positions output 0 (as stock's Metal kernel)
    assert not np.any(f64(y_fast)[~np.array(mask)])


def test_sub_block_keeps_exponents_finite():
    assert chunked.sub_block(64, -5.0) == 16  # |lb| S = 80
    assert chunked.sub_block(16, -5.0) == 16
    assert chunked.sub_block(64, -6.0) == 8
    assert chunked.sub_block(64, -100.0) is None


def test_forward_substitution_inverse_matches_lapack():
    """The non-CPU inverse (forward substitution) is not run by the CPU path: check it here."""
    mx.random.seed(5)
    A = mx.tril(0.5 * mx.random.normal((3, 2, 16, 16)), -1)
    fwd, lapack = chunked._unit_lower_inverse(A), chunked._tri_inverse(A)
    assert max_abs(fwd, lapack) < 1e-5
    assert max_abs(fwd @ (A + mx.eye(16)), np.eye(16)) < 1e-5


def test_strong_decay_stays_finite():
    """Gates at the bound for a whole chunk: e^(|lb| S) is the largest factor."""
    q, k, v, a, b, A_log, dt_bias, state, mask = recurrence_inputs(mx.float32, seed=3, length=96)
    a = mx.full(a.shape, 30.0)  # sigmoid -> 1: log g = lower bound everywhere
    y_ref, s_ref = reference(q, k, v, a, b, A_log, dt_bias, state, mask)
    y, s = chunked.chunked_gated_delta(
        q, k, v, chunked.log_gate(A_log, a, dt_bias, LB), mx.sigmoid(b), state, mask, chunk=64, sub=16
    )
    assert np.isfinite(f64(s)).all() and np.isfinite(f64(y)).all()
    assert max_abs(s, s_ref) < 1e-5 and max_abs(y, np.where(np.array(mask)[:, :, None, None], y_ref, 0)) < 1e-6


# -- the mixer -----------------------------------------------------------------


def make_layer(dtype=mx.float32, seed=0):
    config = TextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        rms_norm_eps=1e-5,
        linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": LB},
    )
    layer = Glm5NextLinearAttention(config, layer_idx=0)
    mx.random.seed(seed)
    params = tree_map(lambda p: 0.3 * mx.random.normal(p.shape), layer.parameters())
    params["o_norm"]["weight"] = 1.0 + params["o_norm"]["weight"]
    params["dt_bias"] = params["dt_bias"] - 2.0  # gates around 0.8-0.95
    layer.update(params)
    if dtype != mx.float32:
        layer.set_dtype(dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


PADDING = [0, 5, 40]
# Mixer outputs vs stock, max |diff| / max |stock| over valid positions
# (3 seeds, batch 3 padded, 200 tokens). The o_norm rescales y per token, so
# the recurrence's error grows where |y| is small. fp32 measured 1.6e-6 (chunk
# 16) to 7.2e-6 (chunk 128): bound 2e-5. bf16: 2e-3 to 4e-3, i.e. one bf16
# ulp (2^-8): bound 4 ulps.
OUT_TOL = {mx.float32: 2e-5, mx.bfloat16: 4 * 2**-8}


def rel_diff(got, ref, valid=None):
    diff = np.abs(f64(got) - f64(ref))
    return float((diff if valid is None else diff[valid]).max() / np.abs(f64(ref)).max())


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_mixer_batched_padded_and_resumed(patched, dtype):
    stock = patched
    layer = make_layer(dtype)
    length, split = 200, 77
    x = mx.random.normal((len(PADDING), length, HIDDEN)).astype(dtype)
    ref_cache = ArraysCache(2, left_padding=PADDING)
    ref = stock(layer, x, ref_cache.make_mask(length), ref_cache)

    one_cache = ArraysCache(2, left_padding=PADDING)
    one = layer(x, one_cache.make_mask(length), one_cache)
    two_cache = ArraysCache(2, left_padding=PADDING)
    first = layer(x[:, :split], two_cache.make_mask(split), two_cache)
    second = layer(x[:, split:], two_cache.make_mask(length - split), two_cache)
    two = mx.concatenate([first, second], axis=1)
    hits, fallbacks = counts()
    assert hits == {"prefill (chunked)": 3} and not fallbacks

    assert one.dtype == ref.dtype == two.dtype
    valid = np.array(mx.arange(length)[None] >= mx.array(PADDING)[:, None])
    for got, what in ((one, "one call"), (two, "two calls")):
        assert rel_diff(got, ref, valid) < OUT_TOL[dtype], what
        # left padding: masked tokens have q = k = v = 0, so stock outputs 0 there too
        assert not np.any(f64(got)[~valid]) and not np.any(f64(ref)[~valid]), what
    assert max_abs(two_cache[1], one_cache[1]) < 1e-5
    assert max_abs(one_cache[1], ref_cache[1]) < 1e-5
    assert one_cache[1].dtype == ref_cache[1].dtype == mx.float32
    # the conv window is stock's code path: bit-identical
    assert same_bits(one_cache[0], ref_cache[0])
    assert same_bits(two_cache[0], ref_cache[0])


def test_padding_does_not_touch_the_state(patched):
    """A left-padded row ends in the state of the same row run alone, unpadded."""
    layer = make_layer()
    length = 150
    x = mx.random.normal((len(PADDING), length, HIDDEN))
    cache = ArraysCache(2, left_padding=PADDING)
    out = layer(x, cache.make_mask(length), cache)
    for row, pad in enumerate(PADDING):
        alone = ArraysCache(2)
        out_alone = layer(x[row : row + 1, pad:], None, alone)
        assert max_abs(cache[1][row], alone[1][0]) < 1e-5, row
        assert rel_diff(out[row, pad:], out_alone[0]) < OUT_TOL[mx.float32], row


def test_right_padding_by_lengths(patched):
    """``cache.lengths`` masks the tail instead: the state stops at each row's end.

    Outputs are compared at valid positions only: at masked ones stock's CPU
    path outputs q . (the state the token would have written), the patch 0.
    """
    stock = patched
    layer = make_layer()
    lengths, length = [120, 97, 64], 120
    x = mx.random.normal((len(lengths), length, HIDDEN))
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        cache.lengths = mx.array(lengths)
    ref = stock(layer, x, caches[0].make_mask(length), caches[0])
    got = layer(x, caches[1].make_mask(length), caches[1])
    valid = np.array(mx.arange(length)[None] < mx.array(lengths)[:, None])
    assert rel_diff(got, ref, valid) < OUT_TOL[mx.float32]
    assert max_abs(caches[1][1], caches[0][1]) < 1e-5
    assert same_bits(caches[1][0], caches[0][0])
    assert counts()[0] == {"prefill (chunked)": 1}


def test_decode_and_unhandled_cases_run_stock(patched, monkeypatch):
    stock = patched
    layer = make_layer()
    prompt = mx.random.normal((len(PADDING), 9, HIDDEN))
    caches = [ArraysCache(2, left_padding=PADDING) for _ in range(2)]
    for cache in caches:
        stock(layer, prompt, cache.make_mask(9), cache)

    # decode: the wrapped object runs, bit for bit
    token = mx.random.normal((len(PADDING), 1, HIDDEN))
    ref = stock(layer, token, caches[0].make_mask(1), caches[0])
    got = layer(token, caches[1].make_mask(1), caches[1])
    assert same_bits(ref, got) and same_bits(caches[0][1], caches[1][1])
    assert counts() == ({}, {"decode (length 1)": 1})

    # speculation wants per-token states: stock's recurrence, bit for bit
    PATCH.stats.reset()
    for cache in caches:
        cache.start_speculation(4)
    block = mx.random.normal((len(PADDING), 4, HIDDEN))
    ref = stock(layer, block, caches[0].make_mask(4), caches[0])
    got = layer(block, caches[1].make_mask(4), caches[1])
    assert same_bits(ref, got) and same_bits(caches[0][1], caches[1][1])
    assert counts() == ({}, {"speculative history": 1})

    # no gate bound: stock
    PATCH.stats.reset()
    layer.lower_bound = None
    x = mx.random.normal((1, 20, HIDDEN))
    assert same_bits(stock(layer, x), layer(x))
    assert counts() == ({}, {"no gate lower bound": 1})


def test_chunk_knob(patched, monkeypatch, caplog):
    layer = make_layer()
    x = mx.random.normal((1, 70, HIDDEN))
    ref = STOCK(layer, x)
    for value in ("32", "128"):
        monkeypatch.setenv("GLM53_KDA_PREFILL_KERNEL_CHUNK", value)
        assert mixer.chunk_size() == int(value)
        assert rel_diff(layer(x), ref) < OUT_TOL[mx.float32]
    monkeypatch.setenv("GLM53_KDA_PREFILL_KERNEL_CHUNK", "48")
    assert mixer.chunk_size() == mixer.DEFAULT_CHUNK
    assert "GLM53_KDA_PREFILL_KERNEL_CHUNK='48' is not valid" in caplog.text


# -- the CUDA kernel's dispatch (the kernel itself cannot run on the CPU) ---------
# Its arithmetic is checked by host_check.py (the body as C++ against float64)
# and on a GPU by device_check.py; here: the knob, the shape guard, and which
# path the mixer takes and counts.

METHOD = "GLM53_KDA_PREFILL_KERNEL_METHOD"


def test_method_knob_off_cuda(patched, monkeypatch, caplog):
    """On the CPU, auto and kernel both run the chunked path; a bad value logs once and means auto."""
    caplog.set_level(logging.INFO, logger="glm53_patches")
    layer = make_layer()
    x = mx.random.normal((1, 30, HIDDEN))
    ref = STOCK(layer, x)
    mixer.clear()
    for value in (None, "auto", "kernel", "KERNEL", "chunked"):
        if value is None:
            monkeypatch.delenv(METHOD, raising=False)
        else:
            monkeypatch.setenv(METHOD, value)
        assert mixer.method() == "chunked"
        assert rel_diff(layer(x), ref) < OUT_TOL[mx.float32]
    assert counts() == ({"prefill (chunked)": 5}, {})
    assert caplog.text.count("no CUDA device here, using chunked") == 1  # kernel and KERNEL: logged once

    monkeypatch.setenv(METHOD, "fast")
    caplog.clear()
    assert mixer.method() == "chunked" and mixer.method() == "chunked"
    assert caplog.text.count(f"{METHOD}='fast' is not valid") == 1
    assert "auto, kernel, chunked" in caplog.text and "using auto" in caplog.text
    assert [r.levelname for r in caplog.records] == ["ERROR"]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend the default device is CUDA; the 'kernel' records its calls and runs the chunked path."""
    calls = []

    def kernel(q, k, v, log_g, beta, state, mask=None, **_):
        calls.append(q.shape)
        if cuda.unsupported(q, k, v, log_g, beta, state, mask) is not None:
            return None
        return chunked.chunked_gated_delta(q, k, v, log_g, beta, state, mask, chunk=16, sub=16)

    monkeypatch.setattr(cuda, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda, "kernel_gated_delta", kernel)
    return calls


def test_method_dispatch_on_cuda(patched, fake_cuda, monkeypatch):
    layer = make_layer()
    x = mx.random.normal((2, 40, HIDDEN))
    ref = STOCK(layer, x)
    for value, kernel_calls in (("auto", 1), ("kernel", 2), ("chunked", 2)):
        monkeypatch.setenv(METHOD, value)
        assert mixer.method() == ("chunked" if value == "chunked" else "kernel")
        assert rel_diff(layer(x), ref) < OUT_TOL[mx.float32]
        assert len(fake_cuda) == kernel_calls
    assert counts() == ({"prefill (cuda kernel)": 2, "prefill (chunked)": 1}, {})
    # speculative history still goes to stock's recurrence, not the kernel
    PATCH.stats.reset()
    monkeypatch.setenv(METHOD, "auto")
    caches = [ArraysCache(2) for _ in range(2)]
    for cache in caches:
        STOCK(layer, x[:, :9], None, cache)
        cache.start_speculation(4)
    block = mx.random.normal((2, 4, HIDDEN))
    assert same_bits(STOCK(layer, block, None, caches[0]), layer(block, None, caches[1]))
    assert counts() == ({}, {"speculative history": 1}) and len(fake_cuda) == 2


def test_kernel_declines_to_chunked(patched, fake_cuda, monkeypatch):
    """A shape the kernel does not take (head dim 48) runs chunked, counted as a fallback."""
    monkeypatch.setenv(METHOD, "kernel")
    config = TextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        linear_attn_config={"head_dim": 48, "num_heads": 2, "short_conv_kernel_size": 4, "gate_lower_bound": LB},
    )
    layer = Glm5NextLinearAttention(config, layer_idx=0)
    layer.eval()
    x = mx.random.normal((1, 20, HIDDEN))
    assert rel_diff(layer(x), STOCK(layer, x)) < OUT_TOL[mx.float32]
    reason = "cuda kernel: key dim (multiple of 32 up to 256) (chunked instead)"
    assert counts() == ({"prefill (chunked)": 1}, {reason: 1}) and len(fake_cuda) == 1


def test_kernel_shape_guard():
    B, T, H, D = 2, 9, 3, 64

    def args(dk=D, dv=D, dtype=mx.float32, with_state=True, with_mask=True, **change):
        a = dict(
            q=mx.zeros((B, T, H, dk), dtype), k=mx.zeros((B, T, H, dk), dtype), v=mx.zeros((B, T, H, dv), dtype),
            log_g=mx.zeros((B, T, H, dk)), beta=mx.zeros((B, T, H)),
            state=mx.zeros((B, H, dv, dk)) if with_state else None,
            mask=mx.ones((B, T), mx.bool_) if with_mask else None,
        )
        a.update(change)
        return a

    goods = (args(), args(dk=32, dv=15), args(dk=256, dv=128, dtype=mx.bfloat16))
    goods += (args(with_state=False, with_mask=False),)
    for good in goods:
        assert cuda.unsupported(**good) is None
        assert cuda.kernel_gated_delta(**good) is None  # not CUDA here: the caller runs chunked
    bad = {
        "key dim (multiple of 32 up to 256)": [args(dk=48), args(dk=288), args(dk=16)],
        "shape": [args(v=mx.zeros((B, T + 1, H, D))), args(beta=mx.zeros((B, T))), args(k=mx.zeros((B, T, H + 1, D)))],
        "dtype": [args(dtype=mx.int32), args(v=mx.zeros((B, T, H, D), mx.bfloat16))],
        "state shape": [args(state=mx.zeros((B, H, D, D + 32)))],
        "mask": [args(mask=mx.ones((1, T), mx.bool_)), args(mask=mx.ones((B, T), mx.int32))],
        "empty": [args(q=mx.zeros((B, 0, H, D)), k=mx.zeros((B, 0, H, D)), v=mx.zeros((B, 0, H, D)),
                       log_g=mx.zeros((B, 0, H, D)), beta=mx.zeros((B, 0, H)), mask=None)],
    }
    for reason, cases in bad.items():
        for case in cases:
            assert cuda.unsupported(**case) == reason, reason
    assert [cuda.rows_per_warp(dk, dv) for dk, dv in ((128, 128), (256, 128), (64, 30), (128, 15))] == [4, 2, 2, 1]


def test_composes_with_compiled_kda_decode():
    """Either order: decode goes to compiled_kda_decode, prefill to this patch."""
    from glm53_patches.patches.compiled_kda_decode import step

    layer = make_layer()
    PATCH.stats.reset()
    try:
        for call in (mixer.make_call(step.make_call(STOCK)), step.make_call(mixer.make_call(STOCK))):
            caches = [ArraysCache(2) for _ in range(2)]
            prompt = mx.random.normal((1, 33, HIDDEN))
            ref = STOCK(layer, prompt, None, caches[0])
            assert rel_diff(call(layer, prompt, None, caches[1]), ref) < OUT_TOL[mx.float32]
            token = mx.random.normal((1, 1, HIDDEN))
            ref = STOCK(layer, token, None, caches[0])
            got = call(layer, token, None, caches[1])
            assert rel_diff(got, ref) < OUT_TOL[mx.float32]
        assert PATCH.stats.snapshot()["hits"] == {"prefill (chunked)": 2}
    finally:
        step.clear()


# -- model level: quality gate and registry --------------------------------------


def test_tiny_model_teacher_forced_quality(patched):
    stock = patched
    model = build_model(seed=0)
    lm = model.language_model
    mx.random.seed(0)
    tokens = mx.random.randint(0, 512, (2, 320))
    logits = {}
    for arm, call in (("stock", stock), ("fast", Glm5NextLinearAttention.__call__)):
        Glm5NextLinearAttention.__call__ = call
        logits[arm] = f64(lm(tokens, cache=lm.make_cache()).logits)
    assert counts()[0] == {"prefill (chunked)": 5}  # every KDA layer of the tiny model
    gate = logit_gate(logits["stock"], logits["fast"])
    assert gate["kl_mean"] < 1e-9 and gate["kl_max"] < 1e-9, gate
    assert gate["clear"] > 0.95 and gate["top1_on_clear"], gate  # top-1 off stock's near-ties


def test_through_the_registry():
    PATCH.stats.reset()
    try:
        outcome = registry.apply([NAME], strict=True)[NAME]
        assert outcome["state"] == "applied", outcome
        layer = make_layer()
        x = mx.random.normal((1, 24, HIDDEN))
        assert rel_diff(layer(x), STOCK(layer, x)) < OUT_TOL[mx.float32]
        assert counts()[0] == {"prefill (chunked)": 1}
    finally:
        registry.revert([NAME])
    assert Glm5NextLinearAttention.__dict__["__call__"] is STOCK


def test_bench_smoke(capsys):
    """bench.py runs end to end (tiny widths; no timing is asserted)."""
    from glm53_patches.patches.kda_prefill_kernel.checks import bench

    common = ["--lengths", "40", "--rounds", "1", "--chunks", "16", "--heads", "2", "--head-dim", "32"]
    assert bench.main(common + ["--dtype", "float32"]) == 0
    assert bench.main(common + ["--part", "mixer", "--hidden", "64", "--bits", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.split()[:2] == ["40", "chunk16"] for line in lines) == 2
    assert "GLM53_KDA_PREFILL_KERNEL_CHUNK" not in os.environ

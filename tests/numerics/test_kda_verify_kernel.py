"""kda_verify_kernel on the CPU: the wrapper steps aside, the kernel's text runs on the host, and the wrapper
hands the kernel exactly stock's recurrence.

The patch is one CUDA kernel behind glm5_next's ``gated_delta_update``
(``glm53-patches verify kda_verify_kernel`` runs it against stock on a GPU).
There is no GPU here, so:

* what the CPU user gets: stock, bit for bit, in decode and verify blocks,
  alone and under compiled_kda_decode and layer_decode, each call counted;
  revert; ``verify`` says it steps aside; the coverage rules;
* the kernel's CUDA text compiled with g++ and run with every warp as host
  threads (``checks/host_check.py``): against stock's ``gated_delta_ops``
  on the CPU (y bit for bit here, the states to the CPU's other summation
  order), a masked token keeping its state bit for bit, every output
  written, and a block of L tokens being bit for bit L one-token runs;
* with CUDA pretended and the kernel replaced by stock's ``gated_delta_ops``
  on what it is handed: decode and verify blocks stay bit for bit through
  the eager mixer, compiled_kda_decode and layer_decode, so the wrapper
  hands over stock's gate, beta, state, mask and history length. A stand-in
  that hands the history back in reverse makes that comparison fail.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.gated_delta import compute_g_safe, gated_delta_ops
from mlx_vlm.models.glm5_next import language

import glm53_patches
from glm53_patches.patches import kda_verify_kernel
from glm53_patches.patches.kda_verify_kernel import kernel, mixer, recurrence
from glm53_patches.patches.kda_verify_kernel.checks import host_check
from glm53_patches.tiny_model import build_model, greedy_logits, speculative_logits, speculative_outputs
from test_exact_qmv import assert_bitwise  # the same bit-for-bit list comparison

NAME = "kda_verify_kernel"
PROMPT = mx.array([[(5 * i + 2) % 500 for i in range(24)]])


def counts():
    snapshot = kda_verify_kernel.PATCH.stats.snapshot()
    return snapshot["hits"], snapshot["fallbacks"]


def outputs(model):
    """Greedy decode at batch 1 and 2, verify blocks at batch 1, and verify blocks at batch 2 with the second row
    left-padded by 3 (masked tokens): every logit and the caches after the blocks."""
    from mlx.utils import tree_flatten
    from mlx_vlm.generate.ar import _make_cache

    batch = mx.concatenate([PROMPT, PROMPT[:, ::-1]])
    padded = mx.concatenate([PROMPT, mx.concatenate([mx.zeros((1, 3), PROMPT.dtype), PROMPT[:, 3:]], axis=1)])
    logits, cache = speculative_logits(model, padded, 4, cache=_make_cache(model, [0, 3]))
    return (greedy_logits(model, PROMPT, 4) + greedy_logits(model, batch, 3) + speculative_outputs(model, PROMPT)
            + logits + [a for _, a in tree_flatten([c.state for c in cache]) if a is not None])


@pytest.fixture(scope="module")
def model():
    from glm53_patches.exactness import _served_dtype

    return _served_dtype(build_model(seed=3, quantize_bits=4), mx.bfloat16).language_model


@pytest.fixture(scope="module")
def stock_outputs(model):
    glm53_patches.disable()
    return outputs(model)


@pytest.fixture
def applied():
    glm53_patches.disable()
    kda_verify_kernel.PATCH.stats.reset()
    glm53_patches.enable([NAME], strict=True)
    yield
    glm53_patches.disable()


def test_on_the_cpu_stock_runs_bit_for_bit(model, stock_outputs, applied):
    assert_bitwise(stock_outputs, outputs(model), "decode and verify blocks, kda_verify_kernel applied on the CPU")
    hits, fallbacks = counts()
    assert not hits
    assert set(fallbacks) == {"no CUDA"} and fallbacks["no CUDA"] >= 20  # KDA layers x steps and blocks


def test_revert_restores_the_original_functions():
    glm53_patches.disable()
    owners = ((language, "gated_delta_update"), (language.Glm5NextLinearAttention, "__call__"))
    originals = [vars(owner)[name] for owner, name in owners]
    glm53_patches.enable([NAME])
    try:
        assert all(vars(owner)[name] is not original for (owner, name), original in zip(owners, originals))
    finally:
        glm53_patches.disable()
    assert all(vars(owner)[name] is original for (owner, name), original in zip(owners, originals))


def test_coverage():
    q = mx.zeros((2, 4, 3, 64), mx.bfloat16)
    b = mx.zeros((2, 4, 3), mx.bfloat16)
    a_log, dt_bias, state = mx.zeros((3, 1)), mx.zeros((3, 64)), mx.zeros((2, 3, 64, 64))
    ok = (q, q, q, q, b, a_log, dt_bias, state)
    assert kernel.unsupported(*ok, None) is None
    assert kernel.unsupported(*ok, mx.ones((2, 4), mx.bool_)) is None
    assert kernel.unsupported(*ok, mx.ones((2, 4), mx.int32)) == "mask"
    assert kernel.unsupported(*ok, mx.ones((2, 1, 4), mx.bool_)) == "mask"
    f32 = q.astype(mx.float32)
    assert kernel.unsupported(f32, f32, f32, f32, b.astype(mx.float32), a_log, dt_bias, state, None) == "dtype"
    assert kernel.unsupported(*ok[:5], a_log.astype(mx.bfloat16), dt_bias, state, None) == "dtype"
    assert kernel.unsupported(*ok[:7], state.astype(mx.bfloat16), None) == "dtype"
    wide = mx.zeros((2, 4, 3, 256), mx.bfloat16)
    assert kernel.unsupported(wide, wide, wide, wide, b, a_log, mx.zeros((3, 256)), mx.zeros((2, 3, 256, 256)),
                              None) == "head dim"
    scalar_gate = mx.zeros((2, 4, 3), mx.bfloat16)  # gated_delta's scalar gating: not KDA's
    assert kernel.unsupported(q, q, q, scalar_gate, b, a_log, dt_bias, state, None) == "shape"
    grouped = mx.zeros((2, 4, 1, 64), mx.bfloat16)  # fewer key heads than value heads: stock repeats them
    assert kernel.unsupported(grouped, grouped, q, q, b, a_log, dt_bias, state, None) == "shape"


def test_prefill_is_not_this_patchs_call(applied):
    """A prompt's recurrence (more than 8 tokens, or no state yet) goes to stock uncounted."""
    q, k, v, g, beta, state = host_check.inputs(1, 12, 2, 32, 0)
    update = vars(language)["gated_delta_update"]
    a, b = mx.zeros((1, 12, 2, 32), mx.bfloat16), mx.zeros((1, 12, 2), mx.bfloat16)
    update(q, k, v, a, b, mx.zeros((2, 1)), mx.zeros((2, 32)), state=state, lower_bound=-5.0)
    update(q[:, :4], k[:, :4], v[:, :4], a[:, :4], b[:, :4], mx.zeros((2, 1)), mx.zeros((2, 32)), lower_bound=-5.0)
    assert counts() == ({}, {})


# -- the kernel's text on the host ---------------------------------------------------------------


@pytest.mark.parametrize("batch,length,heads,dim,steps,masked", [
    (1, 4, 2, 32, 3, False),  # a verify block of 4: 3 states recorded
    (2, 8, 1, 64, 8, True),  # every state recorded, a masked token in a row
    (3, 2, 2, 32, None, True),  # no history, a row masked throughout
    (1, 1, 3, 16, None, False),  # one token, a head narrower than the lanes
])
def test_host_run_agrees_with_stock(tmp_path, batch, length, heads, dim, steps, masked):
    q, k, v, g, beta, state = host_check.inputs(batch, length, heads, dim, seed=length + dim)
    mask = None
    if masked:
        rows = [[True] * length, [t % 3 != 1 for t in range(length)], [False] * length][:batch]
        mask = mx.array(rows)
    got = host_check.run(tmp_path, q, k, v, g, beta, state, mask, steps)
    want = [np.array(a.astype(mx.float32)) for a in gated_delta_ops(q, k, v, g, beta, state, mask, steps)]
    assert len(got) == len(want)
    for name, a, b in zip(("y", "state", "states"), got, want):
        assert a.shape == b.shape, name
        assert not np.any(a == -7.0), f"{name}: a value the kernel never wrote"
        assert np.abs(a - b).max() <= 1e-5 * max(np.abs(b).max(), 1.0), name  # the CPU's own summation order
    if masked and batch == 3:  # row 2 masked at every token: its state is the one it came with, bit for bit
        assert np.array_equal(got[1][2].view(np.uint32), np.array(state[2]).view(np.uint32))


def test_a_block_is_the_one_token_kernel_run_token_by_token(tmp_path):
    """As stock's gated_delta_ops is _gated_delta_step_ops token by token, so is the kernel: bit for bit."""
    length = 5
    q, k, v, g, beta, state = host_check.inputs(2, length, 2, 32, seed=7)
    mask = mx.array([[True] * length, [True, False, True, True, False]])
    y, final, states = host_check.run(tmp_path, q, k, v, g, beta, state, mask, length)
    current = state
    for t in range(length):
        one = slice(t, t + 1)
        y_t, current = host_check.run(tmp_path, q[:, one], k[:, one], v[:, one], g[:, one], beta[:, one], current,
                                      mask[:, one])
        assert np.array_equal(y[:, t], y_t[:, 0]), f"y at token {t}"
        assert np.array_equal(states[:, t].view(np.uint32), current.view(np.uint32)), f"state after token {t}"
        current = mx.array(current)
    assert np.array_equal(final.view(np.uint32), states[:, -1].view(np.uint32))


def test_fma_state_is_the_kernels_setting(tmp_path):
    """FMA_STATE reaches the arithmetic: its two values round the update differently somewhere."""
    q, k, v, g, beta, state = host_check.inputs(1, 4, 2, 64, seed=11)
    fused = host_check.run(tmp_path, q, k, v, g, beta, state, None, 3, fma_state=1)
    apart = host_check.run(tmp_path, q, k, v, g, beta, state, None, 3, fma_state=0)
    assert not np.array_equal(fused[2].view(np.uint32), apart[2].view(np.uint32))


@pytest.mark.parametrize("batch,length,heads,dim,masked,fma", [
    (1, 4, 2, 32, False, (1, 1)),  # a verify block of 4
    (2, 3, 1, 64, True, (0, 1)),  # a masked token in the second row; sums of squares without fma
    (1, 8, 2, 16, False, (1, 0)),  # the longest block, more tokens than warps
    (2, 2, 1, 128, True, (1, 1)),  # GLM-5.3-Flash's head dim; the second row masked throughout
])
def test_the_mixer_kernel_is_fused_kda_kernels_step_token_by_token(tmp_path, batch, length, heads, dim, masked, fma):
    """A block through the mixer kernel is, bit for bit, fused_kda_kernel's one-token kernel (verified against
    stock's step) run token by token, the conv window and the state carried over: every output, every recorded
    state, the final state, and the window the block leaves (the last taps - 1 rows of its conv input)."""
    inputs = host_check.mixer_inputs(batch, length, heads, dim, seed=length + dim)
    conv_input, conv_w, a, beta_logit, gate, state, *rest = inputs
    mask = None
    if masked:
        mask = mx.array([[True] * length, [t == 1 for t in range(length)] if length > 2 else [False] * length])
    out, final, states = host_check.run_mixer(tmp_path, *inputs, mask=mask, state_steps=length, fma=fma)
    assert not np.any(out == 0xC0E0) and not np.any(final == -7.0), "a value the kernel never wrote"  # bf16(-7)
    taps = conv_w.shape[1]
    window, current = conv_input[:, : taps - 1], state
    for t in range(length):
        out_t, current, window_bits = host_check.run_fused_token(
            tmp_path, conv_input[:, taps - 1 + t], window, conv_w, a[:, t], beta_logit[:, t], gate[:, t], current,
            *rest, mask=None if mask is None else mask[:, t], fma=fma)
        assert np.array_equal(out[:, t], out_t), f"output at token {t}"
        assert np.array_equal(states[:, t].view(np.uint32), current.view(np.uint32)), f"state after token {t}"
        current, window = mx.array(current), mx.array(window_bits).view(mx.bfloat16)
    assert np.array_equal(final.view(np.uint32), states[:, -1].view(np.uint32))
    assert np.array_equal(np.array(window.view(mx.uint16)), np.array(conv_input[:, length:].view(mx.uint16)))
    if masked:  # the second row's masked tokens left its state as it came
        kept = [t for t in range(length) if not mask[1, t].item()]
        before = np.array(state[1]) if kept[0] == 0 else states[1, kept[0] - 1]
        assert np.array_equal(states[1, kept[0]].view(np.uint32), before.view(np.uint32))


def test_the_mixer_kernels_fma_state_reaches_its_arithmetic(tmp_path):
    """FMA_STATE changes the mixer kernel's rounding somewhere: the setting is wired. (FMA_NORM cannot show: the
    norms square bf16 values, whose squares float32 holds exactly, so an fma rounds them as a multiply-add does.)"""
    inputs = host_check.mixer_inputs(1, 4, 2, 64, seed=5)
    fused, apart = (host_check.run_mixer(tmp_path, *inputs, state_steps=3, fma=(1, fma_state)) for fma_state in (1, 0))
    assert not np.array_equal(fused[2].view(np.uint32), apart[2].view(np.uint32))


# -- the wrapper, CUDA pretended -----------------------------------------------------------------


def pretending(monkeypatch, model, names, wrapper, kernel_name, answer):
    """``outputs(model)`` with ``names`` applied, CUDA pretended to ``wrapper`` (the recurrence or the mixer
    module) and ``kernel.<kernel_name>`` answered by ``answer``."""
    monkeypatch.setattr(wrapper, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kernel, kernel_name, answer)
    for name in names:
        glm53_patches.registry.available()[name].stats.reset()
    glm53_patches.enable(names, strict=True)
    try:
        with recurrence.switch.forcing(True):
            return outputs(model)
    finally:
        glm53_patches.disable()


def run_pretending(monkeypatch, model, names, stand_in=None):
    """``outputs(model)`` with ``names`` applied, CUDA pretended and the recurrence kernel answered by ``stand_in``
    (default: stock's gated_delta_ops on what the kernel is handed); also the calls it got."""
    seen = []

    def stock_ops(q, k, v, g, beta, state, mask=None, state_steps=None):
        seen.append((q.shape[1], state_steps, mask is not None))
        return gated_delta_ops(q, k, v, g, beta, state, mask, state_steps)

    return pretending(monkeypatch, model, names, recurrence, "delta_block", stand_in or stock_ops), seen


@pytest.mark.parametrize("names", [[NAME], ["compiled_kda_decode", NAME], ["compiled_kda_decode", NAME,
                                                                           "layer_decode"]])
def test_where_the_kernel_runs_it_gets_stocks_arguments(monkeypatch, model, stock_outputs, names):
    from glm53_patches import registry

    actual, seen = run_pretending(monkeypatch, model, names)
    assert_bitwise(stock_outputs, actual, f"decode and verify blocks, {'+'.join(names)}, the kernel answered by stock")
    assert {length for length, *_ in seen} == set(range(1, 9))  # decode, and verify blocks of 2 to 8
    assert any(steps for _, steps, _ in seen) and any(masked for *_, masked in seen)  # history; a padded batch
    if "compiled_kda_decode" not in names:  # traced calls run once per trace, eager ones once per call
        assert counts()[0]["kernel"] == len(seen)
    if "layer_decode" in names:
        assert registry.available()["layer_decode"].stats.snapshot()["hits"]


def test_a_stand_in_that_records_the_history_in_reverse_is_caught(monkeypatch, model, stock_outputs):
    """The comparison above can fail: rolled back to an accepted prefix, a block must find its states in order."""
    def reversed_history(q, k, v, g, beta, state, mask=None, state_steps=None):
        out = gated_delta_ops(q, k, v, g, beta, state, mask, state_steps)
        return out if state_steps is None else (*out[:2], out[2][:, ::-1])

    actual, _ = run_pretending(monkeypatch, model, [NAME], stand_in=reversed_history)
    assert not all(np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
                   for a, b in zip(stock_outputs, actual))


def test_verify_on_the_cpu_says_it_steps_aside():
    from glm53_patches.patches.kda_verify_kernel.checks.verify import verify

    result = verify()
    assert result["exact"] and result["cases"] >= 4
    assert "steps aside" in result["detail"]


def stock_mixer(conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales, mask=None,
                state_steps=None):
    """``kernel.mixer_block`` in stock's ops (glm5_next's ShortConv1d and mixer after the projections)."""
    batch, heads, dim = state.shape[0], state.shape[1], state.shape[-1]
    length = conv_input.shape[1] - conv_w.shape[1] + 1
    shape = (batch, length, heads, dim)
    qkv = mx.conv1d(conv_input, conv_w[..., None], groups=conv_w.shape[0])
    q, k, v = (value.reshape(shape) for value in mx.split(qkv * mx.sigmoid(qkv), 3, axis=-1))
    eps = consts[0].item()
    q, k = scales[0] * mx.fast.rms_norm(q, None, eps), scales[1] * mx.fast.rms_norm(k, None, eps)
    g = compute_g_safe(A_log.reshape(heads, 1), a.reshape(shape), dt_bias.reshape(heads, dim), consts[2].item())
    y, new_state, *states = gated_delta_ops(q, k, v, g, mx.sigmoid(beta_logit), state, mask, state_steps)
    out = mx.fast.rms_norm(y, o_weight, consts[1].item()) * mx.sigmoid(gate.reshape(shape))
    return (out.reshape(batch, length, -1), new_state, *states)


def run_mixer_pretending(monkeypatch, model, names, stand_in=stock_mixer):
    """``outputs(model)`` with ``names`` applied, CUDA pretended, the mixer kernel answered by ``stand_in``; the
    block lengths, history lengths and masks it got."""
    seen = []

    def recorded(*args):  # mixer.py passes every argument by position, mask and state_steps last
        seen.append((args[2].shape[1], args[12], args[11] is not None))
        return stand_in(*args)

    return pretending(monkeypatch, model, names, mixer, "mixer_block", recorded), seen


@pytest.mark.parametrize("names", [[NAME], ["compiled_kda_decode", NAME, "layer_decode"]])
def test_the_mixer_wrapper_hands_the_kernel_stocks_block(monkeypatch, model, stock_outputs, names):
    """Blocks through the mixer wrapper, its kernel answered by stock's ops on what it is handed, stay bit for bit
    (logits and the caches after rollback): the front, the conv input the cache records, the state, the mask and
    the history length are stock's."""
    actual, seen = run_mixer_pretending(monkeypatch, model, names)
    assert_bitwise(stock_outputs, actual, f"verify blocks through the mixer, {'+'.join(names)}, answered by stock")
    assert {length for length, *_ in seen} == set(range(2, 9))  # every verify block, and no decode token
    assert any(steps for _, steps, _ in seen) and any(masked for *_, masked in seen)
    hits, fallbacks = counts()
    assert hits.get("block kernel") and not [f for f in fallbacks if f.startswith("verify block")]


def test_a_mixer_stand_in_that_drops_the_gate_is_caught(monkeypatch, model, stock_outputs):
    """The comparison above can fail: a kernel that skipped sigmoid(gate) changes the logits."""
    def ungated(*args, **kwargs):
        args = list(args)
        args[4] = mx.full(args[4].shape, 30.0, args[4].dtype)  # sigmoid(30) rounds to 1 in bf16
        return stock_mixer(*args, **kwargs)

    actual, _ = run_mixer_pretending(monkeypatch, model, [NAME], stand_in=ungated)
    assert not all(np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
                   for a, b in zip(stock_outputs, actual))


def test_blocks_the_mixer_kernel_does_not_cover_go_on_counted(monkeypatch):
    """A float32 model's blocks are not the mixer kernel's (it reads bf16): each is counted by reason and runs the
    installed code below, bit for bit stock's, and the kernel is never called."""
    model = build_model(seed=3).language_model
    glm53_patches.disable()
    expected = outputs(model)

    def never(*args):
        raise AssertionError("the mixer kernel was called for a float32 block")

    actual = pretending(monkeypatch, model, [NAME], mixer, "mixer_block", never)
    assert_bitwise(expected, actual, "float32 verify blocks past the mixer wrapper")
    hits, fallbacks = counts()
    assert "block kernel" not in hits and fallbacks.get("verify block: dtype", 0) >= 10

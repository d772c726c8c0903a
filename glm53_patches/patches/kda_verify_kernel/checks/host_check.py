"""Run the CUDA kernel's text on the host with g++ (``host_emulation.py``: every warp as 32 host threads).

There is no CUDA here, so ``verify`` on a GPU is what checks bits against
stock. This checks everything else on the CPU: the layout of every input and
output, the warps' share of the state rows, the mask (a masked token's state
comes back bit for bit as it was before the token), the recorded states, and
that a block of L tokens is, bit for bit, the same kernel run one token at a
time L times, which is how stock's ``gated_delta_ops`` is built too. Against
stock's CPU ops the values agree to the reduction order (the CPU adds its
row sums in another one).

The mixer kernel (``run_mixer``) is checked against fused_kda_kernel's
one-token kernel (``run_fused_token``, its text the same way), run token by
token with the window and state carried over: bit for bit, as stock's block
is its one-token step repeated. Needs g++ on PATH.
"""

import numpy as np

import mlx.core as mx

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run
from glm53_patches.patches.fused_kda_kernel import kernel as fused_kernel
from glm53_patches.patches.fused_kda_kernel.checks import host_check as fused_check
from glm53_patches.patches.fused_kda_kernel.checks.host_check import HOST_FUNCTIONS, _to_file

from .. import kernel

PROGRAM = r"""
%(helpers)s
template <int H, int D, int TOKENS, int STEPS, int FMA_STATE, bool HAS_MASK>
void body(const bf16* q, const bf16* k, const bf16* v, const float* g, const bf16* beta, const float* state,
          const bool* mask, bf16* y_out, float* state_out, float* states) {
%(source)s
}

int main(int argc, char** argv) {
  constexpr int B = %(B)d, H = %(H)d, D = %(D)d, T = %(T)d, STEPS = %(STEPS)d;  // T: the tokens
  auto q = load<bf16>(argv[1], B * T * H * D);
  auto k = load<bf16>(argv[2], B * T * H * D);
  auto v = load<bf16>(argv[3], B * T * H * D);
  auto g = load<float>(argv[4], B * T * H * D);
  auto beta = load<bf16>(argv[5], B * T * H);
  auto state = load<float>(argv[6], B * H * D * D);
  auto mask_bytes = load<uint8_t>(argv[7], B * T);
  std::vector<char> mask(mask_bytes.begin(), mask_bytes.end());
  std::vector<bf16> y(B * T * H * D, bf16(-7.0f));  // poison: every value must be written
  std::vector<float> state_out(B * H * D * D, -7.0f);
  std::vector<float> states(STEPS ? B * STEPS * H * D * D : 1, -7.0f);
  run_blocks(B * H, (D / 4) * 32, [&] {
    body<H, D, T, STEPS, %(FMA_STATE)d, %(HAS_MASK)s>(q.data(), k.data(), v.data(), g.data(), beta.data(),
        state.data(), reinterpret_cast<const bool*>(mask.data()), y.data(), state_out.data(), states.data());
  });
  FILE* f = std::fopen(argv[8], "wb");
  std::fwrite(y.data(), 2, y.size(), f);
  std::fwrite(state_out.data(), 4, state_out.size(), f);
  std::fwrite(states.data(), 4, states.size(), f);
  std::fclose(f);
  return 0;
}
"""


def run(tmp, q, k, v, g, beta, state, mask=None, state_steps=None, fma_state=kernel.FMA_STATE):
    """``kernel.delta_block``'s outputs as numpy arrays (y as float32), the CUDA text run on the host."""
    batch, length, heads, dim = q.shape
    steps = state_steps or 0
    inputs = [q, k, v, g, beta, state, mx.ones((batch, length), mx.bool_) if mask is None else mask]
    paths = [tmp / f"in{i}" for i in range(len(inputs))] + [tmp / "out"]
    for array, path in zip(inputs, paths):
        _to_file(array, path)
    source = PRELUDE + HOST_FUNCTIONS + PROGRAM % {
        "helpers": kernel.CUDA_HELPERS, "source": kernel.SOURCE, "B": batch, "H": heads, "D": dim, "T": length,
        "STEPS": steps, "FMA_STATE": int(fma_state), "HAS_MASK": "true" if mask is not None else "false",
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint8)
    n_y, n_state = q.size, state.size
    y = np.array(mx.array(raw[: 2 * n_y].view(np.uint16)).view(mx.bfloat16).astype(mx.float32)).reshape(q.shape)
    new_state = raw[2 * n_y: 2 * n_y + 4 * n_state].view(np.float32).reshape(state.shape)
    states = raw[2 * n_y + 4 * n_state:].view(np.float32)
    return (y, new_state, states.reshape(batch, steps, heads, dim, dim)) if steps else (y, new_state)


def inputs(batch, length, heads, dim, seed):
    """bf16 q, k, v, beta and float32 g, state, as glm5_next's mixer hands them over (normalized q, k; g in (0, 1])."""
    keys = mx.random.split(mx.random.key(seed), 6)
    shape = (batch, length, heads, dim)
    unit = lambda key: mx.random.normal(shape, key=key) / dim ** 0.5  # noqa: E731  (rms-normed scale)
    q, k = unit(keys[0]).astype(mx.bfloat16), unit(keys[1]).astype(mx.bfloat16)
    v = mx.random.normal(shape, key=keys[2]).astype(mx.bfloat16)
    g = mx.exp(-mx.abs(mx.random.normal(shape, key=keys[3])) * 0.1)
    beta = mx.sigmoid(mx.random.normal((batch, length, heads), key=keys[4])).astype(mx.bfloat16)
    state = mx.random.normal((batch, heads, dim, dim), key=keys[5]) * 0.1
    return q, k, v, g, beta, state


MIXER_PROGRAM = r"""
%(helpers)s
template <int H, int D, int TOKENS, int STEPS, int KC, int FMA_NORM, int FMA_STATE, bool HAS_MASK>
void body(const bf16* conv_input, const bf16* conv_w, const bf16* a, const bf16* beta_logit, const bf16* gate,
          const float* state, const float* A_log, const float* dt_bias, const bf16* o_weight, const bf16* scales,
          const float* consts, const bool* mask, bf16* out, float* state_out, float* states) {
%(source)s
}

int main(int argc, char** argv) {
  constexpr int B = %(B)d, H = %(H)d, D = %(D)d, T = %(T)d, STEPS = %(STEPS)d, KC = %(KC)d, C = 3 * H * D;
  auto conv_input = load<bf16>(argv[1], B * (KC - 1 + T) * C);
  auto conv_w = load<bf16>(argv[2], C * KC);
  auto a = load<bf16>(argv[3], B * T * H * D);
  auto beta_logit = load<bf16>(argv[4], B * T * H);
  auto gate = load<bf16>(argv[5], B * T * H * D);
  auto state = load<float>(argv[6], B * H * D * D);
  auto A_log = load<float>(argv[7], H);
  auto dt_bias = load<float>(argv[8], H * D);
  auto o_weight = load<bf16>(argv[9], D);
  auto scales = load<bf16>(argv[10], 2);
  auto consts = load<float>(argv[11], 3);
  auto mask_bytes = load<uint8_t>(argv[12], B * T);
  std::vector<char> mask(mask_bytes.begin(), mask_bytes.end());
  std::vector<bf16> out(B * T * H * D, bf16(-7.0f));  // poison: every value must be written
  std::vector<float> state_out(B * H * D * D, -7.0f);
  std::vector<float> states(STEPS ? B * STEPS * H * D * D : 1, -7.0f);
  run_blocks(B * H, (D / 4) * 32, [&] {
    body<H, D, T, STEPS, KC, %(FMA_NORM)d, %(FMA_STATE)d, %(HAS_MASK)s>(
        conv_input.data(), conv_w.data(), a.data(), beta_logit.data(), gate.data(), state.data(), A_log.data(),
        dt_bias.data(), o_weight.data(), scales.data(), consts.data(), reinterpret_cast<const bool*>(mask.data()),
        out.data(), state_out.data(), states.data());
  });
  FILE* f = std::fopen(argv[13], "wb");
  std::fwrite(out.data(), 2, out.size(), f);
  std::fwrite(state_out.data(), 4, state_out.size(), f);
  std::fwrite(states.data(), 4, states.size(), f);
  std::fclose(f);
  return 0;
}
"""


def _bf16_bits(raw, shape):
    return raw.view(np.uint16).reshape(shape)


def mixer_inputs(batch, length, heads, dim, seed, taps=4):
    """``kernel.mixer_block``'s inputs with random values of glm5_next's scale (bf16 activations, float32 state
    and gate parameters; fused_kda_kernel's constants for head dim ``dim``)."""
    keys = mx.random.split(mx.random.key(seed), 9)
    channels = 3 * heads * dim
    normal = lambda shape, i, scale=1.0: mx.random.normal(shape, key=keys[i]) * scale  # noqa: E731
    conv_input = normal((batch, taps - 1 + length, channels), 0).astype(mx.bfloat16)
    conv_w = normal((channels, taps), 1, 0.5).astype(mx.bfloat16)
    a = normal((batch, length, heads * dim), 2).astype(mx.bfloat16)
    beta_logit = normal((batch, length, heads), 3).astype(mx.bfloat16)
    gate = normal((batch, length, heads * dim), 4).astype(mx.bfloat16)
    state = normal((batch, heads, dim, dim), 5, 0.1)
    A_log, dt_bias = normal((heads,), 6, 0.5), normal((heads * dim,), 7, 0.5)
    o_weight = (1 + normal((dim,), 8, 0.1)).astype(mx.bfloat16)
    consts, scales = fused_kernel.constants(1e-6 / dim, 1e-5, -5.0, dim ** -0.5)
    return [conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales]


def run_mixer(tmp, conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales,
              mask=None, state_steps=None, fma=fused_kernel.DEFAULT_FMA["cuda"]):
    """``kernel.mixer_block``'s outputs, the CUDA text run on the host: out (bf16 bits), state[, states]."""
    batch, heads, dim = state.shape[0], state.shape[1], state.shape[-1]
    taps = conv_w.shape[1]
    length = conv_input.shape[1] - taps + 1
    steps = state_steps or 0
    inputs = [conv_input, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, scales, consts,
              mx.ones((batch, length), mx.bool_) if mask is None else mask]
    paths = [tmp / f"in{i}" for i in range(len(inputs))] + [tmp / "out"]
    for array, path in zip(inputs, paths):
        _to_file(array, path)
    source = PRELUDE + HOST_FUNCTIONS + MIXER_PROGRAM % {
        "helpers": kernel.CUDA_HELPERS, "source": kernel.MIXER_SOURCE, "B": batch, "H": heads, "D": dim,
        "T": length, "STEPS": steps, "KC": taps, "FMA_NORM": int(fma[0]), "FMA_STATE": int(fma[1]),
        "HAS_MASK": "true" if mask is not None else "false",
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint8)
    n_out, n_state = batch * length * heads * dim, state.size
    out = _bf16_bits(raw[: 2 * n_out], (batch, length, heads * dim))
    new_state = raw[2 * n_out: 2 * n_out + 4 * n_state].view(np.float32).reshape(state.shape)
    states = raw[2 * n_out + 4 * n_state:].view(np.float32)
    return (out, new_state, states.reshape(batch, steps, heads, dim, dim)) if steps else (out, new_state)


def run_fused_token(tmp, qkv, window, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, consts, scales,
                    mask=None, fma=fused_kernel.DEFAULT_FMA["cuda"]):
    """fused_kda_kernel's one-token CUDA text on the host: out (bf16 bits), new state, new window (bf16 bits)."""
    batch, heads, dim = state.shape[0], state.shape[1], state.shape[-1]
    taps = conv_w.shape[1]
    inputs = [qkv, window, conv_w, a, beta_logit, gate, state, A_log, dt_bias, o_weight, scales, consts,
              mx.ones((batch,), mx.bool_) if mask is None else mask]
    paths = [tmp / f"in{i}" for i in range(len(inputs))] + [tmp / "out"]
    for array, path in zip(inputs, paths):
        _to_file(array, path)
    source = PRELUDE + HOST_FUNCTIONS + fused_check.PROGRAM % {
        "helpers": fused_kernel.CUDA_HELPERS, "source": fused_kernel.CUDA_SOURCE, "B": batch, "H": heads,
        "D": dim, "KC": taps, "FMA_NORM": int(fma[0]), "FMA_STATE": int(fma[1]),
        "HAS_MASK": "true" if mask is not None else "false",
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint8)
    n_out, n_state = batch * heads * dim, state.size
    out = _bf16_bits(raw[: 2 * n_out], (batch, heads * dim))
    new_state = raw[2 * n_out: 2 * n_out + 4 * n_state].view(np.float32).reshape(state.shape)
    new_window = _bf16_bits(raw[2 * n_out + 4 * n_state:], window.shape)
    return out, new_state, new_window

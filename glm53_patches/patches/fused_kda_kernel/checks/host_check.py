"""Run the CUDA kernel's body on the host: ``python -m glm53_patches.patches.fused_kda_kernel.checks.host_check``.

The CUDA source (``kernel.CUDA_SOURCE``: the KD_* macros and the body) is
compiled unchanged into a C++ program with g++; MLX's functors and the CUDA
intrinsics it calls are replaced by host functions of the same arithmetic
(``host_emulation.py`` runs every block's warps as host threads). Its inputs
come from a real KDA layer on the CPU: stock's own projections and conv for
one decode step (the patch's compiled front). Its outputs, through stock's
``o_proj``, are compared with stock's decode step of the same layer and cache,
and the new conv window bit for bit.

The CPU's reductions add in another order than CUDA's, so values agree to
bf16 rounding, not bit for bit (``verify`` checks bits on the GPU). What
this catches is everything else: layout, indexing, the warps' share of the
rows, the mask (a masked row's state must come back bit for bit unchanged),
and each FMA variant compiling and agreeing. Needs g++ on PATH.
"""

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import kernel

HOST_FUNCTIONS = r"""
#define __device__
#define __forceinline__ inline
#include <algorithm>
float __fmul_rn(float a, float b) { return a * b; }
float __fadd_rn(float a, float b) { return a + b; }
float __fsub_rn(float a, float b) { return a - b; }
float __fdiv_rn(float a, float b) { return a / b; }
float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
bf16 __float2bfloat16(float x) { return bf16(x); }
// MLX's functors with CUDA's arithmetic: bf16 ops computed in float, rounded once.
struct Sigmoid {
  float operator()(float x) { float y = 1.0f / (1.0f + ::expf(std::fabs(x))); return x < 0 ? y : 1.0f - y; }
  bf16 operator()(bf16 x) {
    bf16 y = bf16(1.0f / float(bf16(1.0f + float(bf16(::expf(std::fabs(float(x))))))));
    return float(x) < 0 ? y : bf16(1.0f - float(y));
  }
};
struct Multiply {
  float operator()(float a, float b) { return a * b; }
  bf16 operator()(bf16 a, bf16 b) { return bf16(float(a) * float(b)); }
};
struct Exp {
  float operator()(float x) { return ::expf(x); }
};
"""

PROGRAM = r"""
%(helpers)s
template <int H, int D, int KC, int FMA_NORM, int FMA_STATE, bool HAS_MASK>
void body(const bf16* qkv, const bf16* window, const bf16* conv_w, const bf16* a, const bf16* beta_logit,
          const bf16* gate, const float* state, const float* A_log, const float* dt_bias, const bf16* o_weight,
          const bf16* scales, const float* consts, const bool* mask, bf16* out, float* state_out, bf16* window_out) {
%(source)s
}

int main(int argc, char** argv) {
  constexpr int B = %(B)d, H = %(H)d, D = %(D)d, KC = %(KC)d, C = 3 * H * D;
  auto qkv = load<bf16>(argv[1], B * C);
  auto window = load<bf16>(argv[2], B * (KC - 1) * C);
  auto conv_w = load<bf16>(argv[3], C * KC);
  auto a = load<bf16>(argv[4], B * H * D);
  auto beta_logit = load<bf16>(argv[5], B * H);
  auto gate = load<bf16>(argv[6], B * H * D);
  auto state = load<float>(argv[7], B * H * D * D);
  auto A_log = load<float>(argv[8], H);
  auto dt_bias = load<float>(argv[9], H * D);
  auto o_weight = load<bf16>(argv[10], D);
  auto scales = load<bf16>(argv[11], 2);
  auto consts = load<float>(argv[12], 3);
  auto mask_bytes = load<uint8_t>(argv[13], B);
  std::vector<char> mask(mask_bytes.begin(), mask_bytes.end());
  std::vector<bf16> out(B * H * D, bf16(-7.0f));  // poison: every value must be written
  std::vector<float> state_out(B * H * D * D, -7.0f);
  std::vector<bf16> window_out(B * (KC - 1) * C, bf16(-7.0f));
  run_blocks(B * H, (D / 4) * 32, [&] {
    body<H, D, KC, %(FMA_NORM)d, %(FMA_STATE)d, %(HAS_MASK)s>(
        qkv.data(), window.data(), conv_w.data(), a.data(), beta_logit.data(), gate.data(), state.data(),
        A_log.data(), dt_bias.data(), o_weight.data(), scales.data(), consts.data(),
        reinterpret_cast<const bool*>(mask.data()), out.data(), state_out.data(), window_out.data());
  });
  FILE* f = std::fopen(argv[14], "wb");
  std::fwrite(out.data(), 2, out.size(), f);
  std::fwrite(state_out.data(), 4, state_out.size(), f);
  std::fwrite(window_out.data(), 2, window_out.size(), f);
  std::fclose(f);
  return 0;
}
"""


def _layer_step(dims, padding, seed):
    """A bf16 KDA layer and cache after a 5-token prefill, one decode token; the kernel's inputs and stock's result."""
    from mlx_vlm.models.cache import ArraysCache

    from glm53_patches.patches.compiled_kda_decode.checks.verify import _layer

    from .. import step

    layer = _layer(mx.bfloat16, None, seed=seed, dims=dims)
    batch = 1 if padding is None else len(padding)
    hidden = dims[0]
    mx.random.seed(seed)
    prompt = mx.random.normal((batch, 5, hidden)).astype(mx.bfloat16)
    x = mx.random.normal((batch, 1, hidden)).astype(mx.bfloat16)
    cache = ArraysCache(2, left_padding=padding)
    layer(prompt, cache.make_mask(5), cache)
    mask = cache.make_mask(1)
    mask = None if mask is None else mask.reshape(-1)
    leaves = step._compiled.layer_leaves(layer)
    front = step._build_front(layer, leaves, mask is not None)
    params = [dict(leaves[i]) for i in step._PROJECTIONS]
    qkv, a, b, gate = front(x, params) if mask is None else front(x, params, mask.reshape(-1, 1))
    conv_w = layer.qkv_conv.conv.weight
    consts, scales = kernel.constants(1e-6 / layer.head_dim, layer.o_norm.eps, layer.lower_bound, layer.scale)
    kernel_inputs = [qkv, cache[0], conv_w.reshape(conv_w.shape[0], -1), a, b, gate, cache[1], layer.A_log,
                     layer.dt_bias, layer.o_norm.weight, scales, consts,
                     mx.ones((batch,), mx.bool_) if mask is None else mask]
    state_before = np.array(cache[1])
    expected = layer(x, None if mask is None else mask.reshape(-1, 1), cache)  # stock: the cache moves on
    return layer, kernel_inputs, mask is not None, state_before, expected, cache


def _to_file(array, path):
    array = mx.contiguous(array)
    if array.dtype == mx.bfloat16:
        np.array(array.view(mx.uint16)).tofile(path)
    elif array.dtype == mx.bool_:
        np.array(array).astype(np.uint8).tofile(path)
    else:
        np.array(array).tofile(path)


def run_case(tmp, dims, padding, fma, seed):
    """(problems, max |output - stock| / max |stock|, max |state - stock| / max |stock state|)."""
    from mlx_vlm.models.glm5_next import language as _lang

    layer, inputs, has_mask, state_before, expected, cache = _layer_step(dims, padding, seed)
    expected_state, expected_window = np.array(cache[1]), np.array(cache[0].view(mx.uint16))
    hidden, heads, head_dim = dims
    batch, taps = inputs[-1].shape[0], inputs[2].shape[1]
    paths = [tmp / f"in{i}" for i in range(len(inputs))] + [tmp / "out"]
    for array, path in zip(inputs, paths):
        _to_file(array, path)
    source = PRELUDE + HOST_FUNCTIONS + PROGRAM % {
        "helpers": kernel.CUDA_HELPERS, "source": kernel.CUDA_SOURCE, "B": batch, "H": heads, "D": head_dim,
        "KC": taps,
        "FMA_NORM": fma[0], "FMA_STATE": fma[1], "HAS_MASK": "true" if has_mask else "false",
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint8)
    n_out = batch * heads * head_dim
    out = mx.array(raw[: 2 * n_out].view(np.uint16)).view(mx.bfloat16).reshape(batch, 1, heads * head_dim)
    n_state = state_before.size
    state = raw[2 * n_out: 2 * n_out + 4 * n_state].view(np.float32).reshape(state_before.shape)
    window = raw[2 * n_out + 4 * n_state:].view(np.uint16).reshape(expected_window.shape)
    got = _lang.linear(layer.o_proj, out)
    problems = []
    if np.any(np.array(out.astype(mx.float32)) == -7.0) or np.any(state == -7.0):
        problems.append("an output was never written")
    if not np.array_equal(window, expected_window):  # a copy: bit for bit
        problems.append("the new conv window differs from stock's")
    if has_mask:
        masked = ~np.array(inputs[-1])
        if masked.any() and not np.array_equal(state[masked].view(np.uint32), state_before[masked].view(np.uint32)):
            problems.append("a masked row's state changed")
    scale = float(mx.abs(expected.astype(mx.float32)).max().item())
    out_err = float(mx.abs(got.astype(mx.float32) - expected.astype(mx.float32)).max().item()) / scale
    state_err = float(np.abs(state - expected_state).max() / np.abs(expected_state).max())
    return problems, out_err, state_err


# Agreement with the CPU's stock step, whose q, k and y round to bf16 in another order:
# a few bf16 ulps (0.4% each). A layout or indexing error is off by tens of percent.
OUT_TOLERANCE, STATE_TOLERANCE = 2e-2, 2e-2


def cases():
    """(name, dims (hidden, heads, head dim), left padding or None, FMA variant)."""
    yield "4 heads of 64, batch 1", (256, 4, 64), None, (1, 1)
    yield "4 heads of 64, padded batch of 3", (256, 4, 64), [0, 2, 7], (1, 1)
    yield "2 heads of 128, batch 1, no fma", (256, 2, 128), None, (0, 0)
    yield "2 heads of 128, padded batch of 2", (256, 2, 128), [0, 6], (1, 0)
    yield "3 heads of 32, batch 1", (128, 3, 32), None, (0, 1)


def main():
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, dims, padding, fma) in enumerate(cases()):
            problems, out_err, state_err = run_case(Path(tmp), dims, padding, fma, seed)
            if out_err > OUT_TOLERANCE:
                problems.append(f"output off by {out_err:.3g} of its scale")
            if state_err > STATE_TOLERANCE:
                problems.append(f"state off by {state_err:.3g} of its scale")
            failed += bool(problems)
            verdict = "FAIL: " + "; ".join(problems) if problems else "pass"
            print(f"{name} (FMA {fma}): output {out_err:.2e}, state {state_err:.2e} of scale: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the CUDA kernel body on the host: ``python -m glm53_patches.patches.kda_prefill_kernel.checks.host_check``.

    python -m glm53_patches.patches.kda_prefill_kernel.checks.host_check [--nvcc-include MLX_SOURCE_DIR]

The kernel (``cuda.CUDA_SOURCE``) could not be run where it was written (no
GPU). As ``indexer_fp32/host_check.py`` does for its kernels, this compiles
the body's source text, unchanged, into a C++ program with g++: CUDA
built-ins are stubbed (``blockIdx``/``threadIdx``, ``__shfl_xor_sync``,
``expf``, bf16 as a bit pattern widened to float and rounded back to nearest
even), and every warp runs as 32 host threads that exchange values through a
barrier in ``__shfl_xor_sync`` (a lane missing from a shuffle would hang;
caught by a timeout). The 32 lane threads walk the warps in order (the body
has no block-level synchronisation, so warps are independent). Outputs are
compared with a float64 numpy recurrence.

What it checks: index arithmetic (batch, token, head, dv row, the lane's key
columns), the one-token-ahead prefetch, the warp reductions, the mask (masked
tokens output 0, state untouched), a nonzero initial state, general Dk (a
multiple of 32), Dk != Dv, 1, 2 and 4 dv rows per warp, the early return of
the warps of a partial last block, and that the body compiles as C++17. What it
cannot check: NVRTC itself, MLX's generated signature, GPU expf's last ulp,
and speed. Needs g++ on PATH; not part of the test suite.

``--nvcc-include DIR`` (DIR: an MLX source tree, holding
``mlx/backend/cuda/device/utils.cuh``) also compiles, with nvcc for sm_90a,
the kernel as MLX generates it (``build_kernel`` in
``mlx/backend/cuda/custom_kernel.cpp``: default header, signature from the
input and output names and dtypes, template constants, the body) for a few
template instances, and prints ptxas' register and spill counts. nvcc is not
NVRTC (MLX compiles with NVRTC and ``--device-as-default-execution-space``),
but it is the same front end.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import cuda

PROGRAM = r"""
template <typename InT, int H, int Dk, int Dv, int RPW, bool HAS_MASK>
void body(const InT* q, const InT* k, const InT* v, const float* g, const float* beta, const float* state_in,
          const bool* mask, const int64_t* sizes, InT* y, float* state_out) {
%(cuda)s
}

int main(int argc, char** argv) {
  const long B = %(B)d, T = %(T)d;
  constexpr int H = %(H)d, Dk = %(Dk)d, Dv = %(Dv)d, RPW = %(RPW)d;
  constexpr bool HAS_MASK = %(HAS_MASK)s;
  using InT = %(InT)s;
  auto q = load<InT>(argv[1], B * T * H * Dk);
  auto k = load<InT>(argv[2], B * T * H * Dk);
  auto v = load<InT>(argv[3], B * T * H * Dv);
  auto g = load<float>(argv[4], B * T * H * Dk);
  auto beta = load<float>(argv[5], B * T * H);
  auto state = load<float>(argv[6], B * H * Dv * Dk);
  auto mask_bytes = load<uint8_t>(argv[7], B * T);
  std::vector<char> mask_chars(mask_bytes.begin(), mask_bytes.end());
  const bool* mask = reinterpret_cast<const bool*>(mask_chars.data());
  const long warps = B * H * (Dv / RPW), block = %(block)d;
  const long launched = (warps * 32 + block - 1) / block * block / 32;  // MLX rounds the grid up to whole blocks
  int64_t sizes[2] = {T, warps};
  std::vector<InT> y(B * T * H * Dv, InT(-7.0f));  // poison: every element must be written
  std::vector<float> state_out(B * H * Dv * Dk, -7.0f);
  std::barrier<> barrier(32);
  warp_barrier = &barrier;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      for (long warp = 0; warp < launched; ++warp) {
        long t = warp * 32 + lane;
        blockIdx = {unsigned(t / block), 0, 0};
        blockDim = {unsigned(block), 1, 1};
        threadIdx = {unsigned(t %% block), 0, 0};
        body<InT, H, Dk, Dv, RPW, HAS_MASK>(q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), mask,
                                       sizes, y.data(), state_out.data());
      }
    });
  }
  for (auto& th : lanes) th.join();
  std::vector<float> yf(y.begin(), y.end());
  FILE* f = std::fopen(argv[8], "wb");
  std::fwrite(yf.data(), 4, yf.size(), f);
  std::fwrite(state_out.data(), 4, state_out.size(), f);
  std::fclose(f);
  return 0;
}
"""

LB = -5.0  # KDA's gate lower bound: log decay in (-5, 0)

# (batch, tokens, heads, Dk, Dv, dtype, left padding per row or None)
CASES = [
    (2, 37, 3, 64, 64, "f32", (0, 9)),
    (2, 37, 3, 128, 128, "f32", (0, 9)),
    (2, 37, 3, 128, 128, "bf16", (4, 0)),
    (1, 23, 2, 96, 48, "f32", None),  # Dk != Dv, 3 columns per lane, no mask
    (1, 11, 1, 256, 36, "f32", (3,)),  # widest Dk: 2 rows per warp, 18 warps (a partial block)
    (2, 19, 3, 32, 15, "bf16", (0, 6)),  # Dv odd: 1 row per warp, 90 warps (a partial block)
]


def _bf16_round(x):
    """float32 -> nearest-even bf16 values (as float32) and their 16-bit patterns."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32), bits


def reference(q, k, v, g, beta, state, mask):
    """The recurrence in float64, token by token (masked: y 0, state kept)."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    y = np.zeros(v.shape)
    for t in range(q.shape[1]):
        new = S * np.exp(g[:, t])[:, :, None, :]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhvd,bhd->bhv", new, k[:, t]))
        new = new + delta[..., None] * k[:, t][:, :, None, :]
        keep = mask[:, t]
        y[:, t] = np.where(keep[:, None, None], np.einsum("bhvd,bhd->bhv", new, q[:, t]), 0.0)
        S = np.where(keep[:, None, None, None], new, S)
    return y, S


def make_inputs(rng, batch, length, heads, dk, dv, padding):
    """Inputs scaled as the mixer's: q, k rms-normed, q * Dk^-1, k * Dk^-0.5."""

    def normed(scale):
        x = rng.standard_normal((batch, length, heads, dk))
        return scale * x / np.sqrt((x * x).mean(-1, keepdims=True))

    q, k = normed(dk**-1.0), normed(dk**-0.5)
    v = rng.standard_normal((batch, length, heads, dv))
    g = LB / (1.0 + np.exp(-rng.normal(-2.0, 1.5, (batch, length, heads, dk))))  # decay mostly 0.6-0.99
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, length, heads))))
    state = 0.5 * rng.standard_normal((batch, heads, dv, dk))
    pads = padding or (0,) * batch
    mask = np.arange(length)[None] >= np.array(pads)[:, None]
    if padding is not None:  # the mixer zeroes padded inputs
        q, k, v = (np.where(mask[:, :, None, None], a, 0.0) for a in (q, k, v))
    return [a.astype(np.float32) for a in (q, k, v, g, beta, state)] + [mask]


def _case(tmp, rng, batch, length, heads, dk, dv, dtype, padding):
    q, k, v, g, beta, state, mask = make_inputs(rng, batch, length, heads, dk, dv, padding)
    raw = [q, k, v]
    if dtype == "bf16":
        (q, qb), (k, kb), (v, vb) = _bf16_round(q), _bf16_round(k), _bf16_round(v)
        raw = [qb, kb, vb]
    paths = [tmp / n for n in ("q", "k", "v", "g", "beta", "state", "mask", "out")]
    for path, array in zip(paths, raw + [g, beta, state, mask.astype(np.uint8)]):
        array.tofile(path)
    rows = cuda.rows_per_warp(dk, dv)
    source = PRELUDE + PROGRAM % {
        "cuda": cuda.CUDA_SOURCE, "B": batch, "T": length, "H": heads, "Dk": dk, "Dv": dv,
        "HAS_MASK": "true" if padding is not None else "false", "InT": "bf16" if dtype == "bf16" else "float",
        "RPW": rows, "block": min(cuda.THREADS, batch * heads * (dv // rows) * 32),
    }
    ran = build_and_run(tmp, source, paths, timeout=300)
    out = np.fromfile(paths[-1], dtype=np.float32)
    n_y = batch * length * heads * dv
    y, s = out[:n_y].reshape(batch, length, heads, dv), out[n_y:].reshape(batch, heads, dv, dk)
    y_ref, s_ref = reference(q, k, v, g, beta, state, mask)
    y_err = float(np.abs(y - y_ref).max())
    s_err = float(np.abs(s - s_ref).max())
    y_scale, s_scale = float(np.abs(y_ref).max()), float(np.abs(s_ref).max())
    masked_zero = bool(np.all(y[~mask] == 0))
    # float32: a few ulps of |S| ~ 2; bf16 y: its own output rounding (2^-9 relative) dominates
    y_tol = y_scale * 2**-8 if dtype == "bf16" else 1e-5
    ok = s_err < 1e-5 and y_err < y_tol and masked_zero
    return dict(y_err=y_err, y_max=y_scale, s_err=s_err, s_max=s_scale, masked_zero=masked_zero, ok=ok, run_s=ran)


_CUDA_TYPES = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float"}
_MLX_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""
# (dtype, H, Dk, Dv, HAS_MASK): the GLM-5.3-Flash instances and the odd ones
NVCC_CASES = [
    ("bf16", 64, 128, 128, True),
    ("bf16", 64, 128, 128, False),
    ("f32", 3, 256, 36, True),
    ("f16", 2, 32, 15, False),
]


def generated_source(name, dtype, heads, dk, dv, masked):
    """The kernel source as MLX's ``build_kernel`` writes it."""
    t = _CUDA_TYPES[dtype]
    types = [t, t, t, "float", "float", "float", "bool", "int64_t"]
    params = [f"    const {ty}* {n},\n" for n, ty in zip(cuda.INPUT_NAMES, types)]
    params += [f"    {t}* y,\n", "    float* state_out) {\n"]
    consts = [("InT", t), ("H", heads), ("Dk", dk), ("Dv", dv), ("RPW", cuda.rows_per_warp(dk, dv)),
              ("HAS_MASK", "true" if masked else "false")]
    body = "".join(
        f"  using {n} = {v};\n" if n == "InT" else f"  constexpr {'bool' if n == 'HAS_MASK' else 'int'} {n} = {v};\n"
        for n, v in consts
    )
    return (_MLX_HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {name}(\n" + "".join(params) + body + "\n" + cuda.CUDA_SOURCE
            + "\n}\n\n} // namespace mlx::core::cu\n")


def nvcc_check(include):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc: not on PATH, skipped")
        return True
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(NVCC_CASES):
            path = Path(tmp) / f"kernel{i}.cu"
            path.write_text(generated_source(f"custom_kernel_glm53_kda_prefill_{i}", *case))
            run = subprocess.run(
                [nvcc, "-std=c++17", "-arch=sm_90a", f"-I{include}", "-cubin", "-Xptxas", "-v",
                 "-o", str(path.with_suffix(".cubin")), str(path)],
                capture_output=True, text=True,
            )
            info = re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes stack frame", run.stderr)
            warnings = [line for line in run.stderr.splitlines() if "warning" in line.lower()]
            ok &= run.returncode == 0 and not warnings
            print(f"nvcc sm_90a {case}: {'compiled' if run.returncode == 0 else 'FAILED'}; {', '.join(info)}"
                  + (f"; warnings: {warnings}" if warnings else ""), flush=True)
            if run.returncode:
                print(run.stderr)
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvcc-include", help="MLX source tree: also compile the generated kernel with nvcc")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    all_ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            r = _case(Path(tmp), rng, *case)
            all_ok &= r["ok"]
            print(
                f"B,T,H,Dk,Dv={case[:5]} {case[5]} pad={case[6]}: "
                f"max|y-ref| {r['y_err']:.2e} (|y| <= {r['y_max']:.2f}), "
                f"max|S-ref| {r['s_err']:.2e} (|S| <= {r['s_max']:.2f}), masked y == 0: {r['masked_zero']}, "
                f"{'ok' if r['ok'] else 'FAILED'} ({r['run_s']:.1f} s)",
                flush=True,
            )
    if args.nvcc_include:
        all_ok &= nvcc_check(args.nvcc_include)
    print("ok" if all_ok else "FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

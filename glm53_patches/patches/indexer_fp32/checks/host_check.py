"""Run the CUDA and Metal kernel bodies on the host: ``python -m glm53_patches.patches.indexer_fp32.checks.host_check``.

Neither kernel could be run where they were written (no GPU, no Mac). This
compiles each body's source text, unchanged, into a C++ program with g++:
GPU built-ins are stubbed (``blockIdx``/``threadIdx``, address-space
qualifiers, bf16 as a bit pattern widened to float), and every warp
(simdgroup) runs as 32 host threads, so that ``__shfl_xor_sync`` and
``simd_sum`` exchange real values through a barrier; a warp whose lanes did
not all arrive would hang (caught by a timeout). Results are compared with a
float64 reference, and the mask and the grid tail (threads past the last
pair) are exercised.

What it checks: index arithmetic (batch, query, pool, head offsets), the
head loop for H above and below 32, the reduction, the mask, the early exit of
whole warps, and that the sources compile as C++17. What it cannot check:
the GPU compilers (NVRTC, Metal) themselves, MLX's generated signature, and
speed. Needs g++ on PATH; not part of the test suite.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import kernels

PROGRAM = r"""
template <typename T, int H, int D, bool HAS_MASK>
void cuda_body(const T* q, const T* keys, const float* ws, const bool* candidates, const int64_t* sizes, float* out) {
%(cuda)s
}

template <typename T, int H, int D, bool HAS_MASK>
void metal_body(const T* q, const T* keys, const float* ws, const bool* candidates, const int64_t* sizes, float* out,
                uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
%(metal)s
}

int main(int argc, char** argv) {
  const long B = %(B)d, L = %(L)d, P = %(P)d;
  constexpr int H = %(H)d, D = %(D)d;
  constexpr bool HAS_MASK = %(HAS_MASK)s;
  using T = %(T)s;
  auto q = load<T>(argv[1], B * L * H * D);
  auto keys = load<T>(argv[2], B * P * D);
  auto ws = load<float>(argv[3], B * L * H);
  auto mask_bytes = load<uint8_t>(argv[4], B * L * P);
  std::vector<char> mask(mask_bytes.begin(), mask_bytes.end());
  const bool* candidates = reinterpret_cast<const bool*>(mask.data());
  int64_t sizes[3] = {L, P, B * L * P};
  const long threads = %(threads)d, block = %(block)d;  // grid rounded up to whole blocks
  std::vector<float> out_cuda(B * L * P, -1.0f), out_metal(B * L * P, -1.0f);
  std::barrier<> barrier(32);
  warp_barrier = &barrier;
  for (long warp = 0; warp < threads / 32; ++warp) {
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane) {
      lanes.emplace_back([&, warp, lane] {
        long t = warp * 32 + lane;
        blockIdx = {unsigned(t / block), 0, 0};
        blockDim = {unsigned(block), 1, 1};
        threadIdx = {unsigned(t %% block), 0, 0};
        cuda_body<T, H, D, HAS_MASK>(q.data(), keys.data(), ws.data(), candidates, sizes, out_cuda.data());
        metal_body<T, H, D, HAS_MASK>(q.data(), keys.data(), ws.data(), candidates, sizes, out_metal.data(),
                                       uint3{unsigned(t), 0, 0}, unsigned(lane));
      });
    }
    for (auto& th : lanes) th.join();
  }
  FILE* f = std::fopen(argv[5], "wb");
  std::fwrite(out_cuda.data(), 4, out_cuda.size(), f);
  std::fwrite(out_metal.data(), 4, out_metal.size(), f);
  std::fclose(f);
  return 0;
}
"""

# (batch, queries, pools, heads, dim, dtype, masked)
CASES = [
    (1, 1, 37, 32, 128, "bf16", True),  # decode at the real widths
    (2, 3, 5, 4, 64, "f32", True),  # lanes without heads
    (1, 2, 9, 40, 16, "bf16", False),  # more heads than lanes
    (3, 1, 3, 32, 8, "f32", False),  # fewer pairs than a block
]


def _case(tmp, batch, length, pools, heads, dim, dtype, masked, rng):
    q = rng.standard_normal((batch, length, heads, dim)).astype(np.float32)
    keys = rng.standard_normal((batch, pools, dim)).astype(np.float32)
    if dtype == "bf16":  # keep bf16-representable values, stored as their top 16 bits
        q = (q.view(np.uint32) & 0xFFFF0000).view(np.float32)
        keys = (keys.view(np.uint32) & 0xFFFF0000).view(np.float32)
        q_raw, keys_raw = (q.view(np.uint32) >> 16).astype(np.uint16), (keys.view(np.uint32) >> 16).astype(np.uint16)
    else:
        q_raw, keys_raw = q, keys
    ws = rng.standard_normal((batch, length, heads)).astype(np.float32)
    mask = rng.random((batch, length, pools)) < 0.7 if masked else np.ones((batch, length, pools), bool)
    paths = [tmp / name for name in ("q", "keys", "ws", "mask", "out")]
    for path, array in zip(paths, (q_raw, keys_raw, ws, mask.astype(np.uint8))):
        array.tofile(path)
    threads = batch * length * pools * kernels.LANES
    block = min(kernels.THREADS, threads)
    threads = -(-threads // block) * block  # what MLX's CUDA launch rounds up to
    source = PRELUDE + PROGRAM % {
        "cuda": kernels.CUDA_SOURCE, "metal": kernels.METAL_SOURCE, "B": batch, "L": length, "P": pools,
        "H": heads, "D": dim, "HAS_MASK": "true" if masked else "false", "T": "bf16" if dtype == "bf16" else "float",
        "threads": threads, "block": block,
    }
    build_and_run(tmp, source, paths, timeout=120)
    out = np.fromfile(paths[-1], dtype=np.float32).reshape(2, batch, length, pools)
    dots = q.astype(np.float64) @ keys.astype(np.float64)[:, None].swapaxes(-1, -2)
    reference = (np.maximum(dots, 0) * ws.astype(np.float64)[..., None]).sum(axis=2)
    reference = np.where(mask, reference, np.float32(np.finfo(np.float32).min))
    scale = np.abs(reference[mask]).max()
    return [float(np.abs(o - reference).max() / scale) for o in out]


def main():
    rng = np.random.default_rng(0)
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            errors = _case(Path(tmp), *case, rng)
            worst = max(worst, *errors)
            print(f"{case}: max |error| / max |score|: cuda body {errors[0]:.2e}, metal body {errors[1]:.2e}")
    ok = worst < 1e-5
    print("ok" if ok else "FAILED", f"(worst {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Run the router kernel's body on the host: ``python -m glm53_patches.patches.router_select.checks.host_check``.

The body (``kernel.SELECT_BODY``, the text the CUDA and Metal kernels are
made of) is compiled unchanged into a C++ program with g++, its primitives
given their plain C++ meaning (``glm53_patches/checks/host_emulation.py``:
each warp runs as 32 host threads exchanging values through a barrier).
Outputs are compared with numpy's float32 evaluation of stock's
``_expert_select`` under a stable sort (ORDER 0) or the radix-select order
(ORDER 1).

What it checks: the selection and its order, ties (equal logits and biases
give bitwise-equal keys on any math library), NaN rows, E not a multiple of
32, K from 1 to 32, normalisation on and off, several rows. What it cannot
check: that the order and the weight sum match MLX on a GPU (``verify`` and
``device_check`` do), NVRTC, or the last ulp of the GPU's ``expf``: weights
are compared to 2 ulps. Needs g++ on PATH.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import kernel

PROGRAM = r"""
#define RS_ROW blockIdx.x
#define RS_LANE threadIdx.x
#define RS_SIGMOID(x) host_sigmoid(x)
#define RS_ADD(a, b) ((a) + (b))
#define RS_DIVIDE(a, b) ((a) / (b))
#define RS_MULTIPLY(a, b) ((a) * (b))
#define RS_SHFL_XOR(v, off) __shfl_xor_sync(0xffffffffu, v, off)
#define RS_INLINE inline
%(before)s
float host_sigmoid(float x) {  // MLX's Sigmoid functor
  float y = 1 / (1 + std::exp(std::fabs(x)));
  return (x < 0) ? y : 1 - y;
}

template <int E, int K, bool NORM, int ORDER, int SUMCHUNK>
void body(const float* logits, const float* bias, const float* consts, int* indices, float* weights) {
%(body)s
}

int main(int argc, char** argv) {
  constexpr int E = %(E)d, K = %(K)d, R = %(R)d;
  auto logits = load<float>(argv[1], R * E);
  auto bias = load<float>(argv[2], E);
  auto consts = load<float>(argv[3], 2);
  std::vector<int> indices(R * K, -7);
  std::vector<float> weights(R * K, -7.0f);
  std::barrier<> barrier(32);
  warp_barrier = &barrier;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      for (int row = 0; row < R; ++row) {
        blockIdx = {unsigned(row), 0, 0};
        blockDim = {32, 1, 1};
        threadIdx = {unsigned(lane), 0, 0};
        body<E, K, %(NORM)s, %(ORDER)d, %(SUMCHUNK)d>(logits.data(), bias.data(), consts.data(),
                                                   indices.data(), weights.data());
      }
    });
  }
  for (auto& th : lanes) th.join();
  FILE* f = std::fopen(argv[4], "wb");
  std::fwrite(indices.data(), 4, indices.size(), f);
  std::fwrite(weights.data(), 4, weights.size(), f);
  std::fclose(f);
  return 0;
}
"""


def reference(logits, bias, top_k, norm, scale, order):
    """Stock ``_expert_select`` in numpy float32, argpartition taken as a stable ascending sort."""
    x = logits.astype(np.float32)
    y = (np.float32(1) / (np.float32(1) + np.exp(np.abs(x)))).astype(np.float32)
    scores = np.where(x < 0, y, np.float32(1) - y).astype(np.float32)
    keys = -(scores + bias)
    # NaN last, ties by index: a stable sort on (isnan, value).
    nan = np.isnan(keys)
    ranked = np.lexsort((np.arange(keys.shape[-1])[None].repeat(len(keys), 0), np.where(nan, 0, keys), nan), axis=-1)
    picked = ranked[:, :top_k]
    if order == 1:
        pivot = np.take_along_axis(keys, picked[:, -1:], -1)
        picked_keys = np.take_along_axis(keys, picked, -1)
        equal = (picked_keys == pivot) | (np.isnan(picked_keys) & np.isnan(pivot))
        picked = np.take_along_axis(picked, np.lexsort((picked, equal), axis=-1), -1)
    weights = np.take_along_axis(scores, picked, -1)
    if norm and top_k > 1:
        weights = weights / (weights.sum(-1, keepdims=True, dtype=np.float32) + np.float32(1e-20))
    return picked.astype(np.int32), (weights * np.float32(scale)).astype(np.float32)


def cases(rng):
    """(name, logits [R, E], bias [E], K, norm, order)."""
    yield "glm 288x8", rng.normal(0, 2, (5, 288)), rng.normal(0, 0.1, 288), 8, True, 0
    yield "glm 288x8 radix order", rng.normal(0, 2, (5, 288)), rng.normal(0, 0.1, 288), 8, True, 1
    tied = np.repeat(rng.normal(0, 1, (3, 12)), 24, axis=1)[:, :288]  # 24 copies of each value
    yield "ties", tied, np.zeros(288), 8, True, 0
    yield "ties radix order", tied, np.zeros(288), 8, True, 1
    nan = rng.normal(0, 1, (2, 64))
    nan[0, [3, 9, 40]] = np.nan
    nan[1, :] = np.nan
    yield "NaN rows", nan, rng.normal(0, 0.1, 64), 6, True, 0
    yield "E=50, K=1", rng.normal(0, 1, (4, 50)), rng.normal(0, 0.1, 50), 1, True, 0
    yield "E=1000, K=32, no norm", rng.normal(0, 1, (2, 1000)), rng.normal(0, 0.1, 1000), 32, False, 0
    yield "E=1000, K=32", rng.normal(0, 1, (2, 1000)), rng.normal(0, 0.1, 1000), 32, True, 0


def run_case(tmp, logits, bias, top_k, norm, order, scale=2.5):
    logits, bias = logits.astype(np.float32), bias.astype(np.float32)
    rows, experts = logits.shape
    paths = [tmp / n for n in ("logits", "bias", "consts", "out")]
    for path, array in zip(paths, (logits, bias, np.array([1e-20, scale], np.float32))):
        array.tofile(path)
    source = PRELUDE + PROGRAM % {
        "before": kernel.BEFORE, "body": kernel.SELECT_BODY, "E": experts, "K": top_k, "R": rows,
        "NORM": "true" if norm else "false", "ORDER": order, "SUMCHUNK": 4,
    }
    build_and_run(tmp, source, paths, timeout=120)
    out = np.fromfile(paths[-1], dtype=np.int32)
    indices = out[: rows * top_k].reshape(rows, top_k)
    weights = out[rows * top_k:].view(np.float32).reshape(rows, top_k)
    ref_indices, ref_weights = reference(logits, bias, top_k, norm, scale, order)
    same_weights = np.allclose(weights, ref_weights, rtol=2.4e-7, atol=0, equal_nan=True)
    return bool(np.array_equal(indices, ref_indices)) and same_weights, indices, ref_indices


def main():
    rng = np.random.default_rng(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, logits, bias, top_k, norm, order in cases(rng):
            ok, got, want = run_case(Path(tmp), logits, bias, top_k, norm, order)
            failed += not ok
            print(f"{'ok' if ok else 'FAILED':>6}  {name}")
            if not ok:
                print("   got ", got[:2].tolist(), "\n   want", want[:2].tolist())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""exact_sparse_prefill's two CUDA kernels, their source text unchanged, run on the host with g++.

``glm53_patches.checks.host_emulation`` stubs the CUDA built-ins and runs every
warp as 32 threads that really exchange values in ``__shfl_xor_sync``. The
kernels are compared, bit for bit, with:

* for ``scores``: MLX's CUDA gemv written out from ``gemms/gemv.cu``. Lane
  ``l`` adds its columns ``NPT*l ..`` pass by pass in float32 fmas, then
  ``cg::reduce``'s xor tree from 16 down to 1, cast to the dtype; the mask's
  ``where`` is applied to that value. The reference itself is checked
  against MLX's CPU matmul within rounding;
* for ``gathered_values``: stock's ``_sparse_head_gather`` on the CPU, which
  is a copy, so bit for bit.

Cases: float32 and bf16; key dims 48, 64 and 128 (gemv's 1, 2 and 4 values
per lane); 21 selected keys (a partial last group of 8); -1 holes and
out-of-range indices; batch 2; a grid rounded up to whole blocks. The
reference with the other FMA reading must differ on float32, so the check
can tell the two orders apart. Needs g++ (C++20), as MLX's CPU backend does.

The H200's ``verify`` is the last word on the order: it matched stock's GPU
bits in 30 cases (PATCH.md). This checks the kernels' text (index
arithmetic, the warp reduction, the mask, the early return) and that the
order is the one PATCH.md describes.
"""

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run
from glm53_patches.patches.exact_sparse_prefill import kernel
from glm53_patches.patches.gathered_prefill.checks.verify import indexer_like
from mlx_vlm.models.glm5_next import language

HOST_FUNCTIONS = r"""
float __fmul_rn(float a, float b) { return a * b; }
float __fadd_rn(float a, float b) { return a + b; }
"""

PROGRAM = r"""
template <typename T, int H, int D, int NPT, int FMA, int SLOTS>
void scores_body(const T* qs, const T* k, const int* idx, const T* lowest, const int64_t* sizes, T* scores) {
%(scores)s
}

template <typename T, int H, int DV, int VEC>
void gather_body(const T* v, const int* idx, const int64_t* sizes, T* out) {
%(gather)s
}

// MLX's gemv_impl for one output row, its lanes written out; then the mask's where.
template <typename T>
T gemv_row(const T* krow, const T* qrow, bool fma) {
  float lanes[32];
  for (int l = 0; l < 32; ++l) {
    float sum = 0.0f;
    for (int col = NPT_ * l; col < D_; col += 32 * NPT_) {
      for (int j = 0; j < NPT_; ++j) {
        const float a = float(krow[col + j]), b = float(qrow[col + j]);
        sum = fma ? __builtin_fmaf(a, b, sum) : sum + a * b;
      }
    }
    lanes[l] = sum;
  }
  for (int off = 16; off > 0; off >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
    std::memcpy(lanes, next, sizeof lanes);
  }
  return T(lanes[0]);
}

int main(int argc, char** argv) {
  using T = %(T)s;
  const size_t nq = (size_t)B_ * H_ * L_ * D_, nk = (size_t)B_ * H_ * N_ * D_, ni = (size_t)B_ * L_ * K_;
  auto qs = load<T>(argv[1], nq);
  auto k = load<T>(argv[2], nk);
  auto v = load<T>(argv[3], nk);
  auto idx = load<int>(argv[4], ni);
  const T lowest[1] = {T(%(lowest)s)};
  const long groups = (K_ + SLOTS_ - 1) / SLOTS_, warps = (long)B_ * L_ * H_ * groups;
  int64_t ssizes[5] = {L_, N_, K_, groups, warps};
  const long vecs = (long)B_ * L_ * H_ * K_ * D_ / VEC_;
  int64_t gsizes[4] = {L_, N_, K_, vecs};
  const long block = %(block)d;
  std::vector<T> scores((size_t)B_ * L_ * H_ * K_, T(-7.0f)), gathered((size_t)B_ * L_ * H_ * K_ * D_, T(-7.0f));
  // Both grids as MLX launches them: rounded up to whole blocks (the extra threads return).
  const long score_warps = (warps * 32 + block - 1) / block * block / 32;
  const long gather_threads = (vecs + block - 1) / block * block;
  std::barrier<> barrier(32);
  warp_barrier = &barrier;
  std::vector<std::thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      for (long w = 0; w < score_warps; ++w) {
        const long t = w * 32 + lane;
        blockIdx = {unsigned(t / block), 0, 0};
        blockDim = {unsigned(block), 1, 1};
        threadIdx = {unsigned(t %% block), 0, 0};
        scores_body<T, H_, D_, NPT_, FMA_, SLOTS_>(qs.data(), k.data(), idx.data(), lowest, ssizes, scores.data());
      }
    });
  }
  for (auto& th : lanes) th.join();
  for (long t = 0; t < gather_threads; ++t) {  // no warp built-ins: one thread at a time
    blockIdx = {unsigned(t / block), 0, 0};
    blockDim = {unsigned(block), 1, 1};
    threadIdx = {unsigned(t %% block), 0, 0};
    gather_body<T, H_, D_, VEC_>(v.data(), idx.data(), gsizes, gathered.data());
  }
  std::vector<T> ref(scores.size()), other(scores.size());
  for (long b = 0; b < B_; ++b)
    for (long i = 0; i < L_; ++i)
      for (int h = 0; h < H_; ++h)
        for (long j = 0; j < K_; ++j) {
          const int id = idx[((size_t)b * L_ + i) * K_ + j];
          const size_t at = (((size_t)b * L_ + i) * H_ + h) * K_ + j;
          const bool valid = id >= 0 && id < N_;
          const T* krow = &k[(((size_t)b * H_ + h) * N_ + (valid ? id : 0)) * D_];
          const T* qrow = &qs[(((size_t)b * H_ + h) * L_ + i) * D_];
          ref[at] = valid ? gemv_row<T>(krow, qrow, FMA_) : lowest[0];
          other[at] = valid ? gemv_row<T>(krow, qrow, !FMA_) : lowest[0];
        }
  FILE* f = std::fopen(argv[5], "wb");
  for (auto* out : {&scores, &ref, &other, &gathered}) std::fwrite(out->data(), sizeof(T), out->size(), f);
  std::fclose(f);
  return 0;
}
"""

CASES = {  # dtype, key dim
    "float32, D=48 (1 value per lane)": (mx.float32, 48),
    "float32, D=64 (2 values per lane)": (mx.float32, 64),
    "float32, D=128 (4 values per lane)": (mx.float32, 128),
    "bf16, D=128": (mx.bfloat16, 128),
    "bf16, D=64": (mx.bfloat16, 64),
}
B, H, L, N, TOPK, KPOOL = 2, 3, 5, 37, 16, 4  # 16 pool keys + 3 tail slots = 19 selected per query


def _to_file(array, path):
    array = mx.contiguous(array)
    np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array).tofile(path)


def run_case(tmp, dtype, dim, seed):
    mx.random.seed(seed)
    qs = (mx.random.normal((B, H, L, dim)) * 0.5).astype(dtype)
    k = mx.random.normal((B, H, N, dim)).astype(dtype)
    v = mx.random.normal((B, H, N, dim)).astype(dtype)
    idx = indexer_like(B, L, N, TOPK, KPOOL, seed, holes=0.1, beyond=0.1, padded_rows=[(1, 2)])
    K = idx.shape[-1]
    paths = [tmp / f"in{i}" for i in range(4)] + [tmp / "out"]
    for array, path in zip((qs, k, v, idx), paths):
        _to_file(array, path)
    width = 16 // dtype.size
    defines = "".join(f"constexpr long {name}_ = {value};\n" for name, value in (
        ("B", B), ("L", L), ("N", N), ("K", K)))
    defines += "".join(f"constexpr int {name}_ = {value};\n" for name, value in (
        ("H", H), ("D", dim), ("NPT", kernel.gemv_per_thread(dim)), ("FMA", kernel.DEFAULT_FMA),
        ("SLOTS", kernel.SLOTS), ("VEC", width if dim % width == 0 else 1)))
    lowest = mx.array(mx.finfo(dtype).min, dtype=dtype).item()  # what kernel.scores hands the kernel
    source = PRELUDE + HOST_FUNCTIONS + defines + PROGRAM % {
        "scores": kernel.SCORES_SOURCE, "gather": kernel.GATHER_SOURCE, "block": kernel.THREADS,
        "T": "bf16" if dtype == mx.bfloat16 else "float", "lowest": repr(lowest) + "f",
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint16 if dtype == mx.bfloat16 else np.uint32)
    n_scores = B * L * H * K
    scores, ref, other, gathered = np.split(raw, [n_scores, 2 * n_scores, 3 * n_scores])
    return dict(qs=qs, k=k, v=v, idx=idx, scores=scores, ref=ref, other=other, gathered=gathered)


def as_float(bits, dtype):
    return np.array(mx.array(bits).view(dtype).astype(mx.float32))


@pytest.mark.parametrize("case", CASES)
def test_kernels_match_mlx_gemv_order_and_stocks_gather(tmp_path, case):
    dtype, dim = CASES[case]
    found = run_case(tmp_path, dtype, dim, seed=list(CASES).index(case))
    assert np.array_equal(found["scores"], found["ref"]), "scores kernel differs from gemv's order"

    # The reference computes what stock computes: q . k over the selected rows, masked (MLX's CPU, within rounding).
    idx, K = found["idx"], found["idx"].shape[-1]
    keys = language._sparse_head_gather(found["k"], mx.clip(idx, 0, N - 1))  # [B*L, H, K, D]
    rows = found["qs"].astype(mx.float32).transpose(0, 2, 1, 3).reshape(B * L, H, 1, dim)
    cpu = (rows @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, L, H, K)
    valid = np.broadcast_to(np.array((idx >= 0) & (idx < N))[:, :, None, :], (B, L, H, K))
    ours = as_float(found["ref"], dtype).reshape(B, L, H, K)
    assert np.all(ours[~valid] == np.finfo(np.float32).min if dtype == mx.float32 else ours[~valid] < -3e38)
    tolerance = 2**-7 if dtype == mx.bfloat16 else 1e-5
    assert np.abs(ours[valid] - np.array(cpu)[valid]).max() <= tolerance * max(np.abs(np.array(cpu)).max(), 1.0)

    if dtype == mx.float32:  # bf16 products are exact in float32: both readings agree there
        assert not np.array_equal(found["ref"], found["other"]), "the check cannot tell fma from mul + add"

    expected = language._sparse_head_gather(found["v"], mx.clip(idx, 0, N - 1))
    bits = np.array(expected.view(mx.uint16 if dtype == mx.bfloat16 else mx.uint32)).reshape(-1)
    assert np.array_equal(found["gathered"], bits), "value gather differs from stock's _sparse_head_gather"

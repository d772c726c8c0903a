"""Run the CUDA kernel's body on the host, against stock's step written out in C++.

    python -m glm53_patches.patches.exact_kda_prefill.checks.host_check

The CUDA source (``kernel.CUDA_SOURCE``) is pasted unchanged into a C++
program and compiled with g++; the CUDA intrinsics it calls become host
functions of the same arithmetic, and every warp runs as 32 host threads
(``host_emulation.py``). The same program holds ``reference``: stock's
``_gated_delta_step_ops`` token by token, as plain loops, with the order
the kernel claims for CUDA (each row sum: 4 values per lane from 0, then
the xor tree). The two must agree bit for bit: y, the final state and the
history. That checks the kernel's indexing, the warps' share of the rows,
the one-token-ahead loads, the mask, the resumed state and the history;
whether CUDA's stock step rounds as ``reference`` does is what ``verify``
checks on the GPU. ``reference`` itself is checked against stock's
``gated_delta_ops`` on the CPU to a tolerance (another summation order).
Needs g++ on PATH.
"""

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run

from .. import kernel

HOST_FUNCTIONS = r"""
float __fmul_rn(float a, float b) { return a * b; }
float __fadd_rn(float a, float b) { return a + b; }
float __fsub_rn(float a, float b) { return a - b; }
"""

PROGRAM = r"""
template <typename InT, typename GT, int H, int D, int FMA_STATE, bool HAS_MASK, int STEPS>
void body(const InT* q, const InT* k, const InT* v, const GT* g, const InT* beta, const float* state_in,
          const bool* mask, const int64_t* sizes, InT* y_out, float* state_out, float* states) {
%(source)s
}

// Stock's step, token by token, the sums in the order the kernel claims for CUDA.
float row_sum(const float* p) {
  float lanes[32];
  for (int l = 0; l < 32; ++l) {
    lanes[l] = 0.0f;
    for (int i = 0; i < 4; ++i) {
      if (4 * l + i < D_) lanes[l] = lanes[l] + p[4 * l + i];
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ off];
    std::memcpy(lanes, next, sizeof lanes);
  }
  return lanes[0];
}

template <typename InT, typename GT>
void reference(const InT* q, const InT* k, const InT* v, const GT* g, const InT* beta, const float* state_in,
               const bool* mask, InT* y_out, float* state_out, float* states) {
  std::vector<float> S(state_in, state_in + (size_t)B_ * H_ * D_ * D_), sn(D_), prod(D_);
  for (long b = 0; b < B_; ++b) {
    for (long t = 0; t < T_; ++t) {
      const bool live = HAS_MASK_ ? mask[b * T_ + t] : true;
      for (int h = 0; h < H_; ++h) {
        const size_t tok = ((size_t)b * T_ + t) * H_ + h;
        for (int dv = 0; dv < D_; ++dv) {
          float* row = &S[(((size_t)b * H_ + h) * D_ + dv) * D_];
          for (int e = 0; e < D_; ++e) {
            sn[e] = row[e] * float(g[tok * D_ + e]);              // state * decay
            prod[e] = sn[e] * float(k[tok * D_ + e]);             // * k
          }
          const float kv_mem = row_sum(prod.data());              // .sum(-1)
          const float delta = (float(v[tok * D_ + dv]) - kv_mem) * float(beta[tok]);
          for (int e = 0; e < D_; ++e) {
            const float kd = float(k[tok * D_ + e]);
            sn[e] = FMA_STATE_ ? __builtin_fmaf(kd, delta, sn[e]) : sn[e] + kd * delta;  // state + k * delta
            prod[e] = sn[e] * float(q[tok * D_ + e]);             // * q
          }
          y_out[tok * D_ + dv] = static_cast<InT>(row_sum(prod.data()));  // .sum(-1).astype(q.dtype)
          if (live) std::memcpy(row, sn.data(), D_ * sizeof(float));      // where(mask, state, old_state)
        }
        if (STEPS_ > 0 && t < STEPS_) {
          std::memcpy(&states[(((size_t)b * STEPS_ + t) * H_ + h) * D_ * D_],
                      &S[((size_t)b * H_ + h) * D_ * D_], D_ * D_ * sizeof(float));
        }
      }
    }
  }
  std::memcpy(state_out, S.data(), S.size() * sizeof(float));
}

int main(int argc, char** argv) {
  using InT = %(InT)s;
  using GT = %(GT)s;
  const size_t n = (size_t)B_ * T_ * H_ * D_, ns = (size_t)B_ * H_ * D_ * D_;
  const size_t nh = (size_t)B_ * (STEPS_ > 0 ? STEPS_ : 1) * H_ * D_ * D_;
  auto q = load<InT>(argv[1], n);
  auto k = load<InT>(argv[2], n);
  auto v = load<InT>(argv[3], n);
  auto g = load<GT>(argv[4], n);
  auto beta = load<InT>(argv[5], (size_t)B_ * T_ * H_);
  auto state = load<float>(argv[6], ns);
  auto mask_bytes = load<uint8_t>(argv[7], (size_t)B_ * T_);
  std::vector<char> mask_chars(mask_bytes.begin(), mask_bytes.end());
  const bool* mask = reinterpret_cast<const bool*>(mask_chars.data());
  const long warps = (long)B_ * H_ * (D_ / 4), block = %(block)d;
  const long launched = (warps * 32 + block - 1) / block * block / 32;  // MLX rounds the grid up to whole blocks
  int64_t sizes[2] = {T_, warps};
  std::vector<InT> y(n, InT(-7.0f));  // poison: every value must be written
  std::vector<float> state_out(ns, -7.0f), states(nh, -7.0f);
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
        body<InT, GT, H_, D_, FMA_STATE_, HAS_MASK_, STEPS_>(q.data(), k.data(), v.data(), g.data(), beta.data(),
            state.data(), mask, sizes, y.data(), state_out.data(), states.data());
      }
    });
  }
  for (auto& th : lanes) th.join();
  std::vector<InT> ry(n);
  std::vector<float> rstate(ns), rstates(nh, -7.0f);
  reference<InT, GT>(q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), mask, ry.data(),
                     rstate.data(), rstates.data());
  FILE* f = std::fopen(argv[8], "wb");
  for (auto* out : {&y, &ry}) std::fwrite(out->data(), sizeof(InT), n, f);
  for (auto* out : {&state_out, &rstate}) std::fwrite(out->data(), 4, ns, f);
  for (auto* out : {&states, &rstates}) std::fwrite(out->data(), 4, nh, f);
  std::fclose(f);
  return 0;
}
"""


def _to_file(array, path):
    array = mx.contiguous(array)
    if array.dtype == mx.bfloat16:
        np.array(array.view(mx.uint16)).tofile(path)
    elif array.dtype == mx.bool_:
        np.array(array).astype(np.uint8).tofile(path)
    else:
        np.array(array).tofile(path)


def run_case(tmp, batch, length, heads, dim, dtype, padding, steps, fma_state, seed):
    """{"kernel": (y, state, history), "reference": (...), "stock_cpu": stock's gated_delta_ops on the CPU}."""
    from glm53_patches import registry

    from .verify import op_inputs

    args, mask = op_inputs(batch, length, heads, dim, seed, padding)
    if dtype == mx.float32:
        args = tuple(a.astype(mx.float32) for a in args)
    tmp = Path(tmp)
    paths = [tmp / f"in{i}" for i in range(7)] + [tmp / "out"]
    for array, path in zip(list(args) + [mask if mask is not None else mx.ones((batch, length), mx.bool_)], paths):
        _to_file(array, path)
    defines = "".join(f"constexpr {t} {name}_ = {value};\n" for t, name, value in (
        ("long", "B", batch), ("long", "T", length), ("int", "H", heads), ("int", "D", dim),
        ("int", "FMA_STATE", fma_state), ("bool", "HAS_MASK", "true" if mask is not None else "false"),
        ("int", "STEPS", steps or 0)))
    in_type = "bf16" if dtype == mx.bfloat16 else "float"
    source = PRELUDE + HOST_FUNCTIONS + defines + PROGRAM % {
        "source": kernel.CUDA_SOURCE, "InT": in_type, "GT": "float", "block": kernel.THREADS,
    }
    build_and_run(tmp, source, paths, timeout=300)
    raw = np.fromfile(paths[-1], dtype=np.uint8)
    n, ns = batch * length * heads * dim, batch * heads * dim * dim
    nh = batch * (steps or 1) * heads * dim * dim
    width = 2 if dtype == mx.bfloat16 else 4
    sizes = [width * n] * 2 + [4 * ns] * 2 + [4 * nh] * 2
    parts = np.split(raw, np.cumsum(sizes)[:-1])
    y_type = np.uint16 if width == 2 else np.float32

    def as_y(part):
        bits = part.view(y_type).reshape(batch, length, heads, dim)
        return np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32)) if width == 2 else bits

    history_shape = (batch, steps or 1, heads, dim, dim)
    found = {}
    for label, (y, state, history) in (("kernel", parts[0::2]), ("reference", parts[1::2])):
        found[label] = (as_y(y), state.view(np.float32).reshape(batch, heads, dim, dim),
                        history.view(np.float32).reshape(history_shape) if steps else None)
    stock = registry.upstream("mlx_vlm.models.gated_delta:gated_delta_ops")
    with mx.stream(mx.cpu):
        out = stock(*args, mask, steps)
        found["stock_cpu"] = tuple(np.array(o.astype(mx.float32)) for o in out) + ((None,) if not steps else ())
    return found


def cases():
    """(name, batch, tokens, heads, head dim, dtype, left padding, state_steps, FMA_STATE)."""
    yield "3 heads of 64, bf16, 37 tokens", 1, 37, 3, 64, mx.bfloat16, None, None, 1
    yield "2 heads of 128, bf16, padded batch of 3", 3, 21, 2, 128, mx.bfloat16, [0, 4, 13], None, 1
    yield "2 heads of 40 (lanes partly idle), float32, no fma", 2, 9, 2, 40, mx.float32, [0, 3], None, 0
    yield "1 head of 128, bf16, history of 5 of 6", 1, 6, 1, 128, mx.bfloat16, None, 5, 1
    yield "5 heads of 32, bf16, padded batch with history", 2, 4, 5, 32, mx.bfloat16, [2, 0], 3, 1


# The reference against stock's loop on the CPU, whose sums add in another order: y rounds to
# bf16 (0.4% steps), so a few ulps of it; a wrong mask, history or update is off by far more.
TOLERANCE = 2e-2


def off_stock(found):
    """The largest difference of the reference's y, state and history from stock's CPU loop, each over its scale."""
    worst = 0.0
    for ours, stock in zip(found["reference"], found["stock_cpu"]):
        if ours is not None:
            worst = max(worst, float(np.abs(ours - stock).max() / max(np.abs(stock).max(), 1e-30)))
    return worst


def bits_equal(a, b):
    return a is None and b is None or (a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def main():
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, *case) in enumerate(cases()):
            found = run_case(tmp, *case, seed=seed)
            problems = [f"{what} differs from the reference" for what, a, b in
                        zip(("y", "state", "history"), found["kernel"], found["reference"]) if not bits_equal(a, b)]
            drift = off_stock(found)
            if drift > TOLERANCE:
                problems.append(f"the reference is off stock's CPU loop by {drift:.2e} of scale")
            failed += bool(problems)
            print(f"{name}: {'FAIL: ' + '; '.join(problems) if problems else 'pass'} (reference vs CPU stock {drift:.1e})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""routed_experts' CUDA kernel, its source text unchanged, run on the host with g++: the matvec it computes.

There is no CUDA here, so only a GPU's ``verify`` says whether the kernel's
bits are ``gather_qmm``'s. This checks, on the CPU, what does not depend on
the hardware's arithmetic: which bytes, scales and biases each lane takes,
how the 4-bit weights are unpacked into the MMA's A operand, which input words
feed B, which accumulator is written where, the routes and their input
rows, and in a launch of two projections (a decode step's up and gate)
which blocks take which. ``glm53_patches.checks.host_emulation`` runs every warp as 32 threads;
the one ``mma.sync.m16n8k16.row.col`` is replaced by a stand-in with PTX's
fragment layout (each lane's registers gathered through a warp barrier, the
16 x 8 product summed in float in k order), and a bf16 operation is float
arithmetic rounded to bf16. So the outputs are compared with a float32 matvec
of the dequantized weights to bf16's tolerance, and an operand handed in the
wrong place (checked by one such edit) fails by far more. Needs g++.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches.checks.host_emulation import PRELUDE, build_and_run
from glm53_patches.patches.fused_kda_kernel.checks.host_check import _to_file
from glm53_patches.patches.routed_experts import kernel

STAND_INS = r"""
#define __device__
struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct __nv_bfloat162 { bf16 x, y; };  // x in the low 16 bits, as CUDA's
__nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {bf16(a), bf16(b)}; }
__nv_bfloat162 __bfloat162bfloat162(bf16 a) { return {a, a}; }
__nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {bf16(float(a.x) - float(b.x)), bf16(float(a.y) - float(b.y))};
}
__nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {bf16(std::fma(float(a.x), float(b.x), float(c.x))), bf16(std::fma(float(a.y), float(b.y), float(c.y)))};
}
bf16 __hfma(bf16 a, bf16 b, bf16 c) { return bf16(std::fma(float(a), float(b), float(c))); }
bf16 __uint2bfloat16_rn(unsigned v) { return bf16(float(v)); }
bf16 __ushort_as_bfloat16(unsigned short s) { bf16 r; r.bits = s; return r; }
unsigned short __bfloat16_as_ushort(bf16 b) { return b.bits; }
bf16 __float2bfloat16_rn(float f) { return bf16(f); }
void __syncwarp() { warp_sync(); }
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, PTX's fragment layout (g = lane / 4, t = lane % 4):
// A (16 x 16, rows): a0 row g, k 2t and 2t + 1; a1 row g + 8; a2 row g, k + 8; a3 row g + 8, k + 8.
// B (16 x 8, columns): b0 column g, k 2t and 2t + 1; b1 k + 8. C and D: row g (and g + 8), columns 2t, 2t + 1.
static uint32_t mma_a[1024][4], mma_b[1024][2];
static float mma_c[1024][4];
float half_of(uint32_t v, int k) { bf16 h; h.bits = uint16_t(k % 2 ? v >> 16 : v & 0xffff); return float(h); }
void mma_16816(float& d0, float& d1, float& d2, float& d3, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
               uint32_t b0, uint32_t b1) {
  const unsigned lane = threadIdx.x % 32, base = warp_base();
  const uint32_t a[4] = {a0, a1, a2, a3};
  const float c[4] = {d0, d1, d2, d3};
  for (int i = 0; i < 4; ++i) { mma_a[base + lane][i] = a[i]; mma_c[base + lane][i] = c[i]; }
  mma_b[base + lane][0] = b0;
  mma_b[base + lane][1] = b1;
  warp_sync();
  auto A = [&](int m, int k) { return half_of(mma_a[base + (m % 8) * 4 + (k % 8) / 2][(m >= 8) + 2 * (k >= 8)], k); };
  auto B = [&](int k, int n) { return half_of(mma_b[base + n * 4 + (k % 8) / 2][k >= 8], k); };
  auto C = [&](int m, int n) { return mma_c[base + (m % 8) * 4 + n / 2][2 * (m >= 8) + n % 2]; };
  auto D = [&](int m, int n) {
    float s = C(m, n);
    for (int k = 0; k < 16; ++k) s += A(m, k) * B(k, n);
    return s;
  };
  const int g = lane / 4, t = lane % 4;
  const float r0 = D(g, 2 * t), r1 = D(g, 2 * t + 1), r2 = D(g + 8, 2 * t), r3 = D(g + 8, 2 * t + 1);
  warp_sync();
  d0 = r0; d1 = r1; d2 = r2; d3 = r3;
}
"""

MMA = re.compile(r'asm volatile\("mma\.sync[^;]*;"\s*:\s*"\+f"\((.*?)\),\s*"\+f"\((.*?)\),\s*"\+f"\((.*?)\),\s*'
                 r'"\+f"\((.*?)\)\s*:\s*' + r',\s*'.join([r'"r"\((.*?)\)'] * 6) + r'\);', re.S)

PROGRAM = r"""
template <int K, int N, int PER_ROW, int WARPS, int AHEAD>
void body(const bf16* x, const uint32_t* idx, %(params)s) {
%(source)s
}

int main(int argc, char** argv) {
  constexpr int E = %(E)d, R = %(R)d, X = %(X)d, K = %(K)d, N = %(N)d, WARPS = %(WARPS)d, P = %(P)d;
  auto x = load<bf16>(argv[1], X * K);
  auto idx = load<uint32_t>(argv[2], R);
  std::vector<std::vector<uint32_t>> w;
  std::vector<std::vector<bf16>> scales, biases, out;
  for (int p = 0; p < P; ++p) {
    w.push_back(load<uint32_t>(argv[3 + 3 * p], E * N * K / 8));
    scales.push_back(load<bf16>(argv[4 + 3 * p], E * N * K / 64));
    biases.push_back(load<bf16>(argv[5 + 3 * p], E * N * K / 64));
    out.emplace_back(R * N, bf16(-7.0f));  // poison: every output must be written
  }
  constexpr unsigned GX = N / (%(ROWS)d * WARPS);
  run_blocks(GX * R * P, 32 * WARPS, [&] {
    const unsigned b = blockIdx.x;
    blockIdx = {b %% GX, (b / GX) %% R, b / (GX * R)};
    body<K, N, R / X, WARPS, %(AHEAD)d>(x.data(), idx.data(), %(args)s);
  });
  FILE* f = std::fopen(argv[3 + 3 * P], "wb");
  for (int p = 0; p < P; ++p) std::fwrite(out[p].data(), 2, out[p].size(), f);
  std::fclose(f);
  return 0;
}
"""


def host_source(source):
    """The kernel text with its one MMA statement as a call of the stand-in (fails if the text moved)."""
    host, count = MMA.subn(lambda m: "mma_16816(" + ", ".join(m.groups()) + ");", source)
    assert count == 1, "the kernel's mma.sync statement is not where this check expects it"
    return host


def run(tmp, x, idx, projections, source=None, warps=kernel.WARPS, ahead=kernel.AHEAD):
    """The kernel's outputs (``[R, N]`` float32, one per projection), run on the host."""
    (rows, k), routes, (experts, n) = x.shape, idx.shape[0], projections[0][0].shape[:2]
    count = len(projections)
    arrays = [x, idx, *(a for projection in projections for a in projection)]
    paths = [tmp / f"in{i}" for i in range(len(arrays))] + [tmp / "out"]
    for array, path in zip(arrays, paths):
        _to_file(array, path)
    params = [f"const uint32_t* w{p}, const bf16* scales{p}, const bf16* biases{p}" for p in range(count)]
    args = [f"w[{p}].data(), scales[{p}].data(), biases[{p}].data()" for p in range(count)]
    program = PRELUDE + STAND_INS + PROGRAM % {
        "source": host_source(source or kernel.cuda_source(count)), "E": experts, "R": routes, "X": rows, "K": k,
        "N": n, "WARPS": warps, "AHEAD": ahead, "ROWS": kernel.ROWS, "P": count,
        "params": ", ".join(params + [f"bf16* out{p}" for p in range(count)]),
        "args": ", ".join(args + [f"out[{p}].data()" for p in range(count)])}
    build_and_run(tmp, program, paths, timeout=120)
    bits = np.fromfile(paths[-1], dtype=np.uint16)
    return list(np.array(mx.array(bits).view(mx.bfloat16).astype(mx.float32)).reshape(count, routes, n))


def case(rows, routes, n=256, k=512, experts=16, seed=0, count=1):
    """Random 4-bit experts (``count`` projections of them), inputs and routes (distinct experts per 8), and
    each projection's float32 reference."""
    keys = mx.random.split(mx.random.key(seed), 2 + count)
    x = mx.random.normal((rows, k), key=keys[0]).astype(mx.bfloat16)
    picks = mx.argsort(mx.random.uniform(shape=(routes // 8, experts), key=keys[1]), axis=-1)[:, :8]
    idx = picks.reshape(-1).astype(mx.uint32)
    xs = np.repeat(np.array(x.astype(mx.float32)), routes // rows, axis=0)
    projections, expected = [], []
    for key in keys[2:]:
        weight = (mx.random.normal((experts, n, k), key=key) * k**-0.5).astype(mx.bfloat16)
        w, scales, biases = mx.quantize(weight, group_size=64, bits=4)
        dense = np.array(mx.dequantize(w, scales, biases, group_size=64, bits=4).astype(mx.float32))
        projections.append((w, scales, biases))
        expected.append(np.einsum("rnk,rk->rn", dense[np.array(idx)], xs))
    return (x, idx, projections), expected


def error(actual, expected):
    """The largest difference over the projections, relative to each one's largest output."""
    assert not any(np.any(a == -7.0) for a in actual), "an output was never written"
    return max(float(np.max(np.abs(a - e)) / np.max(np.abs(e))) for a, e in zip(actual, expected))


@pytest.mark.parametrize("rows, routes, settings, count", [
    (1, 8, {}, 1),                            # a decode step: one input for the token's 8 routes
    (8, 8, {}, 1),                            # an input per route
    (2, 16, {"warps": 2, "ahead": 3}, 1),     # a verify block of 2: an input per position's 8
    (4, 32, {"ahead": 2}, 1),                 # a verify block of 4
    (1, 8, {}, 2),                            # a decode step's up and gate in one launch
    (2, 16, {"warps": 2}, 2),                 # batch 2's
])
def test_the_kernel_text_computes_each_routes_matvec(tmp_path, rows, routes, settings, count):
    args, expected = case(rows, routes, seed=rows + routes + count, count=count)
    assert error(run(tmp_path, *args, **settings), expected) < 2e-2  # bf16 output: about 4e-3


def test_an_operand_in_the_wrong_place_fails(tmp_path):
    """The check can fail: two of the MMA's weight registers swapped (k 0-7 and 8-15 of each chunk crossed)."""
    source = kernel.cuda_source(1)
    wrong = source.replace('"r"(a0), "r"(a1), "r"(a2), "r"(a3)', '"r"(a2), "r"(a1), "r"(a0), "r"(a3)')
    assert wrong != source
    args, expected = case(1, 8, seed=3)
    assert error(run(tmp_path, *args, source=wrong), expected) > 0.2


def test_a_launch_of_two_projections_writes_each_to_its_own_output(tmp_path):
    """The check can fail: each projection's blocks writing the other's output."""
    source = kernel.cuda_source(2)
    wrong = source.replace("out = blockIdx.z == 1 ? out1 : out0", "out = blockIdx.z == 1 ? out0 : out1")
    assert wrong != source
    args, expected = case(1, 8, seed=5, count=2)
    assert error(run(tmp_path, *args, source=wrong), expected) > 0.2

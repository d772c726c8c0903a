"""A CUDA quantized matvec with MLX's ``qmv`` arithmetic and more weight bytes in flight.

MLX 0.32's CUDA ``quantized_matmul`` takes its ``qmv`` kernel
(``mlx/backend/cuda/quantized/qmm/qmv.cu``) for affine weights when a call
has fewer than 8 rows (M * batch < 8): every decode projection. There, one
warp computes one output row: lane ``l`` owns the ``E`` consecutive columns
``E*l + 32*E*r`` of pass ``r`` (E = 16 for 4-bit and narrower weights under a
16-bit input, else 8) and, pass after pass, for each of its E columns

    w_dq = Array<T, E>(w) * T(scale) + bias            (cutlass, in T)
    sums[i] = fma(x[i], w_dq[i], sums[i])              (in T below 8 bits, in float at 8)

then ``sum = sums[0] + ... + sums[E-1]`` in float, ``cg::reduce`` over the
warp, and lane 0 writes ``T(sum)``. One pass keeps 8 bytes of weights per
lane in flight; the loop's trip count is a runtime value.

This kernel does the same arithmetic with the same cutlass functions
(``NumericArrayConverter``, ``Array`` operators, ``cutlass::fma``) in the same
order per row. What changes is only when bytes are loaded: K is a compile-time
constant and the passes are unrolled, so the compiler can issue several
passes' loads before their FMAs; ``AHEAD`` > 1 also loads that many passes'
weights, scales, biases and inputs explicitly before the first is used (the
default, 1, measured best on an H200). A warp may own ``RPW`` rows (each with
its own sums and its own reduce), which reads the input once for them.
Which row a warp owns, and how many warps a block has (``WARPS``), changes no
arithmetic.
"""

import mlx.core as mx

from glm53_patches.kernels.build import gpu_kernel

# The sub-byte widths MLX's qmv dispatches (mx.quantize's affine widths); 8 is uint8_t.
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)  # float32 inputs take qmv's plain-float branch: not mirrored here
# Launch shape, the best on an H200 for the 6-bit lm_head (PATCH.md); none of it changes a bit.
AHEAD = 1  # passes whose loads are issued before the first is used
WARPS = 4  # warps per block
RPW = 2  # rows per warp: they share the input's loads

HEADER = r"""
// MLX's default header has already defined CCCL's FP_* macros (under NVRTC), which cutlass's
// NVRTC enum then declares: drop them, cutlass defines the same values again.
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#include <cutlass/array.h>
#include <cutlass/functional.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>
#include <cooperative_groups/reduce.h>

namespace glm53_qmv {

template <typename U> struct Element;  // MLX's kernel-argument types -> the cutlass types qmv.cu uses
template <> struct Element<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct Element<__half> { using type = cutlass::half_t; };

template <int Bits> struct Quant { using type = cutlass::integer_subbyte<Bits, false>; };
template <> struct Quant<8> { using type = uint8_t; };

// N weights of Bits bits as one lane loads them for one pass. 2-, 4- and 8-bit: cutlass's array
// and converter, as qmv.cu reads them. 3-, 5- and 6-bit: MLX packs them densely, little-endian
// across bytes (cutlass's Array would put two 6-bit values in each 16 bits), so they are read as
// those bytes and unpacked. Either way each value is a small integer, exact in T.
template <int Bits, int N, bool Divides = (8 % Bits == 0)>
struct Weights {
  using Q = typename Quant<Bits>::type;
  cutlass::Array<Q, N> packed;
  __device__ __forceinline__ void load(const uint8_t* p) {
    packed = *reinterpret_cast<const cutlass::Array<Q, N>*>(p);
  }
  template <typename T>
  __device__ __forceinline__ cutlass::Array<T, N> values() const {
    cutlass::NumericArrayConverter<T, Q, N> to_t;
    return to_t(packed);
  }
};

template <int Bits, int N>
struct Weights<Bits, N, false> {
  static constexpr int BYTES = N * Bits / 8;  // 6 (3-bit x 16, 6-bit x 8) or 5 (5-bit x 8)
  uint64_t packed;
  __device__ __forceinline__ void load(const uint8_t* p) {
    packed = 0;
    if constexpr (BYTES % 2 == 0) {  // an even offset: lane and row offsets are multiples of 6
#pragma unroll
      for (int j = 0; j < BYTES / 2; ++j) {
        packed |= uint64_t(reinterpret_cast<const uint16_t*>(p)[j]) << (16 * j);
      }
    } else {
#pragma unroll
      for (int j = 0; j < BYTES; ++j) {
        packed |= uint64_t(p[j]) << (8 * j);
      }
    }
  }
  template <typename T>
  __device__ __forceinline__ cutlass::Array<T, N> values() const {
    cutlass::Array<T, N> out;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      out[i] = T(int((packed >> (i * Bits)) & ((1u << Bits) - 1)));
    }
    return out;
  }
};

// qmv.cu's dequant_fma after its conversion, the two overloads its sums select: T sums (below 8
// bits), float sums (8 bits).
template <int N, typename T>
__device__ __forceinline__ void dequant_fma(const cutlass::Array<T, N>& x, cutlass::Array<T, N> w_dq,
                                            T scale, T bias, T* sums) {
  w_dq = w_dq * T(scale) + bias;
  auto* out = reinterpret_cast<cutlass::Array<T, N>*>(sums);
  *out = cutlass::fma(x, w_dq, *out);
}

template <int N, typename T>
__device__ __forceinline__ void dequant_fma(const cutlass::Array<T, N>& x, cutlass::Array<T, N> w_dq,
                                            T scale, T bias, float* sums) {
  w_dq = w_dq * T(scale) + bias;
  cutlass::NumericArrayConverter<float, T, N> to_float;
  cutlass::Array<float, N> x_f = to_float(x);
  cutlass::Array<float, N> w_f = to_float(w_dq);
  auto* out = reinterpret_cast<cutlass::Array<float, N>*>(sums);
  *out = cutlass::fma(x_f, w_f, *out);
}

}  // namespace glm53_qmv
"""

# Template constants: T (the input dtype), BITS, GROUP, K, AHEAD, WARPS, RPW. N, the rows, is the scales' first dim.
SOURCE = r"""
  using TC = typename glm53_qmv::Element<T>::type;
  constexpr int E = (cutlass::sizeof_bits<TC>::value <= 16 && BITS <= 4) ? 16 : 8;  // qmv's elems_per_thread
  constexpr int PER_WARP = 32 * E;
  constexpr int PASSES = K / PER_WARP + (K % PER_WARP != 0);  // the last one partial: qmv's residue tile
  constexpr int ROW_BYTES = K * BITS / 8;
  using Acc = typename cutlass::platform::conditional<(BITS >= 8), float, TC>::type;  // qmv's sums
  using XVec = cutlass::Array<TC, E>;
  using WVec = glm53_qmv::Weights<BITS, E>;

  const int N = scales_shape[0];
  auto warp = cg::tiled_partition<32>(cg::this_thread_block());
  const int lane = warp.thread_rank();
  const int first_row = (blockIdx.x * WARPS + warp.meta_group_rank()) * RPW;
  if (first_row >= N) {
    return;
  }
  const int batch = blockIdx.y;
  const TC* xs = reinterpret_cast<const TC*>(x) + (size_t)batch * K;
  const uint8_t* wb = reinterpret_cast<const uint8_t*>(w);
  const TC* sc = reinterpret_cast<const TC*>(scales);
  const TC* bi = reinterpret_cast<const TC*>(biases);

  Acc sums[RPW][E] = {};

#pragma unroll
  for (int p0 = 0; p0 < PASSES; p0 += AHEAD) {
    XVec xv[AHEAD];
    WVec wv[AHEAD][RPW];
    TC s[AHEAD][RPW], b[AHEAD][RPW];
    bool live[AHEAD];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      const int idx = lane * E + (p0 + a) * PER_WARP;
      live[a] = p0 + a < PASSES && idx < K;
      if (live[a]) {
        xv[a] = *reinterpret_cast<const XVec*>(xs + idx);
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const int row = first_row + r < N ? first_row + r : N - 1;  // a spare row re-reads the last
          wv[a][r].load(wb + (size_t)row * ROW_BYTES + idx * BITS / 8);
          s[a][r] = sc[(size_t)row * (K / GROUP) + idx / GROUP];
          b[a][r] = bi[(size_t)row * (K / GROUP) + idx / GROUP];
        }
      }
    }
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (live[a]) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          glm53_qmv::dequant_fma<E>(xv[a], wv[a][r].template values<TC>(), s[a][r], b[a][r], sums[r]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    float sum{0};
#pragma unroll
    for (int i = 0; i < E; ++i) {
      sum += sums[r][i];
    }
    sum = cg::reduce(warp, sum, cg::plus<float>{});
    if (lane == 0 && first_row + r < N) {
      reinterpret_cast<TC*>(out)[(size_t)batch * N + first_row + r] = static_cast<TC>(sum);
    }
  }
"""

QMV = dict(name="glm53_exact_qmv", inputs=["x", "w", "scales", "biases"], outputs=["out"], cuda=(SOURCE, HEADER))


def qmv(x, w, scales, biases, bits, group_size, *, ahead=None, warps=None, rpw=None):
    """``mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)`` for ``x`` of
    ``[..., 1, K]`` rows (fewer than 8), as MLX's CUDA qmv computes it. ``ahead``, ``warps`` and
    ``rpw`` override the launch shape (benchmarks)."""
    ahead, warps, rpw = ahead or AHEAD, warps or WARPS, rpw or RPW
    K = x.shape[-1]
    N = w.shape[0]
    rows = x.size // K
    per_block = warps * rpw
    blocks = -(-N // per_block)
    out = gpu_kernel(backend="cuda", **QMV)(
        inputs=[x, w, scales, biases],
        template=[("T", x.dtype), ("BITS", bits), ("GROUP", group_size), ("K", K),
                  ("AHEAD", ahead), ("WARPS", warps), ("RPW", rpw)],
        grid=(blocks * warps * 32, rows, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)

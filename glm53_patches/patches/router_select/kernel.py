"""The MoE router's expert selection as one GPU launch: CUDA and Metal twins.

For every row (token) of router logits ``[R, E]`` (float32, after the gate
matmul) the kernel returns what mlx-vlm's ``_expert_select`` returns for one
expert group (``n_group == 1``)::

    scores = sigmoid(logits)
    indices = argpartition(-(scores + bias), kth=K - 1)[..., :K]   # int32
    weights = take_along_axis(scores, indices)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)    # if norm and K > 1
    weights = weights * routed_scaling_factor

Stock runs this as ~6 kernels (the compiled elementwise head, a full-row
sort standing in for argpartition, the int32 cast, the gather, the row sum,
the compiled tail). Here one warp (simdgroup) per row does it all:

* each lane computes the sigmoid and the negated choice score of experts
  ``lane, lane + 32, ...`` with MLX's own functors (CUDA: ``Sigmoid``,
  ``Add`` from ``mlx/backend/cuda/device/*_ops.cuh``), so the values are the
  ones stock's compiled kernel writes;
* ``K`` rounds of a warp arg-min pick the selection in the order of a stable
  ascending sort of ``-(scores + bias)``: smaller first, equal values by
  lower expert index, NaN last (MLX's ``LessThan``). That is the order of
  MLX's argpartition where it runs a stable merge sort (CUDA in MLX 0.32.x);
  ``ORDER 1`` emits the other order a radix-select partition would give
  (values strictly below the K-th first, then those equal to it, each group
  by expert index). Which one stock uses on a machine is what ``verify``
  establishes; the selected *set* is the same either way;
* the weight sum follows MLX's row reduction for a row of K float32 values
  (CUDA ``row_reduce_simple``: chunks of 4 summed from 0 in order, chunk sums
  combined by the warp tree); the divide and scale are the compiled tail's
  ``Divide``/``Multiply`` with the constants a compiled kernel reads
  (``compiled_constant``).

Metal: the same structure, mirroring MLX 0.32.4's Metal kernels for the
same ops: the compiled head's ``Sigmoid`` (``kernels/unary_ops.h``, with
``metal::precise::exp``: under the Safe math mode MLX sets for runtime-built
kernels on macOS 15, a bare ``metal::exp`` is the fast one), the Metal sort
that stands in for argpartition (``kernels/sort.h``, ``block_sort``: a stable
merge sort under ``LessThan``, NaN last), ``simd_shuffle_xor``, and the weight
sum as ``row_reduce_small``'s ``thread_reduce`` (``kernels/reduction/reduce_row.h``:
K values added in order from 0, ``SUMCHUNK == K``). The logits row keeps its
address space (``auto``): in MSL a pointer without one points into thread
memory. ``glm53_patches/checks/metal`` type-checks the source MLX
generates and runs it, emulated, against those stock texts; it has not run on
any Mac, and runs only where ``glm53-patches verify router_select`` passed there.
"""

import functools
from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import compiled_constant, gpu_kernel


LANES = 32
MAX_EXPERTS = 1024  # 32 experts per lane at most (the lane's taken-mask is 32 bits)
MAX_TOP_K = 32  # the weight sum's tree below covers 8 chunks of 4

# ORDER: 0 = stable sort order, 1 = radix-select order (see the module doc).
DEFAULT_ORDER = {"cuda": 0, "metal": 0}

CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""

# The body is shared by CUDA, Metal and the host check; RS_* macros are the
# backend's primitives. @LOGITS_ROW@ is the one declaration that differs: CUDA
# keeps main's text (the H200-verified kernel), Metal names no address space.
_SELECT_BODY = r"""
  // Template constants: E (experts), K (top-k), NORM, ORDER, SUMCHUNK.
  constexpr int PER = (E + 31) / 32;
  const unsigned row = RS_ROW;
  const int lane = (int)RS_LANE;
  @LOGITS_ROW@ lg = logits + (size_t)row * E;

  // Sigmoid and choice score of this lane's experts: stock's fused head.
  float score[PER];
  float key[PER];  // -(score + bias): the value argpartition orders
  unsigned taken = 0u;
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    if (e < E) {
      score[j] = RS_SIGMOID(lg[e]);
      key[j] = -RS_ADD(score[j], bias[e]);
    } else {
      score[j] = 0.0f;
      key[j] = 0.0f;
      taken |= 1u << j;
    }
  }

  // K rounds of a warp arg-min under MLX's LessThan (NaN last), ties by index.
  int sel[K];
  float sel_key[K];
  float sel_score[K];
  for (int k = 0; k < K; ++k) {
    float bv = 0.0f;
    int bi = E;  // E: nothing
    float bs = 0.0f;
    for (int j = 0; j < PER; ++j) {
      const int e = lane + 32 * j;
      if (!((taken >> j) & 1u) && expert_before(key[j], e, bv, bi, E)) {
        bv = key[j];
        bi = e;
        bs = score[j];
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = RS_SHFL_XOR(bv, off);
      const int oi = RS_SHFL_XOR(bi, off);
      const float os = RS_SHFL_XOR(bs, off);
      if (expert_before(ov, oi, bv, bi, E)) {
        bv = ov;
        bi = oi;
        bs = os;
      }
    }
    sel[k] = bi;
    sel_key[k] = bv;
    sel_score[k] = bs;
    if (bi < E && bi % 32 == lane) {
      taken |= 1u << (bi / 32);
    }
  }

  if (ORDER == 1) {
    // Radix-select order: keys strictly below the K-th key, then keys equal
    // to it; each group by expert index (insertion sort of K entries).
    const float pivot = sel_key[K - 1];
    for (int a = 1; a < K; ++a) {
      const int ia = sel[a];
      const float ka = sel_key[a];
      const float sa = sel_score[a];
      const int ga = (ka == pivot || (ka != ka && pivot != pivot)) ? 1 : 0;
      int b = a - 1;
      while (b >= 0) {
        const int gb = (sel_key[b] == pivot || (sel_key[b] != sel_key[b] && pivot != pivot)) ? 1 : 0;
        if (gb < ga || (gb == ga && sel[b] < ia)) {
          break;
        }
        sel[b + 1] = sel[b];
        sel_key[b + 1] = sel_key[b];
        sel_score[b + 1] = sel_score[b];
        --b;
      }
      sel[b + 1] = ia;
      sel_key[b + 1] = ka;
      sel_score[b + 1] = sa;
    }
  }

  // The weight sum as MLX's row reduction adds K float32 values: chunks of
  // SUMCHUNK summed in order from 0, chunk sums combined by a pairwise tree.
  float total = 0.0f;
  if (NORM && K > 1) {
    float part[32];
    for (int c = 0; c < 32; ++c) {
      float acc = 0.0f;
      for (int i = 0; i < SUMCHUNK; ++i) {
        const int k = c * SUMCHUNK + i;
        acc = acc + (k < K ? sel_score[k] : 0.0f);
      }
      part[c] = acc;
    }
    for (int off = 16; off > 0; off >>= 1) {
      for (int c = 0; c < off; ++c) {
        part[c] = part[c] + part[c + off];
      }
    }
    total = RS_ADD(part[0], consts[0]);
  }
  if (lane < K) {
    float w = sel_score[0];
    int idx = sel[0];
    for (int k = 1; k < K; ++k) {  // register arrays: no dynamic indexing
      if (k == lane) {
        w = sel_score[k];
        idx = sel[k];
      }
    }
    if (NORM && K > 1) {
      w = RS_DIVIDE(w, total);
    }
    indices[(size_t)row * K + lane] = idx;
    weights[(size_t)row * K + lane] = RS_MULTIPLY(w, consts[1]);
  }
"""

SELECT_BODY = _SELECT_BODY.replace("@LOGITS_ROW@", "const float*")  # CUDA and the host check
METAL_SELECT_BODY = _SELECT_BODY.replace("@LOGITS_ROW@", "auto")  # device, or constant below 8 elements

# a before b: MLX's LessThan on the keys (NaN sorts last), then the lower index.
BEFORE = r"""
RS_INLINE bool expert_before(float av, int ai, float bv, int bi, int none) {
  if (ai >= none) return false;
  if (bi >= none) return true;
  const bool an = av != av;
  const bool bn = bv != bv;
  if (an || bn) {
    if (an != bn) return bn;
    return ai < bi;
  }
  if (av < bv) return true;
  if (bv < av) return false;
  return ai < bi;
}
"""

CUDA_SOURCE = (
    r"""
#define RS_ROW blockIdx.x
#define RS_LANE threadIdx.x
#define RS_SIGMOID(x) Sigmoid{}(x)
#define RS_ADD(a, b) Add{}(a, b)
#define RS_DIVIDE(a, b) Divide{}(a, b)
#define RS_MULTIPLY(a, b) Multiply{}(a, b)
#define RS_SHFL_XOR(v, off) __shfl_xor_sync(0xffffffffu, v, off)
"""
    + SELECT_BODY
)

CUDA_HELPERS = "#define RS_INLINE __device__ __forceinline__\n" + BEFORE

METAL_HEADER = "#define RS_INLINE inline\n" + BEFORE

METAL_SOURCE = (
    r"""
#define RS_ROW threadgroup_position_in_grid.x
#define RS_LANE thread_position_in_threadgroup.x
#define RS_SIGMOID(x) metal_sigmoid(x)
#define RS_ADD(a, b) ((a) + (b))
#define RS_DIVIDE(a, b) ((a) / (b))
#define RS_MULTIPLY(a, b) ((a) * (b))
#define RS_SHFL_XOR(v, off) simd_shuffle_xor(v, (ushort)(off))
"""
    + METAL_SELECT_BODY
)

# MLX 0.32.4 mlx/backend/metal/kernels/unary_ops.h, struct Sigmoid, for T = float: the
# statements of stock's compiled head (precise::exp, as stock since MLX PR #4461).
METAL_SIGMOID = r"""
inline float metal_sigmoid(float x) {
  auto y = 1 / (1 + metal::precise::exp(metal::abs(x)));
  return (x < 0) ? y : 1 - y;
}
"""

KERNEL = dict(name="glm53_router_select", inputs=["logits", "bias", "consts"], outputs=["indices", "weights"],
              cuda=(CUDA_SOURCE, CUDA_HEADER + CUDA_HELPERS), metal=(METAL_SOURCE, METAL_HEADER + METAL_SIGMOID))


def unsupported(logits, bias, top_k, n_group, backend=None) -> Optional[str]:
    """Why the kernel does not cover this router call, or None when it does."""
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if n_group > 1:
        return "grouped routing"
    experts = logits.shape[-1]
    if not 1 <= experts <= MAX_EXPERTS or bias.shape != (experts,):
        return "expert count"
    if not 1 <= top_k <= min(MAX_TOP_K, experts):
        return "top_k"
    if logits.dtype != mx.float32 or bias.dtype != mx.float32:
        return "dtype"
    if logits.size == 0:
        return "empty"
    return None


@functools.lru_cache(maxsize=8)
def _constants(routed_scaling_factor):
    """[1e-20, routed_scaling_factor] as stock's compiled tail reads them (made once, outside any trace)."""
    return mx.array([compiled_constant(1e-20), compiled_constant(routed_scaling_factor)], dtype=mx.float32)


def router_select(logits, bias, top_k, norm_topk_prob, routed_scaling_factor, *, backend=None, order=None):
    """``(indices int32, weights float32)`` shaped ``logits.shape[:-1] + (top_k,)``; check ``unsupported`` first."""
    backend = gpu_backend() if backend is None else backend
    order = DEFAULT_ORDER[backend] if order is None else order
    experts = logits.shape[-1]
    rows = logits.size // experts
    consts = _constants(float(routed_scaling_factor))
    out_shape = (*logits.shape[:-1], top_k)
    return gpu_kernel(backend=backend, **KERNEL)(
        inputs=[logits, bias, consts],
        template=[
            ("E", experts),
            ("K", top_k),
            ("NORM", bool(norm_topk_prob)),
            ("ORDER", int(order)),
            ("SUMCHUNK", 4 if backend == "cuda" else top_k),
        ],
        grid=(rows * LANES, 1, 1),
        threadgroup=(LANES, 1, 1),
        output_shapes=[out_shape, out_shape],
        output_dtypes=[mx.int32, mx.float32],
    )

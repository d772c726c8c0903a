"""The MoE output combine as one GPU launch: CUDA and Metal twins.

Stock (``SwitchGLU._combine`` with no residual) turns the routed experts'
outputs ``routed [R, K, H]``, their weights ``[R, K]`` (float32) and the
shared expert's output ``shared [R, H]`` into ::

    out = (routed * weights[..., None].astype(routed.dtype)).sum(axis=-2) + shared

as four kernels: the cast, the multiply, a column sum over K, the add. Here
one thread per output element does the same arithmetic in the same types:

CUDA: stock's eager kernels round every step to the model dtype, and MLX's
CUDA ``col_reduce_small`` (K <= 32, rows of a multiple of 16 bytes) adds the
K products in order into an accumulator *of the model dtype* (bf16 sums
accumulate in bf16), starting from 0. The body does exactly that, in float
with a cast to the model dtype after each step, and with ``__fmul_rn`` /
``__fadd_rn``: written with MLX's ``Multiply``/``Add`` functors, NVRTC fused
``acc + r * w`` into one fma and a third of the outputs differed on the H200.

Metal: stock's kernels there are MLX 0.32.4's ``copy`` (the weights' cast),
the binary ``Multiply`` and ``Add`` (``kernels/binary_ops.h``) and, for the sum
over K < 32 rows, ``col_reduce_small`` (``kernels/reduction/reduce_col.h``,
instantiated by ``reduce.metal`` with the model dtype as accumulator; its
dispatch, ``strided_reduce_small`` in ``backend/metal/reduce.cpp``, gives it
``min(8, K)`` threads per column). Thread ``j`` sums rows ``j, j + 8, ...``
in the model dtype from 0, then thread 0 adds the others' sums in order, each
add rounded to the model dtype. The body does the same. Inputs under 8
elements arrive in the ``constant`` address space (MLX's
``max_constant_array_size``), so its pointers keep the inputs' address space
(``auto``). ``glm53_patches/checks/metal`` type-checks the source MLX
generates and runs it, emulated, against ``col_reduce_small``'s own text; it
has not run on any Mac, and runs only where ``glm53-patches verify
expert_combine`` passed there.
"""

from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernels.build import gpu_kernel


THREADS = 256
MAX_K = 32  # col_reduce_small covers reductions of at most 32 rows
MAX_K_METAL = 31  # Metal's col_reduce_small: fewer than 32 rows (strided_reduce_general_dispatch)
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

CUDA_HEADER = r"""
#include "mlx/backend/cuda/device/cast_op.cuh"
"""

CUDA_SOURCE = r"""
  // Template constants: T (model dtype), K, H.
  // Each step is rounded to T as the eager kernels round it; __fmul_rn /
  // __fadd_rn keep NVRTC from contracting product and sum into one fma.
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t total = (size_t)sizes[0] * H;
  if (i >= total) {
    return;
  }
  const size_t row = i / H;
  const size_t h = i - row * H;
  const T* r = routed + row * K * H + h;
  const float* w = weights + row * K;
  float acc = 0.0f;  // ReduceInit<Sum, T>; holds a value of T throughout
  for (int k = 0; k < K; ++k) {
    const float wk = static_cast<float>(cast_to<T>(w[k]));
    const float p = static_cast<float>(cast_to<T>(__fmul_rn(static_cast<float>(r[(size_t)k * H]), wk)));
    acc = static_cast<float>(cast_to<T>(__fadd_rn(acc, p)));
  }
  out[i] = cast_to<T>(__fadd_rn(acc, static_cast<float>(shared[i])));
"""

METAL_SOURCE = r"""
  // Template constants: T (model dtype), K, H. Mirrors MLX's Metal kernels:
  // copy (astype), Multiply, col_reduce_small with U = T, Add.
  const ulong i = thread_position_in_grid.x;
  const ulong total = (ulong)sizes[0] * H;
  if (i >= total) {
    return;
  }
  const ulong row = i / H;
  const ulong h = i - row * H;
  auto r = routed + row * K * H + h;  // auto: device, or constant under 8 elements
  auto w = weights + row * K;
  // col_reduce_small: LY = min(8, K) threads per column, thread j over rows j, j + LY, ...
  constexpr int LY = K < 8 ? K : 8;
  T totals[LY];
  for (int j = 0; j < LY; ++j) {
    totals[j] = T(0);  // Sum<T>::init
    for (int k = j; k < K; k += LY) {
      const T p = r[(ulong)k * H] * static_cast<T>(w[k]);  // the eager cast and Multiply
      totals[j] = p + totals[j];  // op(cast_to<U>(row[i]), totals[i])
    }
  }
  T acc = totals[0];  // thread 0 then adds the others' sums, in order
  for (int j = 1; j < LY; ++j) {
    acc = totals[j] + acc;
  }
  out[i] = acc + shared[i];  // Add
"""

KERNEL = dict(name="glm53_expert_combine", inputs=["routed", "weights", "shared", "sizes"], outputs=["out"],
              cuda=(CUDA_SOURCE, CUDA_HEADER), metal=(METAL_SOURCE, ""))


def unsupported(routed, weights, shared, backend=None) -> Optional[str]:
    """Why the kernel does not cover this combine, or None when it does."""
    backend = gpu_backend() if backend is None else backend
    if backend not in ("cuda", "metal"):
        return "no GPU backend"
    if routed.ndim < 2 or routed.dtype not in _FLOATS or shared is None or shared.dtype != routed.dtype:
        return "dtype"
    *lead, k, hidden = routed.shape
    if weights is None or weights.shape != (*lead, k) or weights.dtype != mx.float32:
        return "weights"
    if shared.shape != (*lead, hidden):
        return "shape"
    if not 1 <= k <= (MAX_K_METAL if backend == "metal" else MAX_K) or hidden * routed.dtype.size % 16:
        return "not col_reduce_small's case"  # stock would sum in another order
    if routed.size == 0:
        return "empty"
    return None


def expert_combine(routed, weights, shared, *, backend=None):
    """``(routed * weights[..., None]).sum(-2) + shared`` in stock's rounding; check ``unsupported`` first."""
    backend = gpu_backend() if backend is None else backend
    *lead, k, hidden = routed.shape
    rows = routed.size // (k * hidden)
    total = rows * hidden
    return gpu_kernel(backend=backend, **KERNEL)(
        inputs=[routed, weights, shared, mx.array([rows], dtype=mx.int64)],
        template=[("T", routed.dtype), ("K", k), ("H", hidden)],
        grid=(-(-total // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, hidden)],
        output_dtypes=[routed.dtype],
    )[0]

"""A short block's dense matvecs as one batched gemv on CUDA, each position's bits those of its own call.

At batch 1 a speculative verify block (2 to 8 positions) computes some dense
float projections one position at a time, so that each position's result is
a decode step's (mlx-vlm's ``tokenwise``: a slice, ``mx.contiguous``, a
one-row matmul, then one ``concatenate``): the hyper-connections' mix
(``HyperConnection._mix``) and the MoE router's logits (``MoEGate``). On
CUDA that is 2L + 1 launches and as many primitives for the calling thread
to encode, per call.

MLX 0.32's CUDA ``Matmul`` (``mlx/backend/cuda/matmul.cpp``, ml-explore/mlx
846d176) runs a one-row ``x_i @ w.T`` (M = 1, ``w.T`` a transposed view) as
``gemv_single`` with ``w`` as the matrix and ``x_i`` as the vector. Written
as ``w[None] @ x.reshape(L, K, 1)`` the same products become one
``gemv_batched`` (N = 1, ``w`` broadcast over the batch, so the batches are
not folded into M and no GEMM is chosen), and both kernels compute every
output with the same ``gemv_impl``: a warp per output row, each lane's
strided partial sum, one warp reduce. The vector width per lane
(``n_per_thread``) depends on K and on the alignment of the two base
pointers, the same for a fresh contiguous slice and a fresh block. So each
position gets its own call's bits, in one launch. That is read from MLX's
source, not promised by it: the patches using this run it only on CUDA,
where their ``verify`` compares it with stock's path (and
``benchmarks/h200/probe_rowwise.py`` found it bit-identical at every block
length and shape they use, on an H100); elsewhere (the CPU's BLAS, Metal)
stock's ``tokenwise`` runs. ``glm53-patches stage`` copies these functions
into each patch's pull request (the shared helpers' rule).
"""

from mlx_vlm.models.linear import DECODE_BLOCK_SIZE  # longer blocks take stock's tiled prefill path


def block_on_cuda(x, backend) -> bool:
    """Does stock compute ``x @ w.T`` (``x`` ``[1, L, K]``) position by position on ``backend``, and
    does ``block_matvecs`` give the same bits? A CUDA block at batch 1 of 2 to 8 positions."""
    return backend == "cuda" and x.ndim == 3 and x.shape[0] == 1 and 1 < x.shape[1] <= DECODE_BLOCK_SIZE


def block_matvecs(x, w):
    """``x @ w.T`` for ``x`` ``[1, L, K]`` and ``w`` ``[N, K]``, each position as its own one-row call
    computes it on CUDA: ``[1, L, N]``."""
    _, length, k = x.shape
    return (w[None] @ x.reshape(length, k, 1)).reshape(1, length, w.shape[0])

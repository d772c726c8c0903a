"""The replacement for ``language._sparse_prefill_attention`` on CUDA: stock's loop without the key gathers.

Stock's loop (off Metal), per chunk of ``chunk_size`` (16) queries: gather K
and V for every head, SDPA with the validity mask, which on CUDA is MLX's
unfused fallback. Here, for the same chunks:

* the scores come from ``kernel.scores``, for up to ``BLOCK_ELEMENTS`` of
  them per launch, from K where it lies (stock writes and reads a gathered
  copy: 1 GB per chunk at GLM-5.3-Flash's sizes);
* the scale is stock's ``array(scale, dtype) * q``; the softmax, the value
  gather (``kernel.gathered_values``, a copy) and ``matmul(p, v)`` are
  stock's ops on stock's shapes, chunk by chunk, so cuBLAS picks what it
  picks for stock.

Where the kernel does not run (not CUDA, not verified here, other shapes or
dtypes) stock's function runs, counted by reason.
"""

import functools
from typing import Optional

import mlx.core as mx

from glm53_patches.backend import gpu_backend
from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from . import kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name, backends=("cuda",))
BLOCK_ELEMENTS = 2**27  # scores per launch (256 MB in bf16): bounds the block's memory, not its bits
INT32_MAX = 2**31 - 1


def unsupported(q, k, v, indices, chunk_size) -> Optional[str]:
    """Why the kernels do not cover this call, or None."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or indices.ndim != 3:
        return "shape"
    B, H, L, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or indices.shape[:2] != (B, L):
        return "shape"  # grouped heads too: stock's SDPA repeats them, the kernel does not
    if L == 0 or k.shape[2] == 0 or indices.shape[-1] == 0 or chunk_size < 1:
        return "shape"
    if q.dtype not in kernel._FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype"  # mixed dtypes: stock's SDPA promotes first
    if indices.dtype != mx.int32:
        return "index dtype"
    if B * H * k.shape[2] * max(D, v.shape[-1]) > INT32_MAX:
        return "index range"  # stock's flat int32 rows would overflow
    return None


def attention(q, k, v, indices, scale, chunk_size=16):
    """Stock's off-Metal result for ``_sparse_prefill_attention(q, k, v, indices, scale, chunk_size)``."""
    B, H, L, D = q.shape
    Dv, K = v.shape[-1], indices.shape[-1]
    k, v = mx.contiguous(k), mx.contiguous(v)  # once per call; stock copies strided views per chunk
    qs = mx.array(scale, dtype=mx.float32).astype(q.dtype) * q  # stock's fallback: scale in q's dtype, times q
    block = max(1, BLOCK_ELEMENTS // (B * H * K * chunk_size)) * chunk_size  # whole chunks per launch
    outputs = []
    for start in range(0, L, block):
        end = min(start + block, L)
        scores = kernel.scores(qs[:, :, start:end], k, indices[:, start:end])
        for first in range(start, end, chunk_size):
            last = min(first + chunk_size, end)
            rows = B * (last - first)
            chunk = scores[:, first - start:last - start].reshape(rows, H, 1, K)
            probs = mx.softmax(chunk, axis=-1, precise=True)
            values = kernel.gathered_values(v, indices[:, first:last])
            out = probs @ values
            outputs.append(out.reshape(B, last - first, H, Dv).transpose(0, 2, 1, 3))
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def prefill_attention(q, k, v, indices, scale, chunk_size=16):
    """The kernels' result, or None (nothing built) where stock must run."""
    if gpu_backend() != "cuda":
        stats.fallback("not CUDA")
        return None
    if not switch.wanted("cuda"):
        stats.fallback("kernel off (not verified here)")
        return None
    reason = unsupported(q, k, v, indices, chunk_size)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit("kernel")
    return attention(q, k, v, indices, scale, chunk_size)


def make_sparse_prefill(original):
    """The replacement for ``language._sparse_prefill_attention``."""

    @functools.wraps(original)
    def _sparse_prefill_attention(q, k, v, indices, scale, chunk_size=16, use_kernel=True):
        out = prefill_attention(q, k, v, indices, scale, chunk_size)
        if out is None:
            return original(q, k, v, indices, scale, chunk_size=chunk_size, use_kernel=use_kernel)
        return out

    return _sparse_prefill_attention


def clear():
    switch.clear()

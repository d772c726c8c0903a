"""DSA sparse prefill attention off Metal: one gather per chunk, chunks sized from the shapes.

Stock ``_sparse_prefill_attention`` runs, where its Metal kernel is missing
(CPU, CUDA), a Python loop over 16-query chunks: per chunk it builds flat
per-head indices, gathers the selected keys and values into fused-SDPA
layout ``[B*chunk, H, topk, D]`` and calls ``mx.fast.scaled_dot_product_attention``
with one query per batch row. At GLM-5.3-Flash's sizes (64 heads x 256 dims x
2063 selected keys) a 2,048-token prefill chunk is 128 iterations.

Here the same attention runs with:

- the query chunk derived from the shapes: the most query rows whose
  gathered K (or V) stays within an element budget, at most 2^31 - 1
  (``MAX_ELEMENTS``, no intermediate needs 64-bit element counts): 63
  queries at GLM-5.3-Flash's sizes. That is the default on a GPU; on the
  CPU, where the chunk size does not change the speed, it is 2^29 (15
  queries) to save memory. GLM53_GATHERED_PREFILL_MAX_ELEMENTS sets it.
  Chunks are balanced (512 queries: 9 x 57, not 8 x 63 + 8);
- per chunk, one ``mx.take(..., axis=0)`` per tensor on the flat
  ``[B*H*N, D]`` layout. The flat K/V and the head/batch offsets are built
  once per call. Stock reshapes K and V in every chunk, and when they are
  the projected cache's ``keys[..., :offset, :]`` views (strided unless the
  offset fills the 256-step buffer) each reshape is a full copy;
- each chunk's gather ordered after the previous chunk's attention
  (``mx.depends``), so that memory stays bounded by a few chunks however
  long the prefill chunk is;
- the very same SDPA call over the very same gathered values, masks and
  order. Chunking only splits the query/batch axis, which SDPA treats as
  independent batch rows, so the output is bit-identical to stock.

Anything else (Metal, contexts under GLM53_GATHERED_PREFILL_MIN_CONTEXT keys,
unexpected shapes) calls the original.
"""

import functools

import mlx.core as mx

from glm53_patches import config
from glm53_patches.backend import gpu_backend

from . import PATCH

stats = PATCH.stats

NAME = "gathered_prefill"
# No gathered K/V (and no other intermediate) may exceed this many elements.
MAX_ELEMENTS = 2**31 - 1
# On the CPU the chunk size does not change the speed (measured), only the
# memory (about three chunks of gathered K and V are alive at once), so the
# CPU default budget is 2^29 elements: 15 queries per chunk at GLM-5.3-Flash's
# sizes, about 2 GB of bf16 K+V per chunk.
CPU_ELEMENTS = 2**29
# Flat row numbers b*H*N + h*N + n are int32, as in stock.
INDEX_LIMIT = 2**31 - 1
# Below this many keys (context length) the stock loop runs. 0: measured on
# the CPU, the patch was never slower at any context (1k..16k keys), and the
# memory it saves grows with the query count, not the context (measured).
# On CUDA stock was faster (H200, one DSA layer's prefill: 0.85x at 4k keys,
# 0.83x at 16k), so there the gate stays closed unless the variable is set.
DEFAULT_MIN_CONTEXT = 0
CUDA_MIN_CONTEXT = 2**62  # never


def default_min_context():
    return CUDA_MIN_CONTEXT if gpu_backend() == "cuda" else DEFAULT_MIN_CONTEXT

def min_context():
    """GLM53_GATHERED_PREFILL_MIN_CONTEXT: keys below which stock runs (read per call)."""
    return config.knob_value(NAME, "min_context", PATCH.knobs["min_context"], default_min_context())


def element_budget():
    """GLM53_GATHERED_PREFILL_MAX_ELEMENTS: elements per gathered K (or V) and chunk.

    Default on a GPU: 2^31 - 1 (4.3 GB per gathered tensor in bf16, twice
    that for K and V together); on the CPU: ``CPU_ELEMENTS``.
    """
    default = MAX_ELEMENTS if mx.default_device() == mx.gpu else min(CPU_ELEMENTS, MAX_ELEMENTS)
    return config.knob_value(NAME, "max_elements", PATCH.knobs["max_elements"], default)


def query_chunk(batch, q_heads, kv_heads, dim, v_dim, topk, max_elements=None):
    """Queries per chunk: the most whose largest intermediate stays <= max_elements.

    Per query row the chunk holds gathered keys ``kv_heads*topk*dim``, values
    ``kv_heads*topk*v_dim``, flat indices ``kv_heads*topk`` and scores
    ``q_heads*topk``. Returns 0 when one query per batch row is already too much.
    """
    max_elements = min(MAX_ELEMENTS, element_budget()) if max_elements is None else max_elements
    depth = max(kv_heads * topk * max(dim, v_dim), q_heads * topk)
    return max_elements // (depth * batch)


def balanced_chunk(q_length, most):
    """Split q_length into as few chunks of at most `most` as possible, evenly."""
    chunks = -(-q_length // min(q_length, most))
    return -(-q_length // chunks)


def _why_not(q, k, v, indices):
    """The reason to run stock code, or None."""
    if mx.metal.is_available():
        return "metal"  # stock's indexed_sparse_attention kernel (and its loop) untouched
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or indices.ndim != 3:
        return "shape"
    batch, q_heads, q_length, dim = q.shape
    kv_batch, kv_heads, kv_length, key_dim = k.shape
    if (
        kv_batch != batch
        or v.shape[:3] != k.shape[:3]
        or key_dim != dim
        or indices.shape[:2] != (batch, q_length)
        or q_heads % kv_heads != 0
        or indices.shape[-1] == 0
        or kv_length == 0
        or q_length == 0
    ):
        return "shape"
    if not mx.issubdtype(indices.dtype, mx.integer):
        return "dtype"
    if batch * kv_heads * kv_length > INDEX_LIMIT:
        return "index range"  # flat int32 offsets would overflow (as in stock)
    if kv_length < min_context():
        return "short context"
    if query_chunk(batch, q_heads, kv_heads, dim, v.shape[-1], indices.shape[-1]) < 1:
        return "row too large"
    return None


def gathered_attention(q, k, v, indices, scale, max_elements=None):
    """Stock's off-Metal sparse prefill attention with shape-derived query chunks."""
    batch, q_heads, q_length, dim = q.shape
    _, kv_heads, kv_length, _ = k.shape
    v_dim = v.shape[-1]
    topk = indices.shape[-1]
    chunk = balanced_chunk(q_length, query_chunk(batch, q_heads, kv_heads, dim, v_dim, topk, max_elements))

    # Flat [B*H*N, D] rows: row b*H*N + h*N + n. Built once (a copy when K/V
    # are strided cache views), not per chunk; offsets are stock's int32s.
    flat_k = k.reshape(batch * kv_heads * kv_length, dim)
    flat_v = v.reshape(batch * kv_heads * kv_length, v_dim)
    offsets = (mx.arange(batch) * kv_heads * kv_length)[:, None, None, None] + (
        mx.arange(kv_heads) * kv_length
    )[None, None, :, None]
    last = max(kv_length - 1, 0)
    outputs = []
    for start in range(0, q_length, chunk):
        end = min(start + chunk, q_length)
        rows = batch * (end - start)
        idx = indices[:, start:end]
        valid = (idx >= 0) & (idx < kv_length)
        rows_idx = (offsets + mx.clip(idx, 0, last)[:, :, None]).reshape(rows, kv_heads, topk)
        if outputs:
            # Gather after the previous chunk's attention is done. Stock's
            # lazy loop lets the scheduler run many chunks' gathers first, so
            # its peak memory grows with the query count; ordered like this,
            # about three chunks of K/V copies are alive at once (measured).
            # stop_gradient: no gradient may flow into gather indices.
            rows_idx = mx.stop_gradient(mx.depends(rows_idx, outputs[-1]))
        # The same [B*chunk, H, topk, D] tensors stock's _sparse_head_gather builds.
        selected_k = mx.take(flat_k, rows_idx, axis=0)
        selected_v = mx.take(flat_v, rows_idx, axis=0)
        chunk_q = q[:, :, start:end].transpose(0, 2, 1, 3).reshape(rows, q_heads, 1, dim)
        out = mx.fast.scaled_dot_product_attention(
            chunk_q,
            selected_k,
            selected_v,
            scale=scale,
            mask=valid.reshape(rows, 1, 1, topk),
        )
        outputs.append(out.reshape(batch, end - start, q_heads, v_dim).transpose(0, 2, 1, 3))
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def prefill_attention(q, k, v, indices, scale):
    """The gathered path; None, having built nothing, where the stock code must run."""
    reason = _why_not(q, k, v, indices)
    if reason is not None:
        stats.fallback(reason)
        return None
    stats.hit()
    return gathered_attention(q, k, v, indices, scale)


def make_sparse_prefill(original):
    """The replacement for ``language._sparse_prefill_attention``."""

    @functools.wraps(original)
    def _sparse_prefill_attention(q, k, v, indices, scale, chunk_size=16, use_kernel=True):
        # chunk_size only tiles memory in stock; results do not depend on it.
        out = prefill_attention(q, k, v, indices, scale)
        if out is None:
            return original(q, k, v, indices, scale, chunk_size=chunk_size, use_kernel=use_kernel)
        return out

    return _sparse_prefill_attention


def report():
    snapshot = stats.snapshot()
    return (
        f"min context {min_context()} keys, at most {element_budget()} elements per gathered K/V; "
        f"hits {snapshot['hits']}; fallbacks {snapshot['fallbacks']}"
    )

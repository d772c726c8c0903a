"""The DSA lightning-indexer pool score in one fused float32 computation.

Stock (``_score_index_keys`` + the mask in ``_exact_pool_select``)::

    scores = q.astype(f32) @ keys[:, None].astype(f32).swapaxes(-1, -2)  # [B, L, H, P]
    scores = mx.maximum(scores, 0)
    scores = (scores * (weights * scale)[..., None]).sum(axis=2)          # [B, L, P]
    scores = mx.where(candidates, scores, mx.finfo(mx.float32).min)

Here the same per-pool score is computed by

* on a CUDA or Metal GPU with GLM53_INDEXER_FP32_KERNEL=1: one custom kernel
  (``kernels.py``) that never materialises the ``[B, L, H, P]`` temporary nor
  float32 copies of q and keys, and applies the mask in the same launch;
* everywhere else: one ``mx.compile(shapeless=True)`` function with stock's
  ops in stock's order (relu and head weight fuse into one elementwise
  kernel, the mask rides along). On this CPU it is bit-identical to stock.

``weights * scale`` is computed outside, eagerly, exactly as stock does (a
Python float times the weights array), so its rounding is stock's.
"""

import functools

import mlx.core as mx

from glm53_patches import config

from . import PATCH, kernels

stats = PATCH.stats

_FLOATS = (mx.float32, mx.bfloat16, mx.float16)
_COMPILED = {}  # masked? -> mx.compile'd score function
_KERNEL = {}  # "wanted" -> the knob's value, read once per process (until revert)
_FORCED = [None]  # tests and quality.py: True/False overrides the knob
# Decode (1 query) and speculative-verify blocks; prefill chunks (512) stay on
# the matmul. A guess until measured on a GPU.
DEFAULT_MAX_QUERIES = 16


# -- CPU / any backend: one compiled function -----------------------------------------


def _scores(q, keys, ws):
    # Stock's ops, in stock's order and dtypes (see the module docstring).
    scores = q.astype(mx.float32) @ keys[:, None].astype(mx.float32).swapaxes(-1, -2)
    scores = mx.maximum(scores, 0)
    return (scores * ws[..., None]).sum(axis=2)


def _masked_scores(q, keys, ws, candidates, fill):
    # `fill` is an input, not a captured Python float: no constant gets printed
    # into generated kernel source (where older MLX kept only 7 digits).
    return mx.where(candidates, _scores(q, keys, ws), fill)


def _compiled(masked):
    fn = _COMPILED.get(masked)
    if fn is None:
        # shapeless: the pool count grows by one every kpool tokens, and a
        # trace per shape would pile up over a long context.
        fn = _COMPILED[masked] = mx.compile(_masked_scores if masked else _scores, shapeless=True)
    return fn


@functools.lru_cache(maxsize=1)
def _fill():
    return mx.array(mx.finfo(mx.float32).min, dtype=mx.float32)


# -- GPU kernel switch -------------------------------------------------------------------


def kernel_wanted():
    """GLM53_INDEXER_FP32_KERNEL (default off): use the CUDA/Metal kernel where there is one."""
    if _FORCED[0] is not None:
        return _FORCED[0]
    if "wanted" not in _KERNEL:
        _KERNEL["wanted"] = bool(config.knob_value("indexer_fp32", "kernel", PATCH.knobs["kernel"], False))
    return _KERNEL["wanted"]


def kernel_max_queries():
    """GLM53_INDEXER_FP32_KERNEL_MAX_QUERIES (default 16): longer chunks use the compiled path."""
    if "max_queries" not in _KERNEL:
        _KERNEL["max_queries"] = config.knob_value(
            "indexer_fp32", "kernel_max_queries", PATCH.knobs["kernel_max_queries"], DEFAULT_MAX_QUERIES)
    return _KERNEL["max_queries"]


# -- the fused score -------------------------------------------------------------------


def _why_not(q, keys, weights, candidates):
    """The reason to run stock code for these score inputs, or None."""
    if q is None or weights is None or q.ndim != 4 or keys.ndim != 3 or weights.ndim != 3:
        return "shape"
    batch, length, heads, dim = q.shape
    if keys.shape[0] != batch or keys.shape[2] != dim or weights.shape != (batch, length, heads):
        return "shape"  # stock would broadcast or raise; leave both to it
    if batch * length * heads * dim * keys.shape[1] == 0:
        return "empty"
    if q.dtype not in _FLOATS or keys.dtype not in _FLOATS or weights.dtype not in _FLOATS:
        return "dtype"
    if candidates is not None and (
        candidates.dtype != mx.bool_ or candidates.shape != (batch, length, keys.shape[1])
    ):
        return "mask"
    return None


def score(q, keys, weights, scale, candidates=None):
    """``[B, L, P]`` float32 pool scores, masked with ``candidates`` when given.

    Returns None, having built nothing, where stock code must run.
    """
    reason = _why_not(q, keys, weights, candidates)
    if reason is not None:
        stats.fallback(reason)
        return None
    ws = weights * scale  # stock's expression and rounding
    backend = kernels.gpu_backend() if kernel_wanted() else None
    if backend is not None:
        ws32 = ws.astype(mx.float32)  # no-op for the model's float32 weights
        reason = kernels.unsupported(q, keys, ws32, candidates, kernel_max_queries())
        if reason is None:
            stats.hit(f"kernel-{backend}")
            return kernels.scores(backend, q, keys, ws32, candidates)
        stats.fallback(reason)  # counted, then served by the compiled function
    stats.hit("compiled")
    if candidates is None:
        return _compiled(False)(q, keys, ws)
    return _compiled(True)(q, keys, ws, candidates, _fill())


def select(q, pool_keys, weights, pool_ends, pool_valid, query_positions, select_k, scale, chunk_size=512):
    """``_exact_pool_select`` with the masked score fused; None where stock must run.

    The loop is stock's (mlx-vlm 0.7.5-0.7.10; 0.7.1 lacks the
    ``stop_gradient``, which changes nothing in inference).
    """
    pool_count = pool_keys.shape[1]
    if q is None or select_k >= pool_count:
        stats.fallback("all pools")  # stock selects every pool without scoring
        return None
    batch = pool_valid.shape[0]
    query_length = query_positions.shape[0]
    if (
        query_positions.ndim != 1
        or pool_valid.shape != (batch, pool_count)
        or pool_ends.shape != (batch, pool_count)
        or q.ndim != 4
        or q.shape[:2] != (batch, query_length)
        or select_k < 1
        or chunk_size < 1
    ):
        stats.fallback("select shape")
        return None
    if _why_not(q, pool_keys, weights, None) is not None or pool_valid.dtype != mx.bool_:
        stats.fallback("select shape")  # so that `score` below cannot step aside
        return None
    selected_chunks = []
    valid_chunks = []
    for start in range(0, query_length, chunk_size):
        end = min(start + chunk_size, query_length)
        candidates = pool_valid[:, None] & (pool_ends[:, None] <= query_positions[None, start:end, None])
        scores = score(q[:, start:end], pool_keys, weights[:, start:end], scale, candidates)
        selected = mx.argpartition(-scores, kth=select_k - 1, axis=-1)[..., :select_k].astype(mx.int32)
        selected_chunks.append(selected)
        selected = mx.stop_gradient(selected)
        valid_chunks.append(mx.take_along_axis(candidates, selected, axis=-1))
    if len(selected_chunks) == 1:
        return selected_chunks[0], valid_chunks[0]
    return mx.concatenate(selected_chunks, axis=1), mx.concatenate(valid_chunks, axis=1)


# -- the replacements ----------------------------------------------------------------


def make_score(original):
    """The replacement for ``language._score_index_keys`` (also what dsa_decode calls)."""

    @functools.wraps(original)
    def _score_index_keys(q, keys, weights, scale):
        scores = score(q, keys, weights, scale)
        return original(q, keys, weights, scale) if scores is None else scores

    return _score_index_keys


def make_select(original):
    """The replacement for ``language._exact_pool_select``."""

    @functools.wraps(original)
    def _exact_pool_select(
        q, pool_keys, weights, pool_ends, pool_valid, query_positions, select_k, scale, chunk_size=512
    ):
        args = (q, pool_keys, weights, pool_ends, pool_valid, query_positions, select_k, scale, chunk_size)
        result = select(*args)
        return original(*args) if result is None else result

    return _exact_pool_select


def clear():
    """Drop the compiled functions, kernels and the knob's cached value."""
    _COMPILED.clear()
    _KERNEL.clear()
    _fill.cache_clear()
    kernels.clear()

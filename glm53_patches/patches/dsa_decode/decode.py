"""Single-token decode of the DSA layers: the indexer's bookkeeping and the latent gather.

Indexer (``decode_topk``).

For one new token stock ``Glm5NextIndexer.__call__`` builds, besides the pool
scores, a ``[B, pools, kpool]`` table of every key position (materialised,
broadcast and gathered from), a ``cumsum`` over the whole key-validity row to
count visible keys, and the first valid key twice: work and kernels that grow
with the context. For a decode token all of it is arithmetic:

- pool ``p`` holds keys ``first_key + p * kpool + [0, kpool)``;
- the token sits at the last position, so the visible count is ``sum(valid)``;
  in a short block (speculative verify blocks) position ``i`` is key
  ``kv_length - L + i`` and the block's validity is the row's last ``L``
  entries, so its visible count is ``sum(valid) - sum(block) + cumsum(block)[i]``.

The projections, cache updates, pool scores and ``argpartition`` are stock's
calls on stock's arrays, so the selected set is the same set; what follows
(restore chronological order, expand pools to key positions, pad, append the
tail) is integer-only and, once the pool count reaches ``topk // kpool``, has
fixed shapes: it runs as one ``mx.compile``d graph. Integers have no rounding,
so the result is bit-identical to stock on every backend.

Attention (``decode_attend``). Stock gathers the selected latent rows with
``take_along_axis`` and an index broadcast over the 512 latent channels: a
general gather of ``K * 512`` elements, each with its own index. The rows are
whole and contiguous, so a row gather on the flattened ``[B * T, 512]`` cache
copies the same values into the same layout (CPU, 16k keys: 19 ms -> 0.5 ms);
the query embedding, SDPA and output projection are stock's calls on them.
"""

import functools

import mlx.core as mx

from mlx_vlm.models.cache import BatchKVCache, KVCache
from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.kernel_switch import KernelSwitch

from . import PATCH
from . import select_kernel

stats = PATCH.stats
switch = KernelSwitch(PATCH.name)


def _expand_selection(selected, selected_valid, first_key, visible_count, tail_key_valid, pool_count, kv_length,
                      *, kpool, topk, tail_width):
    """Selected pools -> key positions, in stock's order: chronological, -1 slots last, then the tail.

    selected, selected_valid: [B, L, k] from argpartition, a row per query position; first_key: [B];
    visible_count: [B, L]; tail_key_valid: [B, L, tail_width] validity of the keys the tail would
    take; pool_count and kv_length are scalar arrays, so that a growing context reuses one compiled
    trace.
    """
    batch, length = selected.shape[:2]
    if selected.shape[-1]:
        order = mx.argsort(mx.where(selected_valid, selected, pool_count), axis=-1)
        selected = mx.take_along_axis(selected, order, axis=-1)
        selected_valid = mx.take_along_axis(selected_valid, order, axis=-1)
    safe = mx.clip(selected, 0, mx.maximum(pool_count - 1, 0))
    keys = first_key[:, None, None, None] + safe[..., None] * kpool + mx.arange(kpool)
    keys = mx.where(selected_valid[..., None], keys, -1).reshape(batch, length, -1)
    if keys.shape[-1] < topk:
        keys = mx.pad(keys, [(0, 0), (0, 0), (0, topk - keys.shape[-1])], constant_values=-1)
    if not tail_width:
        return keys.astype(mx.int32)
    tail_count = visible_count % kpool
    tail = (first_key[:, None] + visible_count - tail_count)[..., None] + mx.arange(tail_width)
    tail_valid = (mx.arange(tail_width) < tail_count[..., None]) & (tail < kv_length) & tail_key_valid
    tail = mx.where(tail_valid, tail, -1)
    return mx.concatenate([keys, tail], axis=-1).astype(mx.int32)


# One compiled expansion per (kpool, topk, tail width); inside it mx.compile
# keeps a trace per input shapes (batch size), and nothing in it grows with
# the context once the selection width is fixed at topk // kpool pools.
_compiled_expand = {}


def _expander(fixed_width, **static):
    if not fixed_width:
        return lambda *arrays: _expand_selection(*arrays, **static)
    key = tuple(sorted(static.items()))
    if key not in _compiled_expand:
        def expand(*arrays):
            return _expand_selection(*arrays, **static)
        _compiled_expand[key] = mx.compile(expand)
    return _compiled_expand[key]


def clear():
    _compiled_expand.clear()
    switch.clear()


def _select_pools(self, x, q_resid, pool_keys, candidates, select_k):
    """Stock ``_exact_pool_select`` for up to 8 queries (its one chunk): same calls, same arrays, same
    argpartition. ``candidates``: ``[B, L, pools]``."""
    batch, length, pool_count = candidates.shape
    if select_k == pool_count:
        selected = mx.broadcast_to(mx.arange(pool_count, dtype=mx.int32)[None, None], (batch, length, pool_count))
    else:
        q, weights = self._project_queries(x, q_resid)
        scores = _lang._score_index_keys(q, pool_keys, weights, self.softmax_scale)
        scores = mx.where(candidates, scores, mx.finfo(mx.float32).min)
        selected = mx.argpartition(-scores, kth=select_k - 1, axis=-1)[..., :select_k].astype(mx.int32)
    return selected, mx.take_along_axis(candidates, selected, axis=-1)


def kernel_wanted(backend):
    """GLM53_DSA_DECODE_KERNEL, else this backend's verify record (glm53_patches/kernel_switch.py)."""
    return switch.wanted(backend)


def _kernel_topk(self, x, q_resid, key_valid, query_valid, pool_keys, pool_cache, select_k, tail_width):
    """The selection after the cache updates in one launch (``select_kernel``); None where it does not run."""
    backend = select_kernel.gpu_backend()
    if not kernel_wanted(backend):
        return None
    batch, pool_count = pool_keys.shape[:2]
    length = x.shape[1]
    key_count = key_valid.shape[1]
    # The shape gate before any score work: where it declines (e.g. long
    # contexts), the compiled path builds the scores itself, once.
    reason = select_kernel.unsupported(pool_count, key_count, backend=backend)
    if reason is None:
        if select_k < pool_count:
            q, weights = self._project_queries(x, q_resid)
            scores = _lang._score_index_keys(q, pool_keys, weights, self.softmax_scale)  # [B, L, P]
        else:  # every pool is selected: stock computes no score
            scores = mx.zeros((batch, length, pool_count), dtype=mx.float32)
        reason = select_kernel.unsupported(pool_count, key_count, scores.dtype, backend)
    if reason is not None:  # any scores built above are never evaluated
        stats.fallback(f"kernel: {reason} (compiled path ran)")
        return None
    if isinstance(pool_cache.offset, mx.array):
        pool_limit = pool_cache.offset.astype(mx.int32)
    else:
        pool_limit = mx.full((batch,), pool_count, dtype=mx.int32)
    stats.hit("indexer kernel" if length == 1 else "indexer block kernel")
    return select_kernel.select_topk(
        scores, key_valid, pool_limit, query_valid, select_k,
        kpool=self.index_kpool, topk=self.index_topk, tail_width=tail_width, backend=backend,
    )


def decode_topk(self, x, q_resid, padding_mask=None, cache=None, pool_cache=None, offset=0):
    """``self(x, q_resid, ...)`` for a decode token or a short block (up to 8 tokens: speculative verify
    blocks); None, having touched nothing, elsewhere."""
    batch, length = x.shape[:2]
    if length > _lang.DECODE_BLOCK_SIZE or cache is None or pool_cache is None:
        stats.fallback("not decode" if length > _lang.DECODE_BLOCK_SIZE else "no cache")
        return None
    kpool = self.index_kpool

    # Stock's projections and cache updates, in stock's order.
    k, gate = self._project_keys(x)
    if padding_mask is None:
        query_valid = mx.ones((batch, length), dtype=mx.bool_)
    else:
        query_valid = padding_mask.astype(mx.bool_)
    valid_state, _ = cache.update_and_fetch(
        query_valid[:, None, :, None], mx.zeros((batch, 1, length, 0), dtype=mx.bool_)
    )
    key_valid = valid_state[:, 0, :, 0].astype(mx.bool_)
    ready_k, ready_gate, _ = pool_cache.accumulate_windows(k, gate.astype(k.dtype), offset)
    pool_keys = pool_cache.update_and_fetch(self._compress_pools(ready_k, ready_gate))

    kv_length = key_valid.shape[1]
    pool_count = pool_keys.shape[1]
    select_k = min(self.index_topk // kpool, pool_count)
    tail_width = kpool - 1 if self.always_select_tail and kpool > 1 else 0
    topk = _kernel_topk(self, x, q_resid, key_valid, query_valid, pool_keys, pool_cache, select_k, tail_width)
    if topk is not None:
        return topk

    first_key = mx.where(mx.any(key_valid, axis=-1), mx.argmax(key_valid.astype(mx.int32), axis=-1), kv_length)
    if isinstance(pool_cache.offset, mx.array):
        pool_valid = mx.arange(pool_count)[None] < pool_cache.offset[:, None]
    else:
        pool_valid = mx.ones((batch, pool_count), dtype=mx.bool_)
    # Pool p ends at key first_key + p * kpool + kpool - 1; position i of the block is key
    # kv_length - length + i (the last key for a decode token).
    pool_end = mx.clip(first_key[:, None] + mx.arange(pool_count) * kpool + (kpool - 1), 0, max(kv_length - 1, 0))
    if length == 1:
        candidates = (pool_valid & (pool_end <= kv_length - 1))[:, None]
    else:
        positions = kv_length - length + mx.arange(length)
        candidates = pool_valid[:, None] & (pool_end[:, None] <= positions[None, :, None])
    if pool_count:
        selected, selected_valid = _select_pools(self, x, q_resid, pool_keys, candidates, select_k)
    else:
        selected = selected_valid = mx.zeros((batch, length, 0), dtype=mx.int32)

    # The keys each position sees: all for a decode token; in a block, the block's own keys are the
    # last `length` (its validity just stored), so position i sees those before the block and the
    # block's valid keys up to i.
    visible_count = key_valid.astype(mx.int32).sum(axis=-1, keepdims=True)
    if length > 1:
        block_valid = query_valid.astype(mx.int32)
        visible_count = visible_count - block_valid.sum(axis=-1, keepdims=True) + mx.cumsum(block_valid, axis=-1)
    if tail_width:
        tail_count = visible_count % kpool
        tail = (first_key[:, None] + visible_count - tail_count)[..., None] + mx.arange(tail_width)
        safe_tail = mx.clip(tail, 0, max(kv_length - 1, 0)).reshape(batch, -1)
        tail_key_valid = mx.take_along_axis(key_valid, safe_tail, axis=-1).reshape(batch, length, tail_width)
    else:
        tail_key_valid = mx.zeros((batch, length, 0), dtype=mx.bool_)
    expand = _expander(
        select_k == self.index_topk // kpool,
        kpool=kpool, topk=self.index_topk, tail_width=tail_width,
    )
    topk = expand(selected, selected_valid.astype(mx.bool_), first_key, visible_count, tail_key_valid,
                  mx.array(pool_count), mx.array(kv_length))
    stats.hit("indexer" if length == 1 else "indexer block")
    return mx.where(query_valid[..., None], topk, -1).astype(mx.int32)


def select_rows(latent, topk):
    """The latent rows each position of ``topk`` attends to, ``[B, L, K, C]``, and their validity
    ``[B, L, K]``: what ``_attend`` gathers per position, in one row gather.

    Pure; layer_decode calls it between its compiled halves of a DSA layer.
    """
    batch, _, length, channels = latent.shape
    valid = (topk >= 0) & (topk < length)
    safe = mx.clip(topk, 0, max(length - 1, 0))
    rows = (safe + (mx.arange(batch) * length)[:, None, None]).reshape(-1)
    return latent.reshape(batch * length, channels)[rows].reshape(*topk.shape, channels), valid


def decode_attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only=False):
    """``self._attend(...)`` for a decode token or a short block (up to 8 tokens: speculative verify
    blocks); None, having touched nothing, elsewhere."""
    length = q.shape[2]
    if length > _lang.DECODE_BLOCK_SIZE or self.training:
        stats.fallback("not decode")
        return None
    if type(kv_cache) not in (KVCache, BatchKVCache) or not isinstance(latent, mx.array):
        stats.fallback("cache type")  # quantized latents attend through their own SDPA path
        return None
    batch = latent.shape[0]
    outputs = []
    # Stock attends a short block position by position, each over its own selected rows.
    for index in range(length - 1 if last_only else 0, length):
        selected, valid = select_rows(latent, topk[:, index : index + 1])
        query = self.embed_q(q[:, :, index : index + 1])
        output = _lang.scaled_dot_product_attention(
            query, selected, selected, cache=kv_cache, scale=self.scale, mask=valid[:, None]
        )
        output = self.unembed_out(output)
        if length > 1:
            mx.async_eval(output)  # as stock: each position is sent off as soon as it is built
        outputs.append(output)
    stats.hit("attend" if length == 1 else "block")
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)
    return out.transpose(0, 2, 1, 3).reshape(batch, len(outputs), -1), topk[:, -1:] if last_only else topk


def make_attend(original):
    """The replacement for ``Glm5NextAttention._attend``."""

    @functools.wraps(original)
    def _attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only=False):
        result = decode_attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only)
        if result is None:
            return original(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only)
        return result

    return _attend


def make_call(original):
    """The replacement for ``Glm5NextIndexer.__call__``."""

    @functools.wraps(original)
    def __call__(self, x, q_resid, padding_mask=None, cache=None, pool_cache=None, offset=0):
        topk = decode_topk(self, x, q_resid, padding_mask, cache, pool_cache, offset)
        if topk is None:
            return original(self, x, q_resid, padding_mask, cache, pool_cache, offset)
        return topk

    return __call__

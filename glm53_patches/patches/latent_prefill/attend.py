"""The prefill branch of ``Glm5NextAttention._attend``, in the latent space.

Stock prefill (more than ``DECODE_BLOCK_SIZE`` tokens) projects the whole
latent cache to per-head keys and values (``embed_q``/``unembed_out`` with
``transpose=False``) and, 16 queries at a time, gathers each query's selected
keys for every head: 64 heads x 2048 keys per query, through a Metal kernel on
Metal and generic gathers elsewhere. Stock decode instead absorbs the key
projection into the query and attends over the selected *latent* rows, which
all heads share, then projects the output. This runs decode's computation for
every prefill query at once, in one of two ways:

- dense (up to ``DENSE_KEYS_PER_SLOT`` keys per selected slot: 32,880 keys at
  the real widths): every query block attends over all latent rows, and the
  selection becomes a boolean mask. The scores are then matmuls over the whole
  cache instead of a gather per query, and the unselected keys weigh exactly 0;
- gathered (longer caches, where scoring every key would cost more than
  gathering): one row gather of the selected latent rows per block of queries,
  the queries folded into the batch, and the same SDPA decode makes.

Both call stock's SDPA and ``MultiLinear``. Mathematically the same attention
(the indexer selects each key at most once); rounded differently from stock
prefill, so numerics-changing.
"""

import functools

import mlx.core as mx
from mlx_vlm.models.cache import BatchKVCache, KVCache
from mlx_vlm.models.glm5_next import language as _lang

from glm53_patches.backend import gpu_backend

from . import PATCH

stats = PATCH.stats

# Gathered latent elements per block of queries (2^28: 512 MiB in bf16), so a
# block's selected rows stay far from 2^31 elements and from memory limits.
GATHER_ELEMENTS = 1 << 28
# The dense path scores every key: worth it while the cache holds at most this
# many keys per selected slot. Its score blocks hold at most DENSE_ELEMENTS.
DENSE_KEYS_PER_SLOT = 16
DENSE_ELEMENTS = 1 << 28


def _why_not(self, q, kv_cache, latent):
    if q.shape[2] <= _lang.DECODE_BLOCK_SIZE or self.training:
        return "decode path (short chunk)"
    if gpu_backend() == "metal":
        return "metal (stock has a fused kernel)"
    if (kv_cache is not None and type(kv_cache) not in (KVCache, BatchKVCache)) or not isinstance(latent, mx.array):
        return "cache type"  # quantized latents attend through their own SDPA path
    return None


def prefill_attend(self, q, latent, topk, kv_cache, last_only=False):
    """``self._attend(...)`` for a prefill chunk: (output [B, L, H * v_head_dim], topk)
    as stock returns them; None, having touched nothing, where stock must run."""
    reason = _why_not(self, q, kv_cache, latent)
    if reason is not None:
        stats.fallback(reason)
        return None
    if last_only:
        q, topk = q[:, :, -1:], topk[:, -1:]
    query = self.embed_q(q)  # absorbed: [B, H, L, kv_lora_rank]
    if latent.shape[2] <= DENSE_KEYS_PER_SLOT * topk.shape[-1]:
        out, path = _dense(self, query, latent, topk, kv_cache), "prefill (dense)"
    else:
        out, path = _gathered(self, query, latent, topk, kv_cache), "prefill (gathered)"
    stats.hit(path)
    return out, topk


def _dense(self, query, latent, topk, kv_cache):
    """All keys per query block, the selection as a mask: [B, L, H * v_head_dim]."""
    batch, heads, length, _ = query.shape
    keys = latent.shape[2]
    valid = (topk >= 0) & (topk < keys)
    # Set the selected columns; the invalid slots write to a spare last column.
    slots = mx.where(valid, topk, keys)
    mask = mx.put_along_axis(mx.zeros((batch, length, keys + 1), dtype=mx.bool_), slots,
                             mx.array(True), axis=-1)[..., :keys]
    # A row with nothing selected (a padded query) attends to key 0, as stock's
    # clipped gather makes it, instead of to the average of every key.
    empty = ~mx.any(valid, axis=-1, keepdims=True)
    mask = mask | (empty & (mx.arange(keys) == 0))
    block = max(1, min(length, DENSE_ELEMENTS // max(heads * keys, 1)))
    outputs = []
    for start in range(0, length, block):
        output = _lang.scaled_dot_product_attention(
            query[:, :, start:start + block], latent, latent, cache=kv_cache, scale=self.scale,
            mask=mask[:, None, start:start + block],
        )
        output = self.unembed_out(output)  # [B, H, Q, v_head_dim]
        outputs.append(output.transpose(0, 2, 1, 3).reshape(batch, output.shape[2], -1))
    return mx.concatenate(outputs, axis=1)


def _gathered(self, query, latent, topk, kv_cache):
    """Each query's selected latent rows, gathered per query block: [B, L, H * v_head_dim]."""
    batch, heads, length, _ = query.shape
    _, _, keys, channels = latent.shape
    width = topk.shape[-1]
    flat = latent.reshape(batch * keys, channels)
    block = max(1, min(length, GATHER_ELEMENTS // max(width * channels, 1)))
    outputs = []
    for start in range(0, length, block):
        index = topk[:, start:start + block]
        rows_in_block = index.shape[1]
        valid = (index >= 0) & (index < keys)
        rows = mx.clip(index, 0, max(keys - 1, 0)) + (mx.arange(batch) * keys)[:, None, None]
        selected = flat[rows.reshape(-1)].reshape(batch * rows_in_block, 1, width, channels)
        folded = query[:, :, start:start + block].transpose(0, 2, 1, 3)
        folded = folded.reshape(batch * rows_in_block, heads, 1, channels)
        output = _lang.scaled_dot_product_attention(
            folded, selected, selected, cache=kv_cache, scale=self.scale,
            mask=valid.reshape(batch * rows_in_block, 1, 1, width),
        )
        output = self.unembed_out(output)  # [B * Q, H, 1, v_head_dim]
        outputs.append(output.reshape(batch, rows_in_block, -1))
    return mx.concatenate(outputs, axis=1)


def make_attend(original):
    """The replacement for ``Glm5NextAttention._attend``."""

    @functools.wraps(original)
    def _attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only=False):
        result = prefill_attend(self, q, latent, topk, kv_cache, last_only)
        if result is None:
            return original(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only)
        return result

    return _attend

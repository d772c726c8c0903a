"""The prefill branch of ``Glm5NextAttention._attend``, in the latent space.

Stock prefill (more than ``DECODE_BLOCK_SIZE`` tokens) projects the whole
latent cache to per-head keys and values (``embed_q``/``unembed_out`` with
``transpose=False``) and, 16 queries at a time, gathers each query's selected
keys for every head: 64 heads x 2048 keys per query, through a Metal kernel on
Metal and generic gathers elsewhere. Stock decode instead absorbs the key
projection into the query and attends over the selected *latent* rows, which
all heads share, then projects the output. This runs decode's computation for
every prefill query at once: one row gather of the selected latent rows per
block of queries, the queries folded into the batch, and the same SDPA and
``MultiLinear`` calls decode makes. Mathematically the same attention;
rounded differently from stock prefill, so numerics-changing.
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
    batch, heads, length, _ = q.shape
    _, _, keys, channels = latent.shape
    width = topk.shape[-1]
    flat = latent.reshape(batch * keys, channels)
    query = self.embed_q(q)  # absorbed: [B, H, L, kv_lora_rank]
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
    stats.hit("prefill")
    return mx.concatenate(outputs, axis=1), topk


def make_attend(original):
    """The replacement for ``Glm5NextAttention._attend``."""

    @functools.wraps(original)
    def _attend(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only=False):
        result = prefill_attend(self, q, latent, topk, kv_cache, last_only)
        if result is None:
            return original(self, q, latent, new_latent, topk, kv_cache, projected_cache, last_only)
        return result

    return _attend

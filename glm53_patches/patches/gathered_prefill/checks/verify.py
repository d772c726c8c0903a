"""``glm53-patches verify gathered_prefill``: bitwise check on this backend.

The patch calls the same ``mx.fast.scaled_dot_product_attention`` on the same
gathered values as stock, but with more query rows per call (63 instead of
16 at GLM-5.3-Flash's sizes). On the CPU every row is computed the same way
whatever the batch, which tests/numerics shows. On a GPU the library code
under SDPA (its matmul fallback, cuBLAS heuristics) might pick another
algorithm for another batch count, so this runs stock and patched side by
side here and compares bit for bit: small shapes at several chunk sizes, and
one case at the real head count and dims (64 x 256, 2063 selected keys)
where the patched chunks are 17 queries against stock's 16.
"""

import mlx.core as mx
import numpy as np

from glm53_patches.exactness import Tally


def indexer_like(batch, q_length, kv_length, topk, kpool, seed, holes=0.0, beyond=0.0, padded_rows=()):
    """Indices shaped like the indexer's: chosen pools in order, then the tail keys.

    ``holes``/``beyond``: the fraction of entries set to -1 / past ``kv_length``
    (stock masks both); for each (row, count) in ``padded_rows``, that many
    leading all -1 query rows (left padding, as the indexer writes them).
    """
    rng = np.random.default_rng(seed)
    out = np.full((batch, q_length, topk + kpool - 1), -1, dtype=np.int32)
    for b in range(batch):
        for i in range(q_length):
            visible = kv_length - q_length + i + 1
            complete = visible // kpool
            chosen = np.sort(rng.permutation(complete)[: topk // kpool])
            keys = (chosen[:, None] * kpool + np.arange(kpool)).reshape(-1)
            out[b, i, : keys.size] = keys
            tail = np.arange(complete * kpool, visible)[: kpool - 1]
            out[b, i, topk : topk + tail.size] = tail
    if holes:
        out[rng.random(out.shape) < holes] = -1
    if beyond:
        out[rng.random(out.shape) < beyond] = kv_length + 3
    for row, count in padded_rows:
        out[row, :count] = -1
    return mx.array(out)


def verify():
    from glm53_patches import registry

    from .. import PATCH, attention

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    tally = Tally()
    small = [(dtype, batch, chunk) for dtype in (mx.float32, mx.bfloat16) for batch in (1, 2) for chunk in (5, 16, 40)]
    # (dtype, batch, heads, dim, q_length, kv_length, topk, kpool, queries per patched chunk)
    shapes = [(dtype, batch, 4, 64, 40, 160, 32, 4, chunk) for dtype, batch, chunk in small]
    shapes.append((mx.bfloat16, 1, 64, 256, 34, 2048, 2048, 16, 17))
    for dtype, batch, heads, dim, q_length, kv_length, topk, kpool, chunk in shapes:
        mx.random.seed(tally.cases)
        q = mx.random.normal((batch, heads, q_length, dim)).astype(dtype)
        k = mx.random.normal((batch, heads, kv_length, dim)).astype(dtype)
        v = mx.random.normal((batch, heads, kv_length, dim)).astype(dtype)
        indices = indexer_like(batch, q_length, kv_length, topk, kpool, tally.cases,
                               padded_rows=[(b, 3) for b in range(batch)])
        width = indices.shape[-1]
        budget = heads * width * dim * batch * chunk
        ref = stock(q, k, v, indices, dim**-0.5, use_kernel=False)
        got = attention.gathered_attention(q, k, v, indices, dim**-0.5, max_elements=budget)
        tally.compare(f"{dtype} B={batch} H={heads} D={dim} chunk={chunk}", [ref], [got])
        del q, k, v, ref, got
    detail = (
        f"stock vs gathered chunks (fp32/bf16 x batch 1/2 x chunks 5/16/40; "
        f"bf16 64 heads x 256, 2063 keys, 34 queries in chunks of 17) on {mx.default_device()}"
    )
    if tally.mismatches:
        detail += f"; mismatches: {', '.join(r['case'] for r in tally.records if r['result'] != 'exact')}"
    return tally.result(0.0, detail)

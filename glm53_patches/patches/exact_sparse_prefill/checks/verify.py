"""``glm53-patches verify exact_sparse_prefill``: the kernels against stock's ``_sparse_prefill_attention`` here.

On CUDA:

1. the op, stock's loop against ``attention.attention`` on the same inputs:
   indices as the indexer writes them (pools in order, the tail, -1 holes,
   out-of-range entries, all -1 padded query rows), float32, bf16 and
   float16, key dims 48, 64, 128 and 256 (gemv's 1, 2 and 4 values per
   lane), batch 1 and 2, query counts that are not whole chunks, K/V as the
   projected cache's strided views, and GLM-5.3-Flash's 64 heads x 256 over
   4,096 keys for a whole 2,048-query chunk. Where a case differs, the other
   FMA is tried and the note says whether it matched;
2. the tiny random-weight model, greedy decode batch 1 and 2 (its 40-token
   prompt goes through the DSA layers' prefill): logits of every step.

Every op case runs stock twice and is inconclusive where stock differs from
itself. On the CPU there is no kernel: the patch steps aside, and only check
2 runs.
"""

import mlx.core as mx

from glm53_patches.exactness import abs_diff, same_bits, verify_gpu_kernel
from glm53_patches.patches.gathered_prefill.checks.verify import indexer_like

# (label, dtype, batch, heads, dim, queries, keys, topk, kpool, strided K/V)
CASES = [
    (f"{dtype} B={batch} D={dim}{' strided' if strided else ''}", dtype, batch, 4, dim, 40, 160, 32, 4, strided)
    for dtype in (mx.float32, mx.bfloat16, mx.float16)
    for batch in (1, 2)
    for dim in (48, 64, 128)
    for strided in ((False, True) if dim == 64 else (False,))
] + [
    ("bf16 64x256 B=2 33 queries strided", mx.bfloat16, 2, 64, 256, 33, 2048, 2048, 16, True),
    ("bf16 64x256 B=1 2048 queries over 4096 keys", mx.bfloat16, 1, 64, 256, 2048, 4096, 2048, 16, False),
]


def case_inputs(dtype, batch, heads, dim, queries, keys, topk, kpool, strided, seed):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, queries, dim)).astype(dtype)
    room = keys + (256 if strided else 0)  # the projected cache's buffer grows in steps of 256
    k = mx.random.normal((batch, heads, room, dim)).astype(dtype)[:, :, :keys]
    v = mx.random.normal((batch, heads, room, dim)).astype(dtype)[:, :, :keys]
    if not strided:
        k, v = mx.contiguous(k), mx.contiguous(v)
    padded = [(b, 3 * b + 1) for b in range(batch)]
    indices = indexer_like(batch, queries, keys, topk, kpool, seed, holes=0.02, beyond=0.01, padded_rows=padded)
    mx.eval(q, k, v, indices)
    return q, k, v, indices


def check_op(tally, stock):
    from .. import kernel
    from ..attention import attention

    for seed, (name, *shape) in enumerate(CASES):
        q, k, v, indices = case_inputs(*shape, seed)
        scale = q.shape[-1] ** -0.5
        expected = stock(q, k, v, indices, scale)
        again = stock(q, k, v, indices, scale)
        actual = attention(q, k, v, indices, scale)
        mx.eval(expected, again, actual)
        if not same_bits(expected, again):
            tally.inconclusive(name, "stock differs from itself")
            continue
        if same_bits(expected, actual):
            tally.add(name, True)
            continue
        worst = abs_diff(expected, actual)
        original, kernel.DEFAULT_FMA = kernel.DEFAULT_FMA, 1 - kernel.DEFAULT_FMA
        try:
            matched = same_bits(expected, attention(q, k, v, indices, scale))
        finally:
            kernel.DEFAULT_FMA = original
        tally.add(name, False, worst, f"max |diff| {worst:.3g}; FMA={1 - original} {'matches' if matched else 'differs too'}")


def check_kernel(tally, backend):
    from glm53_patches import registry

    from .. import PATCH

    check_op(tally, registry.upstream(next(iter(PATCH.targets))))  # stock even while patches are applied


def verify():
    from mlx_vlm.models.glm5_next import language

    from .. import PATCH
    from ..attention import make_sparse_prefill, switch

    return verify_gpu_kernel(PATCH, check_kernel, language, make_sparse_prefill, switch,
                             attr="_sparse_prefill_attention")

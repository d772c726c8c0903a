"""Every Metal kernel launch the checks cover: the shapes each patch's verify uses, plus edges.

Edges: inputs of fewer than 8 elements (MLX passes them in the constant
address space), batch 1 and 3, head dims 64 and 128. Each case is
``(kernel, name, fn, args)``: ``fn(*args)`` makes one launch, traced by
``source.generated``. Upstream's own Metal kernels (mlx-vlm's gated delta
and hyper-connection kernels) are cases too: the check must pass them.
"""

import mlx.core as mx


def _normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def router_select():
    from glm53_patches.patches.router_select.kernel import router_select as select

    # verify: 288 experts, top 8, 1 / 8 / 2,048 rows; the tiny model: 8 experts, top 2, batch 1-3.
    for rows, experts, top_k in ((1, 288, 8), (8, 288, 8), (2048, 288, 8), (1, 8, 2), (3, 8, 2), (1, 7, 2)):
        for order in (0, 1):
            yield (f"{rows} rows x {experts} experts, top {top_k}, order {order}",
                   lambda l, b, k=top_k, o=order: select(l, b, k, True, 2.5, backend="metal", order=o),
                   (_normal((rows, experts), 1), _normal((experts,), 2)))


def expert_combine():
    from glm53_patches.patches.expert_combine.kernel import expert_combine as combine

    # verify: hidden 4096, top 8, 1 / 4 / 64 rows in three dtypes; the tiny model: hidden 128, top 2, batch 1-3.
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for rows, k, hidden in ((1, 8, 4096), (4, 8, 4096), (64, 8, 4096), (1, 2, 128), (3, 2, 128), (2, 12, 256)):
            yield (f"{dtype} {rows} rows, top {k}, hidden {hidden}",
                   lambda r, w, s: combine(r, w, s, backend="metal"),
                   (_normal((rows, 1, k, hidden), 3, dtype), mx.softmax(_normal((rows, 1, k), 4), axis=-1),
                    _normal((rows, 1, hidden), 5, dtype)))


def fused_kda_inputs(batch, heads, dim, taps=4, seed=6):
    """The kernel's inputs for one decode step (bf16 activations, float32 state and gate parameters)."""
    from glm53_patches.patches.fused_kda_kernel import kernel

    consts, scales = kernel.constants(1e-6 / dim, 1e-5, -5.0, dim**-0.5)
    channels, bf = 3 * heads * dim, mx.bfloat16
    return [_normal((batch, channels), seed, bf), _normal((batch, taps - 1, channels), seed + 1, bf),
            (0.5 * _normal((channels, taps), seed + 2)).astype(bf), _normal((batch, heads * dim), seed + 3, bf),
            _normal((batch, heads), seed + 4, bf), _normal((batch, heads * dim), seed + 5, bf),
            0.1 * _normal((batch, heads, dim, dim), seed + 6), _normal((heads,), seed + 7),
            _normal((heads * dim,), seed + 8), _normal((dim,), seed + 9, bf), consts, scales]


def fused_kda_kernel():
    from glm53_patches.patches.fused_kda_kernel.kernel import fused_kda_step

    # verify: 4 heads of 64 and 64 heads of 128, batch 1 and a left-padded batch of 3 (masked).
    for batch, heads, dim in ((1, 4, 64), (3, 4, 64), (1, 64, 128), (3, 64, 128), (1, 2, 128)):
        for masked in (False, True):
            for fma in ((0, 0), (1, 1)) if heads == 4 else ((0, 0), (0, 1), (1, 0), (1, 1)):
                mask = mx.array([True, False, True][:batch]) if masked else None
                yield (f"batch {batch}, {heads} heads of {dim}, {'mask' if masked else 'no mask'}, FMA {fma}",
                       lambda *a, f=fma, m=mask: fused_kda_step(*a, m, backend="metal", fma=f),
                       tuple(fused_kda_inputs(batch, heads, dim)))


def hc_decode():
    from glm53_patches.kernels import hc_sinkhorn

    # verify: hidden 4096, bf16 and fp32, batch 1 and 4; the tiny model: hidden 128.
    for dtype in (mx.bfloat16, mx.float32):
        for batch, hidden in ((1, 4096), (4, 4096), (1, 128), (3, 128)):
            yield (f"{dtype} batch {batch}, hidden {hidden}",
                   lambda x, m, s, b: hc_sinkhorn.hc_sinkhorn_collapse(x, m, s, b, 4, 20, 1e-6, backend="metal"),
                   (_normal((batch, 1, 4, hidden), 16, dtype), _normal((batch, 1, 24), 17), _normal((3,), 18),
                    _normal((24,), 19)))


def dsa_decode():
    from glm53_patches.patches.dsa_decode.select_kernel import select_topk

    # verify: 32 heads, pools of 16, top-k 2048; contexts 2,040 to 131,072 keys, batch 1 and 2, decode tokens
    # and verify blocks; the tiny model.
    for batch, length, keys, kpool, topk, tail in ((1, 1, 2040, 16, 2048, 15), (2, 1, 4096, 16, 2048, 15),
                                                   (1, 1, 131072, 16, 2048, 15), (3, 1, 300, 4, 64, 3),
                                                   (1, 1, 56, 4, 16, 3), (2, 4, 4096, 16, 2048, 15),
                                                   (1, 8, 300, 4, 64, 3)):
        pools = keys // kpool
        yield (f"batch {batch}, {length} positions, {keys} keys, kpool {kpool}",
               lambda s, v, p, q, k=min(pools, topk // kpool), kp=kpool, t=topk, tl=tail:
               select_topk(s, v, p, q, k, kpool=kp, topk=t, tail_width=tl, backend="metal"),
               (_normal((batch, length, pools), 20), mx.ones((batch, keys), mx.bool_),
                mx.array([pools] * batch, mx.int32), mx.ones((batch, length), mx.bool_)))


def indexer_fp32():
    from glm53_patches.patches.indexer_fp32 import kernels

    for dtype in (mx.bfloat16, mx.float32):
        for batch, length, pools in ((1, 1, 256), (2, 16, 1024), (1, 1, 4)):
            for masked in (False, True):
                args = (_normal((batch, length, 32, 128), 21, dtype), _normal((batch, pools, 128), 22, dtype),
                        _normal((batch, length, 32), 23))
                if masked:
                    args += (mx.ones((batch, length, pools), mx.bool_),)
                yield (f"{dtype} batch {batch}, {length} queries, {pools} pools, {'mask' if masked else 'no mask'}",
                       lambda *a: kernels.scores("metal", *a), args)


def upstream_gated_delta():
    from mlx_vlm.models import gated_delta as gd

    for batch, heads, dim in ((1, 4, 64), (3, 4, 64), (1, 64, 128)):
        for vectorized in (False, True):
            for masked in (False, True):
                q = _normal((batch, 1, heads, dim), 30, mx.bfloat16)
                g = mx.sigmoid(_normal((batch, 1, heads, dim) if vectorized else (batch, 1, heads), 31))
                beta = mx.sigmoid(_normal((batch, 1, heads), 32)).astype(mx.bfloat16)
                state = _normal((batch, heads, dim, dim), 33)
                args = (q, q, q, g, beta, state)
                if masked:
                    args += (mx.ones((batch, 1), mx.bool_),)
                yield (f"batch {batch}, {heads} heads of {dim}, {'vectorized' if vectorized else 'scalar'} gate, "
                       f"{'mask' if masked else 'no mask'}", gd.gated_delta_kernel, args)


def upstream_hyper_connection():
    from mlx_vlm.models.deepseek_v4 import hyper_connection as hc

    from .source import pretend_metal

    def split(m, s, b):
        with pretend_metal():  # stock picks its kernel behind these checks
            return hc.hc_split_sinkhorn(m, s, b, 4, 20, 1e-6)

    for dtype in (mx.bfloat16, mx.float32):
        for batch, hidden in ((1, 4096), (3, 128)):
            yield (f"collapse {dtype} batch {batch}, hidden {hidden}",
                   lambda x, m, s, b: hc._hc_kernel(x, None, m, s, b, 4, 20, 1e-6),
                   (_normal((batch, 1, 4, hidden), 40, dtype), _normal((batch, 1, 24), 41), _normal((3,), 42),
                    _normal((24,), 43)))
    for batch in (1, 3):
        yield (f"split batch {batch}", split,
               (_normal((batch, 1, 24), 44), _normal((3,), 45), _normal((24,), 46)))


def block_qmv():
    from glm53_patches.patches.block_qmv.kernel import block_qmv as project

    # verify on Metal: the real projections (8-bit KDA, 6-bit rest; K 1,536 to 16,384) at 4 positions and the
    # widest at 2, 3 and 7; every bit width; float16; groups 32 and 128.
    shapes = [(8, 4096, 8, 64, 4, mx.bfloat16), (16, 1536, 6, 64, 4, mx.bfloat16), (8, 16384, 6, 64, 7, mx.bfloat16),
              (8, 4096, 8, 64, 2, mx.bfloat16), (8, 4096, 8, 64, 3, mx.bfloat16), (8, 4096, 4, 64, 4, mx.float16),
              (8, 4096, 8, 32, 4, mx.bfloat16), (8, 4096, 4, 128, 4, mx.bfloat16),
              *[(8, 512, bits, 64, 5, mx.bfloat16) for bits in (2, 3, 5)]]
    for n, k, bits, group, positions, dtype in shapes:
        w, scales, biases = mx.quantize(_normal((n, k), 20), group_size=group, bits=bits)
        yield (f"{dtype} {bits}-bit group {group}, {positions} positions, K {k}",
               lambda x, w, s, b, bits=bits, group=group: project(x, w, s, b, bits, group, backend="metal"),
               (_normal((positions, k), 21, dtype), w, scales.astype(dtype), biases.astype(dtype)))


def routed_experts():
    from glm53_patches.patches.routed_experts.kernel import expert_qmv

    # verify on Metal: gate and up together, then down, 64 experts at the real widths (4-bit, group 64) for 8 and
    # 56 routes; 8- and 6-bit; group 32; float16; 2-, 3- and 5-bit at K 1,024; the tiny model's 512-wide experts.
    shapes = [(2048, 4096, 4, 64, 1, 8, 2, mx.bfloat16), (4096, 2048, 4, 64, 8, 8, 1, mx.bfloat16),
              (2048, 4096, 4, 64, 7, 56, 2, mx.bfloat16), (2048, 4096, 8, 64, 1, 8, 2, mx.bfloat16),
              (2048, 4096, 6, 64, 1, 8, 2, mx.bfloat16), (2048, 4096, 4, 32, 1, 8, 2, mx.bfloat16),
              (2048, 4096, 4, 64, 2, 16, 2, mx.float16), (512, 512, 4, 64, 1, 8, 2, mx.bfloat16),
              *[(512, 1024, bits, 64, 2, 16, 2, mx.bfloat16) for bits in (2, 3, 5)]]
    for n, k, bits, group, rows, routes, count, dtype in shapes:
        w, scales, biases = mx.quantize(_normal((4, n, k), 22), group_size=group, bits=bits)
        yield (f"{dtype} {bits}-bit group {group}, {count} projection(s), {routes} routes of {rows} rows, K {k}",
               lambda x, i, w, s, b, bits=bits, group=group, count=count: expert_qmv(
                   x, i, [(w, s, b)] * count, bits, group),
               (_normal((rows, k), 23, dtype), (mx.arange(routes) % 4).astype(mx.uint32), w, scales.astype(dtype),
                biases.astype(dtype)))


KERNELS = {
    "block_qmv": block_qmv,
    "routed_experts": routed_experts,
    "router_select": router_select,
    "expert_combine": expert_combine,
    "fused_kda_kernel": fused_kda_kernel,
    "hc_decode": hc_decode,
    "dsa_decode": dsa_decode,
    "indexer_fp32": indexer_fp32,
    "upstream gated delta": upstream_gated_delta,
    "upstream hyper-connection": upstream_hyper_connection,
}


def cases(kernels=None):
    """(kernel, case name, fn, args) for the named kernels (default: all)."""
    for kernel in kernels or KERNELS:
        for name, fn, args in KERNELS[kernel]():
            yield kernel, name, fn, args

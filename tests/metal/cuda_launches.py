"""Every CUDA kernel launch the kernel patches make, as records; ``python tests/metal/cuda_launches.py`` prints their digests.

There is no CUDA here, so ``mx.fast.cuda_kernel`` is replaced for the run by
a recorder: it keeps what the patch hands MLX (name, input and output names,
source, header, flags) and, per launch, everything else MLX's generated CUDA
source and launch depend on (input dtypes and shapes, template arguments,
grid, threadgroup, outputs). Each patch's public kernel function is called
with ``backend="cuda"`` over the shapes its verify uses. The digests of main
(commit 4ed0234, recorded from its unmodified code) are in
``test_cuda_unchanged.py``; running this file from another checkout
(``PYTHONPATH=<checkout> python tests/metal/cuda_launches.py``) gives that
checkout's.
"""

import contextlib
import hashlib
import json
import math

import mlx.core as mx


def _plain(value):
    if isinstance(value, mx.Dtype):
        return str(value)
    if isinstance(value, mx.array):
        return {"dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Recorder:
    """Stands in for ``mx.fast.cuda_kernel``: records construction and launches, returns zero outputs."""

    def __init__(self):
        self.records = []

    def __call__(self, **kwargs):
        built = {"kernel": _plain(kwargs)}
        self.records.append(built)

        def launch(**call):
            self.records.append({"launch": kwargs["name"], **_plain(call)})
            return [mx.zeros(s, dtype=d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

        return launch


@contextlib.contextmanager
def recording():
    """Within: ``mx.fast.cuda_kernel`` records, and the patches' kernel caches start (and end) empty."""
    from glm53_patches.kernels.build import forget_kernels
    from glm53_patches.patches.kda_prefill_kernel import cuda as prefill

    recorder = _Recorder()
    original, original_available = mx.fast.cuda_kernel, prefill.cuda_available
    forget_kernels()
    mx.fast.cuda_kernel = recorder
    prefill.cuda_available = lambda: True
    try:
        yield recorder
    finally:
        mx.fast.cuda_kernel, prefill.cuda_available = original, original_available
        forget_kernels()


def _normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _router():
    from glm53_patches.patches.router_select.kernel import router_select

    for rows, experts, top_k in ((1, 288, 8), (2048, 288, 8), (3, 8, 2)):
        for order in (0, 1):
            router_select(_normal((rows, experts), 1), _normal((experts,), 2), top_k, True, 2.5, backend="cuda",
                          order=order)


def _combine():
    from glm53_patches.patches.expert_combine.kernel import expert_combine

    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for rows, k, hidden in ((1, 8, 4096), (64, 8, 4096), (3, 2, 128)):
            expert_combine(_normal((rows, 1, k, hidden), 3, dtype), mx.softmax(_normal((rows, 1, k), 4), axis=-1),
                           _normal((rows, 1, hidden), 5, dtype), backend="cuda")


def _fused_kda():
    from glm53_patches.patches.fused_kda_kernel import kernel

    consts, scales = kernel.constants(1e-6 / 64, 1e-5, -5.0, 64**-0.5)
    for batch, heads, dim in ((1, 4, 64), (3, 4, 64), (1, 64, 128)):
        channels, taps = 3 * heads * dim, 4
        bf = mx.bfloat16
        inputs = [_normal((batch, channels), 6, bf), _normal((batch, taps - 1, channels), 7, bf),
                  _normal((channels, taps), 8, bf), _normal((batch, heads * dim), 9, bf),
                  _normal((batch, heads), 10, bf), _normal((batch, heads * dim), 11, bf),
                  _normal((batch, heads, dim, dim), 12), _normal((heads,), 13), _normal((heads * dim,), 14),
                  _normal((dim,), 15, bf), consts, scales]
        for mask in (None, mx.array([True] * batch)):
            for fma in ((0, 0), (0, 1), (1, 0), (1, 1)):
                kernel.fused_kda_step(*inputs, mask, backend="cuda", fma=fma)


def _hc():
    from glm53_patches.kernels import hc_sinkhorn

    for dtype in (mx.bfloat16, mx.float32):
        for batch, hidden in ((1, 4096), (4, 4096), (2, 128)):
            for variant in ((0, 0, 0), (1, 0, 0), (2, 1, 1), (0, 2, 0)):
                hc_sinkhorn.hc_sinkhorn_collapse(
                    _normal((batch, 1, 4, hidden), 16, dtype), _normal((batch, 1, 24), 17), _normal((3,), 18),
                    _normal((24,), 19), 4, 20, 1e-6, backend="cuda", variant=variant)


def _dsa():
    from glm53_patches.patches.dsa_decode.select_kernel import select_topk

    for batch, length, keys, kpool, topk, tail in ((1, 1, 4096, 16, 2048, 15), (2, 1, 131072, 16, 2048, 15),
                                                   (3, 1, 300, 4, 64, 3), (2, 4, 4096, 16, 2048, 15)):
        pools = keys // kpool
        select_topk(_normal((batch, length, pools), 20), mx.ones((batch, keys), mx.bool_),
                    mx.array([pools] * batch, mx.int32), mx.ones((batch, length), mx.bool_),
                    min(pools, topk // kpool), kpool=kpool, topk=topk, tail_width=tail, backend="cuda")


def _indexer():
    from glm53_patches.patches.indexer_fp32 import kernels

    for dtype in (mx.bfloat16, mx.float32):
        for batch, length, pools in ((1, 1, 256), (2, 16, 1024)):
            q, keys = _normal((batch, length, 32, 128), 21, dtype), _normal((batch, pools, 128), 22, dtype)
            ws = _normal((batch, length, 32), 23)
            kernels.scores("cuda", q, keys, ws)
            kernels.scores("cuda", q, keys, ws, mx.ones((batch, length, pools), mx.bool_))


def _prefill():
    from glm53_patches.patches.kda_prefill_kernel.cuda import kernel_gated_delta

    for batch, length, heads, dk, dv in ((1, 64, 4, 64, 64), (2, 33, 64, 128, 128)):
        shape = (batch, length, heads, dk)
        q, k, g = _normal(shape, 24), _normal(shape, 25), -mx.abs(_normal(shape, 26))
        v, beta = _normal((batch, length, heads, dv), 27), mx.sigmoid(_normal((batch, length, heads), 28))
        for mask in (None, mx.ones((batch, length), mx.bool_)):
            kernel_gated_delta(q, k, v, g, beta, None, mask)


def _qmv():
    from glm53_patches.patches.exact_qmv import kernel
    from glm53_patches.patches.exact_qmv.checks.verify import OTHER, REAL

    cases = [(n, k, bits, 64, mx.bfloat16, 1, {}) for _, n, k, bits in REAL] + [case[1:] for case in OTHER]
    for n, k, bits, group, dtype, rows, launch in cases:
        w = mx.zeros((n, k * bits // 32), mx.uint32)
        scales = mx.zeros((n, k // group), dtype)
        kernel.qmv(mx.zeros((rows, 1, k), dtype), w, scales, scales, bits, group, **launch)


def _block_qmv():
    from glm53_patches.patches.block_qmv import kernel
    from glm53_patches.patches.block_qmv.checks.verify import OTHER, REAL

    cases = [(n, k, bits, 64, mx.bfloat16, 4, {}) for _, n, k, bits in REAL if k % 512 == 0]
    for n, k, bits, group, dtype, positions, launch in cases + [case[1:] for case in OTHER]:
        w = mx.zeros((n, k * bits // 32), mx.uint32)
        scales = mx.zeros((n, k // group), dtype)
        kernel.block_qmv(mx.zeros((positions, k), dtype), w, scales, scales, bits, group, **launch)


def _routed_experts():
    from glm53_patches.patches.routed_experts import kernel
    from glm53_patches.patches.routed_experts.checks.verify import CALLS, EXPERTS, PAIR_SETTINGS, SETTINGS, SHAPES

    def projection(n, k):  # an expert set's weights, scales and biases
        return mx.zeros((EXPERTS, n, k // 8), mx.uint32), *[mx.zeros((EXPERTS, n, k // 64), mx.bfloat16)] * 2

    for _, n, k in SHAPES:
        experts = projection(n, k)
        for _, x_batch, routes_shape in CALLS:
            x, routes = mx.zeros((math.prod(x_batch), k), mx.bfloat16), mx.zeros((math.prod(routes_shape),), mx.uint32)
            kernel.expert_mma(x, routes, [experts])
        for settings in SETTINGS:
            kernel.expert_mma(mx.zeros((7, k), mx.bfloat16), mx.zeros((56,), mx.uint32), [experts], **settings)
    _, n, k = SHAPES[0]
    pair = [projection(n, k)] * 2  # a decode step's up and gate in one launch
    for settings in PAIR_SETTINGS:
        kernel.expert_mma(mx.zeros((1, k), mx.bfloat16), mx.zeros((8,), mx.uint32), pair, **settings)


def _kda_verify():
    from glm53_patches.patches.fused_kda_kernel import kernel as fused
    from glm53_patches.patches.kda_verify_kernel import kernel

    for batch, length, heads, dim, steps in ((1, 4, 64, 128, 3), (3, 8, 4, 64, 7), (1, 1, 64, 128, None), (2, 2, 4, 64, 2)):
        shape = (batch, length, heads, dim)
        q = _normal(shape, 29, mx.bfloat16)
        beta, state = _normal((batch, length, heads), 30, mx.bfloat16), _normal((batch, heads, dim, dim), 31)
        for mask in (None, mx.ones((batch, length), mx.bool_)):
            for fma_state in (0, 1):
                kernel.delta_block(q, q, q, _normal(shape, 32), beta, state, mask, steps, fma_state=fma_state)
    bf = mx.bfloat16
    for batch, length, heads, dim, steps in ((1, 4, 64, 128, 3), (3, 8, 4, 64, 7), (1, 1, 64, 128, None)):
        channels, taps = 3 * heads * dim, 4
        consts, scales = fused.constants(1e-6 / dim, 1e-5, -5.0, dim**-0.5)
        inputs = [_normal((batch, taps - 1 + length, channels), 33, bf), _normal((channels, taps), 34, bf),
                  _normal((batch, length, heads * dim), 35, bf), _normal((batch, length, heads), 36, bf),
                  _normal((batch, length, heads * dim), 37, bf), _normal((batch, heads, dim, dim), 38),
                  _normal((heads,), 39), _normal((heads * dim,), 40), _normal((dim,), 41, bf), consts, scales]
        for mask in (None, mx.ones((batch, length), mx.bool_)):
            for fma in (None, (1, 0)):
                kernel.mixer_block(*inputs, mask, steps, fma=fma)


PATCHES = {
    "router_select": _router,
    "expert_combine": _combine,
    "fused_kda_kernel": _fused_kda,
    "hc_decode": _hc,
    "dsa_decode": _dsa,
    "indexer_fp32": _indexer,
    "kda_prefill_kernel": _prefill,
    "exact_qmv": _qmv,
    "block_qmv": _block_qmv,
    "routed_experts": _routed_experts,
    "kda_verify_kernel": _kda_verify,
}


def records():
    """{patch: [its kernels' construction and launch records]}."""
    found = {}
    for name, drive in PATCHES.items():
        with recording() as recorder:
            drive()
        found[name] = recorder.records
    return found


def digests():
    """{patch: SHA-256 of its records as canonical JSON}."""
    return {name: hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()
            for name, rec in records().items()}


if __name__ == "__main__":
    import glm53_patches

    print(f"# from {glm53_patches.__file__}")
    for name, digest in digests().items():
        print(f'    "{name}": "{digest}",')

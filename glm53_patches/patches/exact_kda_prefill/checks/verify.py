"""``glm53-patches verify exact_kda_prefill``: the kernel against stock's ``gated_delta_ops`` on this machine.

On CUDA:

1. the op: stock's loop and the kernel on the same inputs, made as the KDA
   mixer makes them (bf16 q, k rms-normed and scaled, bf16 v and
   ``sigmoid(b)``, float32 ``compute_g_safe`` gates, a float32 state carried
   over from earlier tokens), 4 heads of 64 and GLM-5.3-Flash's 64 of 128,
   batch 1 and a left-padded batch of 3 (masked tokens), 2 to 2,048 tokens,
   with and without the per-token history (``state_steps``): y, the state
   and the history bit for bit. Where a case differs, the other FMA_STATE
   is tried and the note says whether it matched;
2. a KDA layer: two prefill chunks into one cache (the second resumes the
   first's state and conv window), then 4 decode steps, bf16, dense and
   8-bit: every output and the cache bit for bit;
3. the tiny random-weight model, greedy decode batch 1 and 2 (its prefill
   goes through the kernel): logits of every step bit for bit.

Every case also runs stock twice and calls itself inconclusive where stock
differs from itself. On the CPU there is no kernel: the patch steps aside,
and only check 3 runs.
"""

import itertools

import mlx.core as mx

from glm53_patches.exactness import abs_diff, same_bits, verify_gpu_kernel

SMALL, REAL = (256, 4, 64), (4096, 64, 128)  # hidden size, heads, head dim


def op_inputs(batch, length, heads, dim, seed, padding=None):
    """gated_delta_ops' arguments as the KDA mixer hands them over, and the mask (or None)."""
    from mlx_vlm.models.gated_delta import compute_g_safe

    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    shape = (batch, length, heads, dim)
    eps = 1e-6 / dim
    q = dim**-1.0 * mx.fast.rms_norm(mx.random.normal(shape, key=ks[0]).astype(mx.bfloat16), None, eps)
    k = dim**-0.5 * mx.fast.rms_norm(mx.random.normal(shape, key=ks[1]).astype(mx.bfloat16), None, eps)
    v = mx.random.normal(shape, key=ks[2]).astype(mx.bfloat16)
    a = mx.random.normal(shape, key=ks[3]).astype(mx.bfloat16)
    A_log = mx.random.uniform(-1.0, 1.0, (heads, 1), key=ks[4])
    dt_bias = mx.random.normal((heads, dim), key=ks[5])
    g = compute_g_safe(A_log, a, dt_bias, -5.0)
    beta = mx.sigmoid(mx.random.normal((batch, length, heads), key=ks[6]).astype(mx.bfloat16))
    state = 0.3 * mx.random.normal((batch, heads, dim, dim), key=ks[7])
    mask = None
    if padding is not None:
        mask = mx.arange(length)[None] >= mx.array(padding)[:, None]
        q, k, v = (mx.where(mask[..., None, None], x, 0) for x in (q, k, v))
    mx.eval(q, k, v, g, beta, state)
    return (q, k, v, g, beta, state), mask


def op_cases():
    """(name, batch, tokens, dims, left padding or None, state_steps or None)."""
    for dims, (batch, padding), length in itertools.product(
        (SMALL, REAL), ((1, None), (3, [0, 2, 7])), (2, 7, 300)
    ):
        steps = [None, length - 1] if length <= 8 else [None]
        for step in steps:
            name = f"op {dims[1]}x{dims[2]} B={batch} T={length}" + (f" history {step}" if step else "")
            yield name, batch, length, dims, padding, step
    yield f"op {REAL[1]}x{REAL[2]} B=1 T=2048", 1, 2048, REAL, None, None


def _differs(expected, actual):
    """(first differing output, max |diff|) or (None, 0)."""
    worst, first = 0.0, None
    for i, (a, b) in enumerate(zip(expected, actual)):
        if not same_bits(a, b):
            first = i if first is None else first
            worst = max(worst, abs_diff(a, b))
    return first, worst


def check_op(tally, stock):
    from .. import kernel

    for seed, (name, batch, length, dims, padding, steps) in enumerate(op_cases()):
        args, mask = op_inputs(batch, length, dims[1], dims[2], seed, padding)
        expected = stock(*args, mask, steps)
        again = stock(*args, mask, steps)
        actual = kernel.looped_gated_delta(*args, mask, steps)
        mx.eval(expected, again, actual)
        if _differs(expected, again)[0] is not None:
            tally.inconclusive(name, "stock differs from itself")
            continue
        first, worst = _differs(expected, actual)
        if first is None:
            tally.add(name, True)
            continue
        other = 1 - kernel.DEFAULT_FMA_STATE
        matched = _differs(expected, kernel.looped_gated_delta(*args, mask, steps, fma_state=other))[0] is None
        tally.add(name, False, worst, f"output {first} differs (max |diff| {worst:.3g}); "
                  f"FMA_STATE={other} {'matches' if matched else 'differs too'}")


def check_layers(tally, stock, fast):
    """Two prefill chunks and 4 decode steps of a KDA layer, stock's ops vs the kernel."""
    from mlx_vlm.models import gated_delta as _gd
    from mlx_vlm.models.cache import ArraysCache

    from glm53_patches import registry
    from glm53_patches.patches.compiled_kda_decode.checks.verify import _layer

    mixer = registry.upstream("mlx_vlm.models.glm5_next.language:Glm5NextLinearAttention.__call__")
    installed = _gd.gated_delta_ops
    for seed, (dims, bits, padding) in enumerate(itertools.product((SMALL, REAL), (None, 8), (None, [0, 3, 9]))):
        name = f"layer {dims[1]}x{dims[2]} bits={bits} pad={padding}: chunks 24+40, 4 steps"
        layer = _layer(mx.bfloat16, bits, seed=100 + seed, dims=dims)
        batch = 1 if padding is None else len(padding)
        mx.random.seed(seed)
        chunks = [mx.random.normal((batch, n, dims[0])).astype(mx.bfloat16) for n in (24, 40, 1, 1, 1, 1)]
        runs = []
        for fn in (stock, stock, fast):
            cache, outputs = ArraysCache(2, left_padding=padding), []
            try:
                _gd.gated_delta_ops = fn
                for x in chunks:
                    outputs.append(mixer(layer, x, cache.make_mask(x.shape[1]), cache))
                    mx.eval(outputs[-1], cache[0], cache[1])
            finally:
                _gd.gated_delta_ops = installed
            runs.append(outputs + [cache[0], cache[1]])
        if _differs(runs[0], runs[1])[0] is not None:
            tally.inconclusive(name, "stock differs from itself")
        else:
            tally.compare(name, runs[0], runs[2])


def check_kernel(tally, backend):
    from glm53_patches import registry

    from .. import PATCH
    from ..recurrence import make_call, switch

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    check_op(tally, stock)
    before = PATCH.stats.snapshot()["hits"].get("kernel", 0)
    with switch.forcing(True):
        check_layers(tally, stock, make_call(stock))
    if PATCH.stats.snapshot()["hits"].get("kernel", 0) == before:
        tally.mismatches.append("the kernel never ran in the layer check")


def verify():
    from mlx_vlm.models import gated_delta

    from .. import PATCH
    from ..recurrence import make_call, switch

    return verify_gpu_kernel(PATCH, check_kernel, gated_delta, make_call, switch, attr="gated_delta_ops")

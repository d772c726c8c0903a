"""``glm53-patches verify exact_qmv``: the kernel against MLX's ``quantized_matmul`` here.

On CUDA:

1. the op, ``mx.quantized_matmul`` (MLX's qmv at these row counts) against
   ``kernel.qmv`` on the same random weights and inputs:
   - every quantized projection a GLM-5.3-Flash decode step runs, at its real
     width and bits (KDA 8-bit, the rest 6-bit; lm_head's 154,880 rows), one row;
   - 4-bit versions of the widest, rows 2 to 7 (batched decode), float16,
     group sizes 32 and 128, widths that end in a partial pass, and other
     launch shapes (passes ahead, warps per block, rows per warp), which must
     change nothing;
2. the tiny random-weight model, 6- and 4-bit, bf16 at widths of 128: greedy
   decode at batch 1 and 2, every step's logits, with the kernel forced on
   behind ``linear`` and then behind ``tiled_linear``.

Every op case runs stock twice and is inconclusive where stock differs from
itself. On the CPU there is no kernel: the patch steps aside, and only check 2
runs.
"""

import time

import mlx.core as mx

from glm53_patches import tiny_model
from glm53_patches.exactness import Tally, abs_diff, compare_tiny_models, same_bits
from glm53_patches.backend import current as backend

# GLM-5.3-Flash's widths (bench.synthetic.text_config("real")).
HIDDEN, KDA_QKV, KDA_HEADS, KDA_DIM = 4096, 24576, 64, 128
Q_LORA, KV_LORA, HEADS, HEAD_DIM, INDEX_HEADS, INDEX_DIM = 1536, 512, 64, 256, 32, 128
EXPERT, DENSE, VOCAB = 2048, 12288, 154880

# (label, out, in, bits): a decode step's projections, as the real model quantizes them.
REAL = [
    ("KDA qkv_proj", KDA_QKV, HIDDEN, 8),
    ("KDA fbg_a_proj", 2 * KDA_DIM + KDA_HEADS, HIDDEN, 8),
    ("KDA f_b_proj / g_b_proj", KDA_HEADS * KDA_DIM, KDA_DIM, 8),
    ("KDA o_proj", HIDDEN, KDA_HEADS * KDA_DIM, 8),
    ("DSA qkv_a_proj", Q_LORA + KV_LORA, HIDDEN, 6),
    ("DSA q_b_proj", HEADS * HEAD_DIM, Q_LORA, 6),
    ("DSA o_proj", HIDDEN, HEADS * HEAD_DIM, 6),
    ("indexer wq_b", INDEX_HEADS * INDEX_DIM, Q_LORA, 6),
    ("indexer wk", INDEX_DIM, HIDDEN, 6),
    ("indexer weights_proj", INDEX_HEADS, HIDDEN, 6),
    ("shared expert gate_up", 2 * EXPERT, HIDDEN, 6),
    ("shared expert down", HIDDEN, EXPERT, 6),
    ("dense MLP gate_up", 2 * DENSE, HIDDEN, 6),
    ("dense MLP down", HIDDEN, DENSE, 6),
    ("lm_head", VOCAB, HIDDEN, 6),
]
# (label, out, in, bits, group, dtype, rows, launch overrides)
OTHER = [
    ("4-bit qkv_proj", KDA_QKV, HIDDEN, 4, 64, mx.bfloat16, 1, {}),
    ("4-bit o_proj", HIDDEN, KDA_HEADS * KDA_DIM, 4, 64, mx.bfloat16, 1, {}),
    ("8-bit 3 rows", 4096, HIDDEN, 8, 64, mx.bfloat16, 3, {}),
    ("6-bit 7 rows", 2 * EXPERT, HIDDEN, 6, 64, mx.bfloat16, 7, {}),
    ("4-bit 2 rows", 4096, HIDDEN, 4, 64, mx.bfloat16, 2, {}),
    ("8-bit float16", 4096, HIDDEN, 8, 64, mx.float16, 1, {}),
    ("4-bit float16 5 rows", 4096, HIDDEN, 4, 64, mx.float16, 5, {}),
    ("8-bit group 32", 4096, HIDDEN, 8, 32, mx.bfloat16, 1, {}),
    ("4-bit group 128", 4096, HIDDEN, 4, 128, mx.bfloat16, 1, {}),
    ("8-bit partial last pass (K=384)", 1000, 384, 8, 64, mx.bfloat16, 2, {}),
    ("4-bit partial last pass (K=640)", 1000, 640, 4, 64, mx.bfloat16, 1, {}),
    ("2-bit", 4096, HIDDEN, 2, 64, mx.bfloat16, 1, {}),
    ("3-bit", 4096, HIDDEN, 3, 64, mx.bfloat16, 1, {}),
    ("5-bit", 4096, HIDDEN, 5, 64, mx.bfloat16, 1, {}),
    ("8-bit 1 pass ahead, 4 warps", 4100, HIDDEN, 8, 64, mx.bfloat16, 1, {"ahead": 1, "warps": 4}),
    ("6-bit 2 rows per warp, 3 rows", 4097, HIDDEN, 6, 64, mx.bfloat16, 3, {"rpw": 2}),
    ("4-bit 16 passes ahead, 2 rows per warp", 4099, HIDDEN, 4, 64, mx.bfloat16, 1, {"ahead": 16, "rpw": 2}),
]


def case_inputs(out_dims, in_dims, bits, group, dtype, rows, seed):
    """Random weights quantized as ``convert`` quantizes them, scaled like a layer's, and random rows."""
    key_w, key_x = mx.random.split(mx.random.key(seed))
    weight = (mx.random.normal((out_dims, in_dims), key=key_w) * in_dims**-0.5).astype(dtype)
    w, scales, biases = mx.quantize(weight, group_size=group, bits=bits)
    x = mx.random.normal((rows, 1, in_dims), key=key_x).astype(dtype)
    mx.eval(w, scales, biases, x)
    return x, w, scales, biases


def check_op(tally):
    from .. import kernel

    cases = [(label, n, k, bits, 64, mx.bfloat16, 1, {}) for label, n, k, bits in REAL] + OTHER
    for seed, (label, n, k, bits, group, dtype, rows, launch) in enumerate(cases):
        name = f"{label} {n}x{k} {bits}-bit" + (f" x{rows}" if rows > 1 else "")
        try:
            x, w, scales, biases = case_inputs(n, k, bits, group, dtype, rows, seed)
            stock = lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group, bits=bits)  # noqa: E731
            expected, again = stock(), stock()
            actual = kernel.qmv(x, w, scales, biases, bits, group, **launch)
            mx.eval(expected, again, actual)
        except Exception as exc:  # a kernel that does not build or launch is not verified
            tally.failed(name, exc)
            continue
        if not same_bits(expected, again):
            tally.inconclusive(name, "stock differs from itself")
            continue
        exact = same_bits(expected, actual)
        tally.add(name, exact, 0.0 if exact else abs_diff(expected, actual))
        del x, w, scales, biases, expected, again, actual


def check_tiny_models(tally, on_gpu):
    from mlx_vlm.models.glm5_next import language

    from glm53_patches import registry

    from .. import PATCH
    from ..linear import _replacement, switch

    # 6-bit: the kernel runs (linear.TAKES_BITS); 4-bit: every call must step aside unchanged.
    variants = [(f"{bits}-bit", bits, mx.bfloat16 if on_gpu else None) for bits in (6, 4)]
    for target in PATCH.targets:
        attr = target.rsplit(":", 1)[1]
        stock = registry.upstream(target)  # stock even while patches are applied
        compare_tiny_models(tally, language, attr, stock, _replacement(stock), lambda: switch.forcing(True),
                            variants=variants, config=tiny_model.gpu_widths() if on_gpu else None)


def verify():
    from .. import PATCH

    start = time.perf_counter()
    here = backend()
    tally = Tally()
    before = PATCH.stats.snapshot()["hits"].get("kernel", 0)
    if here == "cuda":
        check_op(tally)
    check_tiny_models(tally, here in ("cuda", "metal"))
    ran = PATCH.stats.snapshot()["hits"].get("kernel", 0) - before
    if here == "cuda" and not ran:  # equal outputs prove nothing if stock ran both times
        tally.mismatches.append("the kernel never ran in the model check")
    if here != "cuda":
        tally.notes.append(f"no CUDA here ({here}): the patch steps aside (stock code)")
    return tally.result(time.perf_counter() - start)

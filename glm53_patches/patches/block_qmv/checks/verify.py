"""``glm53-patches verify block_qmv``: the kernel against stock's block projection here.

On CUDA and Metal:

1. the op: mlx-vlm's own ``native_batch_linear`` (at widths that are a
   multiple of 512 ``singleton_quantized_linear``: MLX's gather_qmv; at
   others, on CUDA, ``exact_quantized_linear``: a one-row qmv per position)
   against ``kernel.block_qmv`` on the same random weights and inputs, stock
   run twice:
   - each projection of a GLM-5.3-Flash layer the patch takes here, at its
     real shape and bits, for a 4-position block, and the widest at 2, 3 and
     7 positions; on CUDA the 128-wide ``f_b_proj`` / ``g_b_proj`` also at 2
     and 8 positions, and other narrow widths;
   - 4-bit, float16, groups 32 and 128, 2-, 3- and 5-bit, and on CUDA other
     launch shapes (warps per block, rows per warp), which must change nothing;
2. the tiny random-weight model, bf16 at 8, 6 and 4 bits (on the CPU one
   4-bit model), with a hidden size of 512 so that the singleton path, and the
   kernel, take its projections of the hidden state (on CUDA the kernel also
   takes its narrower ones, which stock runs per position): greedy decode and
   speculative verify blocks at batch 1 and 2, every logit and the caches
   after each rollback, the kernel forced on behind ``linear`` and then behind
   ``tiled_linear``.

Every op case runs stock twice and is inconclusive where stock differs from
itself. On the CPU there is no kernel: the patch steps aside, and only check 2
runs.
"""

import time

import mlx.core as mx
import mlx.nn as nn

from glm53_patches import tiny_model
from glm53_patches.backend import current as backend
from glm53_patches.exactness import Tally, abs_diff, compare_tiny_models, same_bits
from glm53_patches.patches.exact_qmv.checks.verify import REAL

# (label, out, in, bits, group, dtype, positions, launch overrides)
OTHER = [
    ("KDA qkv_proj", 24576, 4096, 8, 64, mx.bfloat16, 2, {}),
    ("KDA qkv_proj", 24576, 4096, 8, 64, mx.bfloat16, 3, {}),
    ("KDA qkv_proj", 24576, 4096, 8, 64, mx.bfloat16, 7, {}),
    ("lm_head", 154880, 4096, 6, 64, mx.bfloat16, 7, {}),
    ("4-bit qkv_proj", 24576, 4096, 4, 64, mx.bfloat16, 4, {}),
    ("4-bit o_proj", 4096, 8192, 4, 64, mx.bfloat16, 5, {}),
    ("8-bit float16", 4096, 4096, 8, 64, mx.float16, 4, {}),
    ("4-bit float16", 4096, 4096, 4, 64, mx.float16, 3, {}),
    ("8-bit group 32", 4096, 4096, 8, 32, mx.bfloat16, 4, {}),
    ("4-bit group 128", 4096, 4096, 4, 128, mx.bfloat16, 4, {}),
    ("2-bit", 4096, 4096, 2, 64, mx.bfloat16, 4, {}),
    ("3-bit", 4096, 4096, 3, 64, mx.bfloat16, 4, {}),
    ("5-bit", 4096, 4096, 5, 64, mx.bfloat16, 4, {}),
    ("8-bit 8 warps, 1 row per warp", 4100, 4096, 8, 64, mx.bfloat16, 4, {"warps": 8, "rpw": 1}),
    ("6-bit 2 warps, 4 rows per warp", 4097, 4096, 6, 64, mx.bfloat16, 3, {"warps": 2, "rpw": 4}),
]
# CUDA only: widths stock runs as a one-row qmv per position (Metal's qmv there is not the twin's)
NARROW = [
    ("KDA f_b_proj / g_b_proj", 8192, 128, 8, 64, mx.bfloat16, 2, {}),
    ("KDA f_b_proj / g_b_proj", 8192, 128, 8, 64, mx.bfloat16, 8, {}),
    ("6-bit 768 wide", 4096, 768, 6, 64, mx.bfloat16, 5, {}),
    ("4-bit 256 wide, group 128", 4096, 256, 4, 128, mx.bfloat16, 3, {}),
    ("8-bit 128 wide float16, 8 warps", 8190, 128, 8, 64, mx.float16, 6, {"warps": 8, "rpw": 1}),
]


def case_module(out_dims, in_dims, bits, group, dtype, positions, seed):
    """A QuantizedLinear of random weights scaled like a layer's, and a random block ``[1, positions, in]``."""
    key_w, key_x = mx.random.split(mx.random.key(seed))
    layer = nn.Linear(in_dims, out_dims, bias=False)
    layer.weight = (mx.random.normal((out_dims, in_dims), key=key_w) * in_dims**-0.5).astype(dtype)
    module = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
    x = mx.random.normal((1, positions, in_dims), key=key_x).astype(dtype)
    mx.eval(module.parameters(), x)
    return module, x


def check_op(tally, backend):
    from mlx_vlm.models.linear import native_batch_linear

    from .. import kernel
    from ..linear import unsupported

    cuda = backend == "cuda"
    cases = [(label, n, k, bits, 64, mx.bfloat16, 4, {}) for label, n, k, bits in REAL if k % 512 == 0 or cuda]
    cases += OTHER + (NARROW if cuda else [])
    for seed, (label, n, k, bits, group, dtype, positions, launch) in enumerate(cases):
        if launch and backend != "cuda":
            continue  # CUDA's launch shapes
        name = f"{label} {n}x{k} {bits}-bit, {positions} positions"
        try:
            module, x = case_module(n, k, bits, group, dtype, positions, seed)
            reason = unsupported(module, x, backend)
            if reason is not None:
                raise ValueError(f"the patch would not take this call ({reason})")
            expected, again = native_batch_linear(module, x), native_batch_linear(module, x)
            actual = kernel.block_qmv(x[0], module["weight"], module["scales"], module["biases"], bits, group,
                                      backend=backend, **launch)[None]
            mx.eval(expected, again, actual)
        except Exception as exc:  # a kernel that does not build or launch is not verified
            tally.failed(name, exc)
            continue
        if not same_bits(expected, again):
            tally.inconclusive(name, "stock differs from itself")
            continue
        exact = same_bits(expected, actual)
        tally.add(name, exact, 0.0 if exact else abs_diff(expected, actual))
        del module, x, expected, again, actual


def check_tiny_models(tally, on_gpu):
    from mlx_vlm.models.glm5_next import language

    from glm53_patches import registry

    from .. import PATCH
    from ..linear import _replacement, switch

    # On a GPU bf16 at each width the kernel takes; elsewhere (stock both times) one 4-bit model.
    variants = [(f"{bits}-bit", bits, mx.bfloat16) for bits in (8, 6, 4)] if on_gpu else [("4-bit", 4, None)]
    config = {**tiny_model.gpu_widths(), "hidden_size": 512}
    for target in PATCH.targets:
        attr = target.rsplit(":", 1)[1]
        stock = registry.upstream(target)  # stock even while patches are applied
        compare_tiny_models(tally, language, attr, stock, _replacement(stock), lambda: switch.forcing(True),
                            steps=4, variants=variants, config=config, blocks=True)


def verify():
    from .. import PATCH

    start = time.perf_counter()
    here = backend()
    tally = Tally()
    before = PATCH.stats.snapshot()["hits"].get("kernel", 0)
    gpu = here in ("cuda", "metal")
    if gpu:
        check_op(tally, here)
    check_tiny_models(tally, gpu)
    ran = PATCH.stats.snapshot()["hits"].get("kernel", 0) - before
    if gpu and not ran:  # equal outputs prove nothing if stock ran both times
        tally.mismatches.append("the kernel never ran in the model check")
    if not gpu:
        tally.notes.append(f"no GPU here ({here}): the patch steps aside (stock code)")
    return tally.result(time.perf_counter() - start)

"""``glm53-patches verify expert_combine``: the kernel against stock's combine on this machine.

1. GPU: the kernel against ``SwitchGLU._combine(routed, weights, shared)`` at
   GLM-5.3-Flash's width (hidden 4096, top 8), 1, 4 and 64 rows, bf16, fp16
   and fp32, expert outputs at three scales (so sums cancel and round
   differently), router-like weights; outputs bit for bit. Then verify
   blocks of 2, 4 and 8 tokens at batch 2 with the hyper-connection residual,
   against ``_combine(..., residual)``;
2. the tiny random-weight model (fp32 and 4-bit), greedy decode batch 1
   and 2, and speculative verify blocks, with the kernel forced on against
   stock: logits of every step and block, and the caches, bit for bit.

On the CPU there is no kernel: the patch steps aside, and only check 2 runs.
"""

import mlx.core as mx

from glm53_patches.exactness import verify_gpu_kernel

HIDDEN, TOP_K, HC = 4096, 8, 4


def check_kernel(tally, backend):
    from mlx_vlm.models.deepseek_v4.hyper_connection import hc_expand
    from mlx_vlm.models.switch_layers import SwitchGLU

    from ..kernel import expert_combine

    key = iter(mx.random.split(mx.random.key(11), 160))
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for rows in (1, 4, 64):
            for spread in (0.01, 1.0, 30.0):
                routed = (spread * mx.random.normal((rows, 1, TOP_K, HIDDEN), key=next(key))).astype(dtype)
                shared = (spread * mx.random.normal((rows, 1, HIDDEN), key=next(key))).astype(dtype)
                weights = 2.5 * mx.softmax(mx.random.normal((rows, 1, TOP_K), key=next(key)), axis=-1)
                expected = SwitchGLU._combine(routed, weights, shared)
                got = expert_combine(routed, weights, shared, backend=backend)
                tally.compare(f"kernel {dtype} rows {rows} scale {spread}", [expected], [got])
        # Verify blocks at batch 2, with the hyper-connection residual they bring.
        for length in (2, 4, 8):
            routed = mx.random.normal((2, length, TOP_K, HIDDEN), key=next(key)).astype(dtype)
            shared = mx.random.normal((2, length, HIDDEN), key=next(key)).astype(dtype)
            weights = 2.5 * mx.softmax(mx.random.normal((2, length, TOP_K), key=next(key)), axis=-1)
            residual = (
                mx.random.normal((2, length, HC, HIDDEN), key=next(key)).astype(dtype),
                2 * mx.sigmoid(mx.random.normal((2, length, HC), key=next(key))),
                mx.softmax(mx.random.normal((2, length, HC, HC), key=next(key)), axis=-1),
            )
            expected = SwitchGLU._combine(routed, weights, shared, residual)
            got = hc_expand(expert_combine(routed, weights, shared, backend=backend), *residual)
            tally.compare(f"kernel {dtype} block of {length} B=2 with residual", [expected], [got])


def verify():
    from mlx_vlm.models.switch_layers import MoE

    from .. import PATCH
    from ..combine import make_call, switch

    return verify_gpu_kernel(PATCH, check_kernel, MoE, make_call, switch, blocks=True)

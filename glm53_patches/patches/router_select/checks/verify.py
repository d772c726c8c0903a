"""``glm53-patches verify router_select``: the kernel against stock's router on this machine.

1. GPU: the kernel against the stock ``_expert_select`` (module's own,
   ``mx.compile``d) at GLM-5.3-Flash's router (288 experts, top 8, scaling
   2.5, normalised), 1, 8 and 2,048 rows; logits at three scales (the widest
   saturates the sigmoid at 1.0, so many scores tie), all-negative rows
   (every picked score under 0.5, where exp's last bits show), rows of repeated
   values (exact ties), rows holding NaN. Indices (with their order) and
   weights compared bit for bit. If the default order fails, the other one
   is tried and the note says which order this MLX uses;
2. the tiny random-weight model (fp32 and 4-bit), greedy decode batch 1
   and 2, with the kernel forced on against the stock router: logits of every
   step bit for bit.

On the CPU there is no kernel: the patch steps aside, and only check 2 runs
(it shows the wrapper hands every call to stock unchanged).
"""

import mlx.core as mx

from glm53_patches.exactness import same_bits, verify_gpu_kernel

EXPERTS, TOP_K, SCALE = 288, 8, 2.5


def _logit_cases():
    """(name, logits [R, E] float32)."""
    key = iter(mx.random.split(mx.random.key(53), 16))
    for rows in (1, 8, 2048):
        for spread in (0.5, 3.0, 20.0):
            yield f"{rows} rows, logits N(0, {spread})", spread * mx.random.normal((rows, EXPERTS), key=next(key))
    # Every score picked below 0.5: there the sigmoid's exp is not hidden by 1 - y (an exp spelled
    # differently from stock's precise one shows in the weights; the host emulation found this).
    yield "8 rows, all logits negative", -1.0 - mx.abs(2.0 * mx.random.normal((8, EXPERTS), key=next(key)))
    values = mx.random.normal((8, 12), key=next(key))
    yield "8 rows of 24-fold repeated values", mx.repeat(values, 24, axis=1)
    nan = mx.random.normal((4, EXPERTS), key=next(key))
    nan = mx.where((mx.arange(EXPERTS) % 37 == 5) & (mx.arange(4)[:, None] < 2), mx.nan, nan)
    yield "4 rows, NaN in 2", mx.where(mx.arange(4)[:, None] == 3, mx.nan, nan)


def check_kernel(tally, backend):
    from mlx_vlm.models.glm5_next import language as _lang

    from ..kernel import DEFAULT_ORDER, router_select

    bias = 0.1 * mx.random.normal((EXPERTS,), key=mx.random.key(7))
    tied_bias = mx.zeros((EXPERTS,))
    default = DEFAULT_ORDER[backend]
    other_matches = []
    for name, logits in _logit_cases():
        for label, b in (("bias", bias), ("zero bias", tied_bias)):
            expected = list(_lang._expert_select(logits, b, TOP_K, 1, 1, SCALE, True))
            got = list(router_select(logits, b, TOP_K, True, SCALE, backend=backend, order=default))
            if not tally.compare(f"kernel {name}, {label}", expected, got):
                other = list(router_select(logits, b, TOP_K, True, SCALE, backend=backend, order=1 - default))
                mx.eval(other)
                if all(same_bits(e, o) for e, o in zip(expected, other)):
                    other_matches.append(f"{name}, {label}")
    if other_matches:
        tally.notes.append(f"ORDER {1 - default} matched where ORDER {default} did not: {other_matches[:3]}")


def verify():
    from mlx_vlm.models.glm5_next.language import MoEGate

    from .. import PATCH
    from ..gate import make_call, switch

    return verify_gpu_kernel(PATCH, check_kernel, MoEGate, make_call, switch, blocks=True)

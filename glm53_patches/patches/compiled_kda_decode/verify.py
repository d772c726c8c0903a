"""``glm53-patches verify compiled_kda_decode``: bitwise check on this backend.

The traced graph is compiled to backend-specific fused kernels (C++ on CPU,
Metal or CUDA source on GPUs), so exactness is a property of the backend:
math mode, FMA contraction and constant printing all live there. This runs
stock and patched decode side by side on one small KDA layer per case and
compares output, conv window and recurrent state bit for bit at every step.
"""

import mlx.core as mx
import mlx.nn as nn

STEPS = 16


def _layer(dtype, bits, seed):
    from mlx.utils import tree_map
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    config = TextConfig(
        hidden_size=256,
        num_hidden_layers=4,
        linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4},
    )
    layer = Glm5NextLinearAttention(config)
    mx.random.seed(seed)
    layer.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), layer.parameters()))
    if bits:
        nn.quantize(layer, group_size=64, bits=bits)
    if dtype != mx.float32:
        layer.set_dtype(dtype)
    layer.eval()
    return layer


def _bits(a):
    return a.view({4: mx.uint32, 2: mx.uint16}[a.itemsize])


def verify():
    from mlx_vlm.models.cache import ArraysCache

    from glm53_patches import registry

    from . import PATCH
    from .step import make_call

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    fast = make_call(stock)
    cases, worst, failures, unstable = 0, 0.0, [], []
    for dtype in (mx.float32, mx.bfloat16):
        for bits in (None, 4):
            for padding in (None, [0, 2, 7]):
                layer = _layer(dtype, bits, seed=cases)
                batch = 1 if padding is None else len(padding)
                name = f"{dtype} bits={bits} pad={padding}"
                # stock, stock again (the control: is stock itself repeatable here?), patched
                caches = [ArraysCache(2, left_padding=padding) for _ in range(3)]
                prompt = mx.random.normal((batch, 5, 256)).astype(dtype)
                for cache in caches:
                    stock(layer, prompt, cache.make_mask(5), cache)
                first = {}
                for step in range(STEPS):
                    x = mx.random.normal((batch, 1, 256)).astype(dtype)
                    a = stock(layer, x, caches[0].make_mask(1), caches[0])
                    again = stock(layer, x, caches[1].make_mask(1), caches[1])
                    b = fast(layer, x, caches[2].make_mask(1), caches[2])
                    for what, ref, other, got in (("output", a, again, b), ("conv", caches[0][0], caches[1][0], caches[2][0]),
                                                  ("state", caches[0][1], caches[1][1], caches[2][1])):
                        if "control" not in first and not mx.array_equal(_bits(ref), _bits(other)).item():
                            first["control"] = f"{name}: stock run twice differs in {what} at step {step}"
                        if not mx.array_equal(_bits(ref), _bits(got)).item():
                            worst = max(worst, mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
                            first.setdefault("patch", f"{name}: {what} at step {step}")
                if "patch" in first:
                    failures.append(first["patch"])
                if "control" in first:
                    unstable.append(first["control"])
                cases += 1
    detail = f"{STEPS} decode steps per case (fp32/bf16 x dense/4-bit x batch 1/batch 3 masked)"
    if failures:
        detail += f"; {len(failures)} case(s) differ, first mismatch each: " + "; ".join(failures)
    if unstable:
        detail += "; NOTE stock is not repeatable on this backend: " + "; ".join(unstable)
    return {"exact": not failures, "max_abs_diff": worst, "cases": cases, "detail": detail}

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
    cases, worst, failures = 0, 0.0, []
    for dtype in (mx.float32, mx.bfloat16):
        for bits in (None, 4):
            for padding in (None, [0, 2, 7]):
                layer = _layer(dtype, bits, seed=cases)
                batch = 1 if padding is None else len(padding)
                caches = [ArraysCache(2, left_padding=padding) for _ in range(2)]
                prompt = mx.random.normal((batch, 5, 256)).astype(dtype)
                for cache in caches:
                    stock(layer, prompt, cache.make_mask(5), cache)
                for step in range(STEPS):
                    x = mx.random.normal((batch, 1, 256)).astype(dtype)
                    a = stock(layer, x, caches[0].make_mask(1), caches[0])
                    b = fast(layer, x, caches[1].make_mask(1), caches[1])
                    for ref, got in ((a, b), (caches[0][0], caches[1][0]), (caches[0][1], caches[1][1])):
                        if not mx.array_equal(_bits(ref), _bits(got)).item():
                            diff = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
                            worst = max(worst, diff)
                            failures.append(f"{dtype} bits={bits} pad={padding} step {step}")
                cases += 1
    detail = f"{STEPS} decode steps per case (fp32/bf16 x dense/4-bit x batch 1/batch 3 masked)"
    if failures:
        detail += f"; first mismatch: {failures[0]}"
    return {"exact": not failures, "max_abs_diff": worst, "cases": cases, "detail": detail}

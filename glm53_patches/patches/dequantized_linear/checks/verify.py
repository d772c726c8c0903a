"""``glm53-patches verify dequantized_linear``: dequantize + matmul against quantized_matmul on this machine.

1. Every dense quantized projection of a GLM-5.3-Flash model built at the real
   widths (the synthetic checkpoint's recipe: KDA 8-bit, the rest 6-bit, group
   64; dense-MLP, DSA and KDA layers and lm_head), bf16, as ``linear`` meets it
   at prefill, over the rows the patch takes: the threshold in force
   (GLM53_DEQUANTIZED_LINEAR_MIN_TOKENS, default 1,024), a ragged chunk above
   it, a batch of two rows at it, 2,048 and 4,096; then float16, and group
   sizes 32 and 128, on the narrowest and the widest taken (the narrower ones
   stay stock's and are listed in the notes). On the CPU the small preset's widths,
   float32 (the only dtype the patch takes there).
2. The tiny random-weight model, quantized to 4, 6 and 8 bits (bf16 at widths
   of 128 on a GPU, float32 on the CPU), batch 1 and 2: prefill with the
   patch's threshold and narrowest widths lifted so its 40-token prompt
   dequantizes (a check of the wiring: caches, batches, greedy steps), then 16
   greedy steps; logits of every step bit for bit, and the dequantized path
   must have run.
"""

import contextlib
import time

import mlx.core as mx
import mlx.nn as nn

from glm53_patches import tiny_model
from glm53_patches.exactness import Tally, compare_tiny_models
from glm53_patches.registry import backend


def model_projections(on_gpu):
    """One ``nn.QuantizedLinear`` per distinct (out, in, bits, group) of a 5-layer synthetic
    GLM-5.3-Flash (layers 0-2 dense MLP, 3 DSA, 4 KDA; 8 experts), with its path."""
    from glm53_patches.bench import synthetic

    config = synthetic.text_config("real" if on_gpu else "small", layers=5, experts=8)
    model = synthetic.build(config, dtype=mx.bfloat16 if on_gpu else mx.float32)
    seen = {}
    for path, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            out_dims, packed = module["weight"].shape
            seen.setdefault((out_dims, packed * 32 // module.bits, module.bits, module.group_size), (path, module))
    return [seen[key] for key in sorted(seen)]


def requantized(module, dtype, group_size):
    """``module``'s weight dequantized and quantized again at ``group_size``, scales in ``dtype``."""
    weight = mx.dequantize(module["weight"], module["scales"], module["biases"],
                           group_size=module.group_size, bits=module.bits)
    other = nn.QuantizedLinear(weight.shape[1], weight.shape[0], bias=False, group_size=group_size, bits=module.bits)
    other.weight, other.scales, other.biases = mx.quantize(weight, group_size=group_size, bits=module.bits)
    other.update({k: other[k].astype(dtype) for k in ("scales", "biases")})
    mx.eval(other.parameters())
    return other


def in_dims(module):
    return module["weight"].shape[1] * 32 // module.bits


def compare(tally, label, module, shape, dtype, key):
    """One call, stock against the patch's path (forced on, its rows threshold as configured)."""
    from ..linear import project, switch

    x = mx.random.normal((*shape, in_dims(module)), key=key).astype(dtype)
    expected = module(x)
    with switch.forcing(True):
        got = project(module, x)
    if got is None:
        tally.add(label, False, why="the patch did not take this call")
    else:
        tally.compare(label, [expected], [got])


def check_projections(tally, on_gpu):
    from ..linear import min_tokens, unsupported

    here, dtype = backend(), mx.bfloat16 if on_gpu else mx.float32
    rows = min_tokens()
    shapes = [(1, rows), (1, rows + 476), (2, rows), (1, 2048), (1, 4096)]
    taken = []
    for path, module in model_projections(on_gpu):
        name = f"{path} {module['weight'].shape[0]}x{in_dims(module)} {module.bits}-bit"
        if unsupported(module, mx.zeros((1, rows, in_dims(module)), dtype=dtype), here) == "narrow projection":
            tally.notes.append(f"{name} not taken (narrow)")
            continue
        taken.append((path, module))
        key = iter(mx.random.split(mx.random.key(len(taken)), len(shapes)))
        for shape in shapes:
            compare(tally, f"{name}, {shape[0]}x{shape[1]} rows", module, shape, dtype, next(key))
    others = [(mx.float16, 64), (dtype, 32), (dtype, 128)] if on_gpu else [(dtype, 32), (dtype, 128)]
    key = iter(mx.random.split(mx.random.key(99), 2 * len(others)))
    for path, module in (taken[0], taken[-1]):
        for other_dtype, group in others:
            other = requantized(module, other_dtype, group)
            label = f"{path} {module.bits}-bit, {other_dtype}, group {group}, 2048 rows"
            compare(tally, label, other, (1, 2048), other_dtype, next(key))


@contextlib.contextmanager
def _forced_below_the_tiny_prompt():
    """The fast path on, with a threshold the tiny model's 40-token prompt passes and no narrowest width."""
    from .. import linear

    saved = linear.min_tokens.value, linear.NARROWEST
    linear.min_tokens.value, linear.NARROWEST = 16, {}
    try:
        with linear.switch.forcing(True):
            yield
    finally:
        linear.min_tokens.value, linear.NARROWEST = saved


def check_tiny_models(tally, on_gpu):
    from mlx_vlm.models.glm5_next import language

    from glm53_patches import registry
    # The tiny model at widths MLX's CUDA quantized_matmul has kernels for (tiny_model.gpu_widths).

    from .. import PATCH, linear

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    variants = [(f"{bits}-bit", bits, mx.bfloat16 if on_gpu else None) for bits in (4, 6, 8)]
    compare_tiny_models(tally, language, "linear", stock, linear.make_linear(stock), _forced_below_the_tiny_prompt,
                        variants=variants, config=tiny_model.gpu_widths() if on_gpu else None)


def verify():
    from .. import PATCH

    start = time.perf_counter()
    on_gpu = backend() in ("cuda", "metal")
    tally = Tally()
    check_projections(tally, on_gpu)
    before = PATCH.stats.snapshot()["hits"].get("dequantized", 0)
    check_tiny_models(tally, on_gpu)
    if PATCH.stats.snapshot()["hits"].get("dequantized", 0) == before:  # equal outputs prove nothing then
        tally.mismatches.append("the dequantized path never ran in the model check")
    return tally.result(time.perf_counter() - start)

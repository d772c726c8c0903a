"""``glm53-patches verify dequantized_experts``: dequantize + gather_mm against gather_qmm on this machine.

1. One projection, as ``SwitchGLU`` calls it at prefill (rows sorted by
   expert): stock's ``QuantizedSwitchLinear`` against stock's
   ``SwitchLinear`` over the dequantized weight, 4- and 8-bit, a full
   2,048-token chunk and a ragged 300-token one, each of the three
   projection shapes. GPU: GLM-5.3-Flash's widths (hidden 4096, expert
   width 2048, 64 experts, top 8), bf16. CPU: narrower, fp32 (MLX's CPU
   backend has no bf16 gather_mm).
2. GLM-5.3-Flash's 288 experts (GPU; CPU: 16) through ``dequantized`` as served
   (on CUDA split, ``SplitSwitchLinear``), and split at 100 (CPU: 9) per call.
3. The tiny random-weight model, quantized (4- and 8-bit; bf16 on a GPU,
   fp32 on the CPU), batch 1 and 2: prefill with the patch's threshold
   lowered so its 40-token prompt dequantizes, then 16 greedy steps;
   logits of every step bit for bit, and the dequantized path must have run.
   On a GPU the tiny model is widened (``GPU_WIDTHS``).
"""

import contextlib
import time

import mlx.core as mx
import mlx.nn as nn

from glm53_patches import tiny_model
from glm53_patches.exactness import Tally, compare_tiny_models
from glm53_patches.registry import backend

WIDTHS = {"gpu": (4096, 2048, 64, 8, mx.bfloat16), "cpu": (512, 256, 16, 4, mx.float32)}


def check_projections(tally, on_gpu):
    from mlx_vlm.models.switch_layers import SwitchLinear

    from ..experts import dequantized

    hidden, width, experts, top_k, dtype = WIDTHS["gpu" if on_gpu else "cpu"]
    key = iter(mx.random.split(mx.random.key(7), 64))
    for bits in (4, 8):
        for rows_in, rows_out in ((hidden, width), (width, hidden)):  # gate/up, down
            stock = SwitchLinear(rows_in, rows_out, experts).to_quantized(group_size=64, bits=bits)
            stock.update({k: v.astype(dtype) for k, v in stock.parameters().items() if k in ("scales", "biases")})
            for tokens in (2048, 300):
                rows = tokens * top_k
                idx = mx.sort(mx.random.randint(0, experts, (rows,), key=next(key)))
                x = mx.random.normal((rows, 1, rows_in), key=next(key)).astype(dtype)
                expected = stock(x, idx, sorted_indices=True)
                got = dequantized(stock)(x, idx, sorted_indices=True)
                tally.compare(f"{bits}-bit {experts}x{rows_out}x{rows_in}, {tokens} tokens", [expected], [got])


def quantized_experts(experts, rows_in, rows_out, dtype, key):
    """Stock's 4-bit ``QuantizedSwitchLinear`` over random weights, quantized 32 experts at a
    time: its own initializer draws all of them in float32 first (9.7 GB at 288 experts)."""
    from mlx_vlm.models.switch_layers import QuantizedSwitchLinear

    bound, parts, starts = rows_in ** -0.5, [], range(0, experts, 32)
    for start, part_key in zip(starts, mx.random.split(key, len(starts))):
        w = mx.random.uniform(-bound, bound, (min(32, experts - start), rows_out, rows_in), key=part_key)
        parts.append(mx.quantize(w, group_size=64, bits=4))
        mx.eval(parts[-1])
    linear = QuantizedSwitchLinear.__new__(QuantizedSwitchLinear)
    nn.Module.__init__(linear)
    linear.weight, linear.scales, linear.biases = (mx.concatenate(p) for p in zip(*parts))
    linear.scales, linear.biases = linear.scales.astype(dtype), linear.biases.astype(dtype)
    linear.group_size, linear.bits, linear.mode = 64, 4, "affine"
    return linear


def check_split(tally, on_gpu):
    """GLM-5.3-Flash's 288 experts (GPU; 16 on the CPU), 4-bit, a 2,048-token chunk: what
    ``dequantized`` returns there (on CUDA a ``SplitSwitchLinear``: one sorted gather_mm would
    overflow), and the split forced (100 experts per call; CPU 9), against gather_qmm."""
    from mlx_vlm.models.switch_layers import SwitchLinear

    from ..experts import SplitSwitchLinear, dequantized

    hidden, width, _, top_k, dtype = WIDTHS["gpu" if on_gpu else "cpu"]
    experts = 288 if on_gpu else 16
    key = iter(mx.random.split(mx.random.key(11), 8))
    for rows_in, rows_out in ((hidden, width), (width, hidden)):
        stock = quantized_experts(experts, rows_in, rows_out, dtype, next(key))
        idx = mx.sort(mx.random.randint(0, experts, (2048 * top_k,), key=next(key)))
        x = mx.random.normal((idx.size, 1, rows_in), key=next(key)).astype(dtype)
        expected = stock(x, idx, sorted_indices=True)
        served = dequantized(stock)
        forced = SwitchLinear.__new__(SplitSwitchLinear)  # over the same dequantized weight
        nn.Module.__init__(forced)
        # A last call smaller than the others, starting off its own multiple: MLX's CPU gather
        # wraps an index past the slice, which would hide a missing `- lo` in equal calls.
        forced.weight, forced.experts_per_call = served.weight, 100 if on_gpu else 9
        name = f"4-bit {experts}x{rows_out}x{rows_in}, 2048 tokens"
        tally.compare(f"{name} ({type(served).__name__})", [expected], [served(x, idx, sorted_indices=True)])
        tally.compare(f"{name} (split by {forced.experts_per_call})", [expected], [forced(x, idx, sorted_indices=True)])
        del stock, served, forced


@contextlib.contextmanager
def _forced_below_the_tiny_prompt():
    """The fast path on, with a threshold the tiny model's 40-token prompt passes."""
    from .. import experts

    saved, experts.min_tokens.value = experts.min_tokens.value, 16
    try:
        with experts.switch.forcing(True):
            yield
    finally:
        experts.min_tokens.value = saved


def check_tiny_models(tally, on_gpu):
    from mlx_vlm.models.switch_layers import MoE

    from glm53_patches import registry

    from .. import PATCH, experts

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    variants = [(f"{bits}-bit", bits, mx.bfloat16 if on_gpu else None) for bits in (4, 8)]
    compare_tiny_models(tally, MoE, "__call__", stock, experts.make_call(stock), _forced_below_the_tiny_prompt,
                        variants=variants, config=tiny_model.gpu_widths() if on_gpu else None)


def verify():
    from .. import PATCH

    start = time.perf_counter()
    on_gpu = backend() in ("cuda", "metal")
    tally = Tally()
    before = PATCH.stats.snapshot()["hits"].get("dequantized", 0)
    check_projections(tally, on_gpu)
    check_split(tally, on_gpu)
    check_tiny_models(tally, on_gpu)
    if PATCH.stats.snapshot()["hits"].get("dequantized", 0) == before:  # equal outputs prove nothing then
        tally.mismatches.append("the dequantized path never ran in the model check")
    return tally.result(time.perf_counter() - start)

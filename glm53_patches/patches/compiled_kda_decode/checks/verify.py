"""``glm53-patches verify compiled_kda_decode``: bitwise check on this backend.

The traced graph is compiled to backend-specific fused kernels (C++ on CPU,
Metal or CUDA source on GPUs), so exactness is a property of the backend:
math mode, FMA contraction and constant printing all live there. This runs
stock and patched decode side by side on one small KDA layer per case and
compares output, conv window and recurrent state bit for bit at every step.
The verify-block cases run speculative blocks of 2 to 8 tokens instead, each
committed with an accepted prefix per row, and compare after every commit.
Each case also runs stock twice: where stock differs from itself (seen on
CUDA with MLX 0.32.4, fp32 4-bit weights at batch 3), the comparison proves
nothing, and the case is reported as inconclusive rather than as a failure.
"""

import time

import mlx.core as mx
import mlx.nn as nn

from glm53_patches.exactness import Tally, same_bits

STEPS = 16


SMALL = (256, 4, 64)  # hidden size, heads, head dim


def _layer(dtype, bits, seed, dims=SMALL):
    from mlx.utils import tree_map
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    hidden, heads, head_dim = dims
    config = TextConfig(
        hidden_size=hidden,
        num_hidden_layers=4,
        linear_attn_config={"head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4},
    )
    layer = Glm5NextLinearAttention(config)
    mx.random.seed(seed)
    layer.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), layer.parameters()))
    if bits:
        nn.quantize(layer, group_size=64, bits=bits)
    if dtype != mx.float32:  # as mlx-vlm's convert stores it: A_log and dt_bias stay float32
        gate_params = layer.A_log, layer.dt_bias
        layer.set_dtype(dtype)
        layer.A_log, layer.dt_bias = gate_params
    layer.eval()
    return layer


def check_case(stock, fast, dtype, bits, padding, seed, dims=SMALL, blocks=False):
    """One case: {"patch": first mismatch, "control": first stock-vs-stock difference, "worst": max |d|}.

    With ``blocks``, each step is a speculative verify block (2 to 8 tokens) and its commit.
    """
    from mlx_vlm.models.cache import ArraysCache

    layer = _layer(dtype, bits, seed=seed, dims=dims)
    hidden = dims[0]
    batch = 1 if padding is None else len(padding)
    # stock, stock again (the control: is stock itself repeatable here?), patched
    caches = [ArraysCache(2, left_padding=padding) for _ in range(3)]
    prompt = mx.random.normal((batch, 5, hidden)).astype(dtype)
    for cache in caches:
        stock(layer, prompt, cache.make_mask(5), cache)
    found = {"worst": 0.0}
    for step in range(STEPS):
        length = 2 + step % 7 if blocks else 1
        x = mx.random.normal((batch, length, hidden)).astype(dtype)
        if blocks:
            for cache in caches:
                cache.start_speculation(length)
        a = stock(layer, x, caches[0].make_mask(length), caches[0])
        again = stock(layer, x, caches[1].make_mask(length), caches[1])
        b = fast(layer, x, caches[2].make_mask(length), caches[2])
        if blocks:  # a different accepted prefix per row
            for cache in caches:
                cache.commit_speculation([(step + row) % (length + 1) for row in range(batch)])
        for what, ref, other, got in (("output", a, again, b), ("conv", caches[0][0], caches[1][0], caches[2][0]),
                                      ("state", caches[0][1], caches[1][1], caches[2][1])):
            if "control" not in found and not same_bits(ref, other):
                found["control"] = f"stock run twice differs in {what} at step {step}"
            if not same_bits(ref, got):
                found["worst"] = max(found["worst"], mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
                found.setdefault("patch", f"{what} at step {step}")
    return found


def verify():
    from glm53_patches import registry

    from .. import PATCH
    from ..step import make_call

    stock = registry.upstream(next(iter(PATCH.targets)))  # stock even while patches are applied
    fast = make_call(stock)
    tally = Tally()
    start = time.perf_counter()
    for blocks in (False, True):
        for dtype in (mx.float32, mx.bfloat16):
            for bits in (None, 4):
                for padding in (None, [0, 2, 7]):
                    name = f"{'verify blocks' if blocks else 'decode'} {dtype} bits={bits} pad={padding}"
                    found = check_case(stock, fast, dtype, bits, padding, seed=tally.cases, blocks=blocks)
                    if "control" in found:  # stock differs from itself: a comparison proves nothing
                        tally.inconclusive(name, found["control"])  # seen on CUDA (MLX 0.32.4): fp32 4-bit, batch 3
                    else:
                        tally.add(name, "patch" not in found, found["worst"], found.get("patch", ""))
    failures = [r for r in tally.records if r["result"] == "differs"]
    unstable = [r for r in tally.records if r["result"] == "inconclusive"]
    detail = (f"{STEPS} decode steps or speculative verify blocks (2-8 tokens, committed in part) per case "
              "(fp32/bf16 x dense/4-bit x batch 1/batch 3 masked)")
    if failures:
        detail += f"; {len(failures)} case(s) differ, first mismatch each: " + "; ".join(
            f"{r['case']}: {r['where']}" for r in failures)
    if unstable:
        detail += f"; {len(unstable)} case(s) inconclusive, stock not repeatable here: " + "; ".join(
            f"{r['case']}: {r['why']}" for r in unstable)
    return tally.result(time.perf_counter() - start, detail)

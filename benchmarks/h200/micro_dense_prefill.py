"""dequantized_linear per projection: every dense quantized projection of a real-width
GLM-5.3-Flash (the synthetic recipe: KDA 8-bit, the rest 6-bit, group 64, bf16), as ``linear``
meets it at prefill, stock's quantized_matmul against dequantize + matmul, at chunks of 256,
1,024 and 2,048 tokens; interleaved, median of ROUNDS, with the number of differing outputs.

    python benchmarks/h200/micro_dense_prefill.py [--out F.json]   (MICRO_SMALL=1: a CPU dry run)
"""

import argparse
import json
import os

import mlx.core as mx
from micro import interleaved

from glm53_patches.patches.dequantized_linear import linear
from glm53_patches.patches.dequantized_linear.checks.verify import model_projections

ON_GPU, TOKENS, ROUNDS = True, (256, 1024, 2048), 7
if os.environ.get("MICRO_SMALL"):  # small widths, float32
    ON_GPU, TOKENS, ROUNDS = False, (256,), 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    linear.min_tokens.value = 1
    results = {}
    with linear.switch.forcing(True):
        for path, module in model_projections(ON_GPU):
            width = module["weight"].shape[1] * 32 // module.bits
            for tokens in TOKENS:
                x = mx.random.normal((1, tokens, width), key=mx.random.key(tokens)).astype(module["scales"].dtype)
                mx.eval(x)
                arms = {"stock": lambda: module(x), "dequantized": lambda: linear.project(module, x)}
                ms = interleaved(arms, ROUNDS)
                ref, got = (fn() for fn in arms.values())
                name = f"{path} {module['weight'].shape[0]}x{width} {module.bits}-bit, {tokens} tokens"
                s, d = ms["stock"]["median"], ms["dequantized"]["median"]
                results[name] = {"outputs_differing": int((ref != got).sum().item()), "ratio": s / d, "ms": ms}
                print(f"{name}: stock {s:.3f} ms, dequantized {d:.3f} ms ({s / d:.2f}x), "
                      f"differing {results[name]['outputs_differing']}", flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

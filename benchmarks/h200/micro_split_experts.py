"""dequantized_experts at GLM-5.3-Flash's 288 experts: one routed projection (4-bit, group 64,
bf16, a 2,048-token chunk, top-8 routes sorted as SwitchGLU sorts them) as stock's gather_qmm
against ``dequantized`` (on CUDA a SplitSwitchLinear: sorted gather_mm in calls of at most 128
experts), interleaved, median of ROUNDS, with the number of differing outputs.

    python benchmarks/h200/micro_split_experts.py [--out F.json]
"""

import argparse
import json
import os

import mlx.core as mx
from micro import interleaved
from mlx_vlm.models.switch_layers import SwitchLinear

from glm53_patches.patches.dequantized_experts.experts import dequantized

EXPERTS, HIDDEN, WIDTH, TOP_K, TOKENS, ROUNDS, DTYPE = 288, 4096, 2048, 8, 2048, 7, mx.bfloat16
if os.environ.get("MICRO_SMALL"):  # a CPU dry run: narrow, fp32 (the CPU has no bf16 gather_mm)
    HIDDEN, WIDTH, TOKENS, ROUNDS, DTYPE = 256, 128, 256, 2, mx.float32


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    results = {}
    for rows_in, rows_out in ((HIDDEN, WIDTH), (WIDTH, HIDDEN)):
        stock = SwitchLinear(rows_in, rows_out, EXPERTS).to_quantized(group_size=64, bits=4)
        stock.update({k: v.astype(DTYPE) for k, v in stock.parameters().items() if k in ("scales", "biases")})
        idx = mx.sort(mx.random.randint(0, EXPERTS, (TOKENS * TOP_K,), key=mx.random.key(3)))
        x = mx.random.normal((idx.size, 1, rows_in), key=mx.random.key(4)).astype(DTYPE)
        mx.eval(stock.parameters(), idx, x)
        arms = {"stock gather_qmm": lambda: stock(x, idx, sorted_indices=True),
                "dequantized": lambda: dequantized(stock)(x, idx, sorted_indices=True)}
        ref, got = (fn() for fn in arms.values())
        name = f"{EXPERTS}x{rows_out}x{rows_in}"
        results[name] = {"class": type(dequantized(stock)).__name__,
                         "outputs_differing": int((ref != got).sum().item()), "nans": int(mx.isnan(got).sum().item()),
                         "ms": interleaved(arms, ROUNDS)}
        print(name, json.dumps(results[name]), flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

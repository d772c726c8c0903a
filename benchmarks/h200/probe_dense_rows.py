"""Does dequantized_linear stay bit-identical at every row count it takes, not only at the ones its
`verify` checks? Every dense projection of a real-width GLM-5.3-Flash (the patch's verify model),
bf16, at each row count from the patch's threshold to 4,096 in steps of STEP: stock's
quantized_matmul against the patch's path, untimed. Prints the (projection, rows) that differ: on
CUDA a GEMM heuristic that splits K at some row count would show here (s30 saw it below 1,024).

    python benchmarks/h200/probe_dense_rows.py [--step 64] [--out F.json]   (MICRO_SMALL=1: CPU dry run)
"""

import argparse
import json
import os

import mlx.core as mx

from glm53_patches.backend import current as backend
from glm53_patches.exactness import same_bits
from glm53_patches.patches.dequantized_linear import linear
from glm53_patches.patches.dequantized_linear.checks.verify import in_dims, model_projections


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--step", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    on_gpu = not os.environ.get("MICRO_SMALL")
    here, dtype = backend(), mx.bfloat16 if on_gpu else mx.float32
    first = linear.min_tokens()
    differing, compared, skipped = [], 0, []
    with linear.switch.forcing(True):
        for path, module in model_projections(on_gpu):
            width = in_dims(module)
            if linear.unsupported(module, mx.zeros((1, first, width), dtype=dtype), here) is not None:
                skipped.append(path)
                continue
            for rows in range(first, 4097, a.step):
                x = mx.random.normal((1, rows, width), key=mx.random.key(rows)).astype(dtype)
                stock, got = module(x), linear.project(module, x)
                compared += 1
                if not same_bits(stock, got):
                    differing.append((path, rows, int((stock != got).sum().item())))
                    print("DIFFERS", path, rows, differing[-1][2], flush=True)
    print(f"{compared} calls compared, {len(differing)} differ; not taken: {', '.join(skipped)}", flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps({"compared": compared, "differing": differing, "not_taken": skipped}, indent=1))


if __name__ == "__main__":
    main()

"""The numerics-changing prefill patches' quality gate, on this machine's backend: teacher-forced logits of
the tiny glm5_next (2 x 300 tokens; the indexer selects 64 of up to 300 keys) with each patch, and all of
them together, against stock on the same backend. Prints KL(stock || patch) mean and max, top-1 agreement,
and the largest logit difference; fp32, and on a GPU bf16 as served (fp32 weights cast, float32 paths kept).

    python benchmarks/h200/quality_changing.py [--out F.json]
"""

import argparse
import json

import mlx.core as mx
import numpy as np

import glm53_patches
from glm53_patches.backend import current
from glm53_patches.exactness import _served_dtype, logit_gate
from glm53_patches.tiny_model import build_model

ARMS = (["kda_prefill_kernel"], ["latent_prefill"], ["batched_experts"],
        ["kda_prefill_kernel", "latent_prefill", "batched_experts"])


def f64(a):
    return np.array(a.astype(mx.float32)).astype(np.float64)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    results = []
    models = (("fp32", None),) + ((("bf16", mx.bfloat16),) if current() != "cpu" else ())  # CPU: no bf16 gather_mm
    for label, dtype in models:
        model = build_model(seed=0)
        lm = (_served_dtype(model, dtype) if dtype else model).language_model
        mx.random.seed(0)
        tokens = mx.random.randint(0, 512, (2, 300))
        ref = f64(lm(tokens, cache=lm.make_cache()).logits)
        for names in ARMS:
            glm53_patches.enable(names, strict=True)
            got = f64(lm(tokens, cache=lm.make_cache()).logits)
            glm53_patches.disable(names)
            row = {"model": label, "patches": "+".join(names), **logit_gate(ref, got),
                   "max_abs_diff": float(np.abs(ref - got).max()), "logit_scale": float(np.abs(ref).max())}
            results.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

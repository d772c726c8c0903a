"""What a hyper-connection costs at prefill, and what hc_decode's one-launch Sinkhorn kernel would
save there (no patch takes prefill's hyper-connections yet): one HyperConnection at GLM-5.3-Flash's
width (4 streams of 4,096), bf16 input, a chunk of TOKENS, timed as

- stock: ``hc(x)`` (on CUDA: rms_norm, the float32 mix matmul, then ~80 Sinkhorn launches);
- front: the rms_norm and mix matmul alone (what the kernel path keeps);
- kernel: the front + ``hc_sinkhorn_collapse`` (GPU only), with the number of outputs that differ
  from stock's (collapsed, post, comb).

Interleaved, median of ROUNDS.    python benchmarks/h200/micro_hc_prefill.py [--out F.json]
(MICRO_SMALL=1: a CPU dry run, 256 tokens, no kernel.)
"""

import argparse
import json
import os

import mlx.core as mx
from micro import interleaved
from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
from mlx_vlm.models.glm5_next.config import TextConfig

from glm53_patches.kernels import hc_sinkhorn
from glm53_patches.patches.hc_decode.checks.verify import randomize_hyper_connection

TOKENS, ROUNDS = (2048, 4096), 7
if os.environ.get("MICRO_SMALL"):
    TOKENS, ROUNDS = (256,), 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    a = p.parse_args()
    hc = _hc.HyperConnection(TextConfig(hidden_size=4096))
    randomize_hyper_connection(hc, mx.random.key(3))
    mx.eval(hc.parameters())
    gpu = hc_sinkhorn.gpu_backend()
    results = {}
    for tokens in TOKENS:
        x = (3.0 * mx.random.normal((1, tokens, hc.hc_mult, 4096), key=mx.random.key(tokens))).astype(mx.bfloat16)
        mx.eval(x)

        def front():
            return hc._mix(mx.fast.rms_norm(x.astype(mx.float32).flatten(-2), None, hc.norm_eps))

        arms = {"stock": lambda: hc(x), "front": front}
        if gpu:
            arms["kernel"] = lambda: hc_sinkhorn.hc_sinkhorn_collapse(
                x, front(), hc.scale, hc.base, hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps)
        entry = {"ms": interleaved(arms, ROUNDS)}
        if gpu:
            entry["outputs_differing"] = [int((s != k).sum().item()) for s, k in zip(hc(x), arms["kernel"]())]
        results[tokens] = entry
        print(tokens, json.dumps(entry), flush=True)
    if a.out:
        open(a.out, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What the routed experts cost in a decode step and in a speculative verify block (issues 16 and 17).

mlx-vlm's own ``SwitchGLU`` at GLM-5.3-Flash's widths (hidden 4096, expert
width 2048, 4-bit, group 64, bf16, eval mode), 64 experts as the bench
builds them (a token reads only its top 8, so its bytes are the same as at
288). Arms, interleaved over ROUNDS rounds of REPS calls, each call with its
own random top-8 per token from a pool (so no call finds its experts in the
L2):

- ``1 token``: a decode step's call, ``[1, 1, H]``: one ``gather_qmm`` of 8
  routes per projection;
- ``block of L``: a verify block's call, ``[1, L, H]``: stock's block path,
  which (for these quantized experts, off Metal) is one ``gather_qmm`` per
  projection over the block's L x 8 routes (mlx-vlm's
  ``exact_quantized_switch_linear`` / ``exact_quantized_selected_linear``;
  this script's docstring said ``tokenwise`` until s35's run showed equal
  times, and the code agrees);
- ``L tokens, one call``: the same L x 8 routes as one ``[L, 1, H]`` call
  through the one-token path: the same call form, as a control.

Per arm: median ms per call, GB/s of the routes' weights (each route's
expert counted once per route), and ms per 45-layer step (times the MoE
layers). ``MICRO_SMALL=1`` shrinks everything for a CPU dry run.

Usage: python micro_routed_experts.py [--out FILE.json] [--blocks 2,4]
"""

import argparse
import json
import statistics

import mlx.core as mx
import mlx.nn as nn
from micro_qmv import REPS, ROUNDS, SMALL, copy_ceiling, timed
from mlx_vlm.models.switch_layers import SwitchGLU

from glm53_patches.bench.synthetic import text_config

EXPERTS, TOP_K, POOL = (8, 2, 4) if SMALL else (64, 8, 16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="micro_routed_experts.json")
    parser.add_argument("--blocks", default="2,4", help="verify block sizes (default 2,4)")
    args = parser.parse_args()
    config = text_config("small" if SMALL else "real")
    hidden, width = config.hidden_size, config.moe_intermediate_size
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    glu = SwitchGLU(hidden, width, EXPERTS)
    nn.quantize(glu, group_size=64, bits=4)
    glu.eval()  # as load_model leaves it: the block path is for eval mode only
    mx.eval(glu.parameters())
    per_route = sum(p[name].nbytes for p in (glu.gate_proj, glu.up_proj, glu.down_proj)
                    for name in ("weight", "scales", "biases")) / EXPERTS

    def inputs(tokens, i):
        x = mx.random.normal((1, tokens, hidden), key=mx.random.key(i)).astype(mx.bfloat16)
        scores = mx.random.uniform(shape=(1, tokens, EXPERTS), key=mx.random.key(1000 + i))
        return x, mx.argpartition(-scores, TOP_K - 1, axis=-1)[..., :TOP_K].astype(mx.uint32)

    arms = {"1 token": (1, lambda x, idx: glu(x, idx))}
    for block in (int(b) for b in args.blocks.split(",")):
        arms[f"block of {block}"] = (block, lambda x, idx: glu(x, idx))
        arms[f"{block} tokens, one call"] = (block, lambda x, idx: glu(x.swapaxes(0, 1), idx.swapaxes(0, 1)))
    pools = {name: [inputs(tokens, i) for i in range(POOL)] for name, (tokens, _) in arms.items()}
    mx.eval(pools)
    for name, (_, fn) in arms.items():  # compile and warm
        timed(fn, pools[name], POOL)
    times = {name: [] for name in arms}
    for r in range(ROUNDS):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[name].append(timed(arms[name][1], pools[name], REPS)[0])
    results = {"device": str(mx.default_device()), "copy_gbps": copy_ceiling(), "experts": EXPERTS,
               "top_k": TOP_K, "hidden": hidden, "width": width, "moe_layers": moe_layers,
               "bytes_per_route": per_route, "arms": {}}
    print(f"copy ceiling {results['copy_gbps']:.0f} GB/s; {moe_layers} MoE layers; "
          f"{per_route / 1e6:.1f} MB per route", flush=True)
    for name, (tokens, _) in arms.items():
        ms = statistics.median(times[name]) * 1e3
        gbps = tokens * TOP_K * per_route / (ms / 1e3) / 1e9
        results["arms"][name] = {"tokens": tokens, "ms": ms, "ms_rounds": [t * 1e3 for t in times[name]],
                                 "gbps": gbps, "ms_per_step": ms * moe_layers}
        print(f"{name:22s} {ms * 1e3:8.1f} us per call  {gbps:6.0f} GB/s  "
              f"{ms * moe_layers:6.2f} ms per {moe_layers}-layer step", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

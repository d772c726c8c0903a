"""One MoE block's routed experts at GLM-5.3-Flash's widths (hidden 4,096, expert width 2,048, top-8,
bf16 weights) for a 2,048-token prefill chunk: stock's SwitchGLU (sorted gather_mm) against
batched_experts' BatchedExperts, and the pieces of the latter, interleaved, median of ROUNDS.

    python benchmarks/h200/micro_batched_experts.py [--experts 64,288] [--out F.json]
"""

import argparse
import json
import os

import mlx.core as mx
from micro import interleaved
from mlx_vlm.models.switch_layers import SwitchGLU

from glm53_patches.patches.batched_experts import experts as batched

HIDDEN, WIDTH, TOP_K, TOKENS, ROUNDS, DTYPE = 4096, 2048, 8, 2048, 7, mx.bfloat16
if os.environ.get("MICRO_SMALL"):  # a CPU dry run: narrow, fp32 (the CPU has no bf16 gather_mm)
    HIDDEN, WIDTH, TOKENS, ROUNDS, DTYPE = 256, 128, 256, 2, mx.float32


def scatter_variant(glu, x, indices):
    """The first BatchedExperts (s22): padded rows and routed outputs through a row scatter."""
    batch, length, hidden = x.shape
    routes = indices.reshape(-1).astype(mx.int32)
    experts = glu.down_proj.num_experts
    counts = mx.zeros((experts,), dtype=mx.int32).at[routes].add(1)
    rows = counts.max().item()
    order = mx.argsort(routes)
    by_expert = routes[order]
    first = mx.cumsum(counts) - counts
    slot_sorted = by_expert * rows + mx.arange(routes.size) - first[by_expert]
    slot = mx.zeros_like(slot_sorted).at[order].add(slot_sorted)
    padded = mx.zeros((experts * rows, hidden), dtype=x.dtype)
    padded[slot] = x.reshape(-1, hidden)[mx.arange(routes.size) // indices.shape[-1]]
    padded = padded.reshape(experts, rows, hidden)
    gate, up, down = (getattr(glu, n)["weight"].swapaxes(-1, -2) for n in batched.PROJECTIONS)
    out = (glu.activation(padded @ up, padded @ gate) @ down).reshape(experts * rows, hidden)
    return out[slot].reshape(batch, length, indices.shape[-1], hidden)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--experts", default="64,288")
    p.add_argument("--out")
    a = p.parse_args()
    results = {}
    for n in [int(v) for v in a.experts.split(",")]:
        mx.random.seed(0)
        glu = SwitchGLU(HIDDEN, WIDTH, n)
        glu.set_dtype(DTYPE)
        x = mx.random.normal((1, TOKENS, HIDDEN)).astype(DTYPE)
        indices = mx.argpartition(-mx.random.normal((1, TOKENS, n)), TOP_K, axis=-1)[..., :TOP_K].astype(mx.uint32)
        mx.eval(glu.parameters(), x, indices)
        rows = int(mx.zeros((n,), dtype=mx.int32).at[indices.reshape(-1)].add(1).max().item())
        padded = mx.random.normal((n, rows, HIDDEN)).astype(DTYPE)
        up = glu.up_proj["weight"].swapaxes(-1, -2)
        arms = {
            "stock SwitchGLU (sorted gather_mm)": lambda: glu(x, indices),
            "BatchedExperts (gathers)": lambda: batched.BatchedExperts(glu)(x, indices),
            "BatchedExperts (row scatter, s22)": lambda: scatter_variant(glu, x, indices),
            "one batched projection [E, rows, 4096] @ [E, 4096, 2048]": lambda: padded @ up,
            "counts + .item()": lambda: mx.array(int(mx.zeros((n,), dtype=mx.int32).at[indices.reshape(-1)].add(1).max().item())),
            "row gather [E*rows, 4096]": lambda: x.reshape(-1, HIDDEN)[mx.arange(n * rows) % TOKENS],
        }
        ms = interleaved(arms, ROUNDS)
        ref, got = glu(x, indices), batched.BatchedExperts(glu)(x, indices)
        diff = float(mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item())
        nans = {"stock": int(mx.isnan(ref).sum().item()), "batched": int(mx.isnan(got).sum().item())}
        results[n] = {"rows": rows, "max_abs_diff_vs_stock": diff, "nan_count": nans,
                      "ms": ms}
        print(f"{n} experts, busiest {rows} rows of a mean {TOKENS * TOP_K / n:.0f}; max |diff| vs stock {diff:.3g}; NaNs {nans}")
        for k, v in ms.items():
            print(f"  {v['median']:8.2f} ms [{v['min']:.2f}-{v['max']:.2f}]  {k}", flush=True)
        if a.out:
            open(a.out, "w").write(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Stock vs chunked KDA prefill, one mixer at real widths, interleaved.

    python -m glm53_patches.patches.kda_prefill_kernel.checks.bench [--lengths 512,2048,4096]

Arms: stock (the per-token ``gated_delta_ops`` loop off Metal) and the patch
at each ``--chunks`` size. Each round runs every arm once, alternating the
order (A B C, C B A, ...); the table gives the median seconds per prefill,
stock / arm (median of per-round ratios), the min-max of those ratios, and
the arm's max |out - stock| / max |stock| as a sanity check. ``--part
recurrence`` times the recurrence alone (stock ``gated_delta_update`` vs
``chunked_gated_delta``), without projections.
"""

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def _layer(args):
    from mlx_vlm.models.glm5_next.config import TextConfig
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    config = TextConfig(  # the recurrence part only reads the gate parameters: skip big projections
        hidden_size=args.hidden if args.part == "mixer" else 128,
        linear_attn_config={"head_dim": args.head_dim, "num_heads": args.heads},
    )
    layer = Glm5NextLinearAttention(config)
    mx.random.seed(args.seed)
    params = tree_map(lambda p: 0.02 * mx.random.normal(p.shape), layer.parameters())
    params["o_norm"]["weight"] = 1.0 + params["o_norm"]["weight"]
    params["A_log"] = mx.random.uniform(0.0, 1.4, params["A_log"].shape)
    params["dt_bias"] = mx.random.uniform(-4.0, -1.0, params["dt_bias"].shape)
    layer.update(params)
    if args.bits and args.part == "mixer":
        nn.quantize(layer, group_size=64, bits=args.bits)
    layer.set_dtype(getattr(mx, args.dtype))
    layer.eval()
    mx.eval(layer.parameters())
    return layer


def _arms(args, layer):
    from mlx_vlm.models import gated_delta
    from mlx_vlm.models.cache import ArraysCache
    from mlx_vlm.models.glm5_next.language import Glm5NextLinearAttention

    from .. import chunked, mixer

    stock = Glm5NextLinearAttention.__dict__["__call__"]
    fast = mixer.make_call(stock)
    arms = {}
    if args.part == "mixer":

        def arm(call, chunk):
            def run(x):
                if chunk:  # through the patch's own knob
                    os.environ["GLM53_KDA_PREFILL_KERNEL_CHUNK"] = str(chunk)
                return call(layer, x, None, ArraysCache(2))

            return run

        arms["stock"] = arm(stock, None)
        for chunk in args.chunks:
            arms[f"chunk{chunk}"] = arm(fast, chunk)
        return arms

    lb = layer.lower_bound
    A_log = layer.A_log.reshape(layer.num_heads, 1)
    dt_bias = layer.dt_bias.reshape(layer.num_heads, layer.head_dim)

    def qkvab(x):  # deterministic synthetic recurrence inputs from x's shape
        B, T = x.shape[:2]
        shape = (B, T, layer.num_heads, layer.head_dim)
        key = mx.random.key(T)
        k1, k2, k3, k4, k5 = mx.random.split(key, 5)
        q = layer.scale**2 * mx.fast.rms_norm(mx.random.normal(shape, key=k1), None, 1e-6)
        k = layer.scale * mx.fast.rms_norm(mx.random.normal(shape, key=k2), None, 1e-6)
        dtype = x.dtype
        return [t.astype(dtype) for t in (q, k, mx.random.normal(shape, key=k3), mx.random.normal(shape, key=k4),
                                          mx.random.normal(shape[:3], key=k5))]

    def stock_rec(x):
        q, k, v, a, b = x
        return gated_delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, lower_bound=lb)[0]

    arms["stock"] = stock_rec
    for chunk in args.chunks:

        def run(x, chunk=chunk):
            q, k, v, a, b = x
            return chunked.chunked_gated_delta(
                q, k, v, chunked.log_gate(A_log, a, dt_bias, lb), mx.sigmoid(b), None,
                chunk=chunk, sub=chunked.sub_block(chunk, lb),
            )[0]

        arms[f"chunk{chunk}"] = run
    arms["_inputs"] = qkvab
    return arms


def measure(args):
    layer = _layer(args)
    arms = _arms(args, layer)
    make_inputs = arms.pop("_inputs", None)
    names = list(arms)
    rows = []
    for length in args.lengths:
        hidden = args.hidden if args.part == "mixer" else 128
        x = mx.random.normal((args.batch, length, hidden)).astype(getattr(mx, args.dtype))
        if make_inputs is not None:
            x = make_inputs(x)
        mx.eval(x)
        outputs = {}
        for name in names:  # warm-up (compiles, allocations) and outputs for the check
            outputs[name] = arms[name](x)
            mx.eval(outputs[name])
        ref = outputs["stock"].astype(mx.float32)
        scale = mx.abs(ref).max().item()
        times = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                mx.eval(arms[name](x))
                times[name].append(time.perf_counter() - start)
            print(f"  T={length} round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names),
                  file=sys.stderr)
        for name in names:
            ratios = [s / t for s, t in zip(times["stock"], times[name])]
            dev = (mx.abs(outputs[name].astype(mx.float32) - ref).max().item() / scale) if scale else 0.0
            rows.append((length, name, statistics.median(times[name]), statistics.median(ratios),
                         min(ratios), max(ratios), dev))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m glm53_patches.patches.kda_prefill_kernel.checks.bench")
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--chunks", default="16,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=64, help="TextConfig.linear_num_heads default")
    parser.add_argument("--head-dim", type=int, default=128, help="TextConfig.linear_head_dim default")
    parser.add_argument("--hidden", type=int, default=4096, help="TextConfig.hidden_size default")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--bits", type=int, choices=(0, 4, 8), default=4, help="quantize the projections (0: no)")
    parser.add_argument("--part", choices=("mixer", "recurrence"), default="recurrence")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    args.chunks = [int(v) for v in args.chunks.split(",")]
    widths = f"hidden {args.hidden}, projections {'q' + str(args.bits) if args.bits else 'unquantized'}, "
    print(f"device {mx.default_device()}, mlx {mx.__version__}; {args.part}: batch {args.batch}, "
          f"{args.heads} heads x {args.head_dim}, {widths if args.part == 'mixer' else ''}{args.dtype}, "
          f"{args.rounds} interleaved rounds")
    print(f"{'T':>6} {'arm':>9} {'median s':>9} {'stock/arm':>9} {'min-max':>13} {'rel dev':>9}")
    knob = "GLM53_KDA_PREFILL_KERNEL_CHUNK"
    saved = os.environ.get(knob)  # the mixer arms set it; leave the caller's environment as found
    try:
        rows = measure(args)
    finally:
        if saved is None:
            os.environ.pop(knob, None)
        else:
            os.environ[knob] = saved
    for length, name, median, ratio, low, high, dev in rows:
        print(f"{length:>6} {name:>9} {median:>9.3f} {ratio:>9.2f} {low:>6.2f}-{high:<6.2f} {dev:>9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device check for hc_decode: exactness and timing on a GPU (CUDA or Metal).

    python3 -m glm53_patches.patches.hc_decode.checks.device_check [--quick] [--step-layers 8] [--out FILE]

Runs on whatever MLX's default device is, needs only mlx, mlx-vlm's model
files and this package (on a bare GPU machine where ``import mlx_vlm`` fails
for want of its server/processor dependencies, it registers bare packages
for ``mlx_vlm`` and imports the model modules directly).

1. Exactness, bitwise, against stock on this backend:
   * the one-launch Sinkhorn collapse kernel against upstream's
     ``HyperConnection.__call__`` at real dimensions (hidden 4096, hc_mult 4,
     20 Sinkhorn iterations), bf16 and fp32 activations, batch 1 and 4;
   * a real-width decoder layer over decode steps, kernel on and off;
   * greedy decode of a tiny model, kernel on and off.
   If the kernel mismatches, every arithmetic variant of the CUDA body is run
   and the outputs each one reproduces are reported (which rounding to fix).
2. Timing, interleaved arms, median of many single-call evaluations:
   per hyper-connection (the Sinkhorn collapse alone, and the whole collapse
   with its rms_norm, mix matmul and branch norm), per decoder layer and,
   with --step-layers N, per whole decode step of an N-layer real-width model
   (plus its graph primitives per step).

Prints one JSON object (also written to --out, or $OUT/hc_decode_device_check.json
when OUT is set) and exits 1 when any comparison is not bit-identical.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _import_model_modules():
    from glm53_patches import upstream_import

    upstream_import.import_language()
    return upstream_import.bare_reason or "mlx_vlm imported normally"


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def time_arms(arms, rounds, reps, warmup=3):
    """{arm: median ms} over `rounds` rounds of `reps` single evaluations, order alternating."""
    import mlx.core as mx

    names = list(arms)
    for name in names:
        for _ in range(warmup):
            mx.eval(arms[name]())
    samples = {name: [] for name in names}
    per_round = {name: [] for name in names}
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            fn = arms[name]
            taken = []
            for _ in range(reps):
                start = time.perf_counter()
                mx.eval(fn())
                taken.append(time.perf_counter() - start)
            samples[name] += taken
            per_round[name].append(_median_ms(taken))
    return {
        name: {
            "median_ms": round(_median_ms(samples[name]), 4),
            "round_medians_ms": [round(v, 4) for v in per_round[name]],
            "samples": len(samples[name]),
        }
        for name in names
    }


def kernel_diagnostics(verify, hc_sinkhorn, cases=6):
    """Which CUDA variants reproduce which stock outputs (only run on a mismatch)."""
    import itertools

    import mlx.core as mx

    from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
    from mlx_vlm.models.glm5_next.config import TextConfig

    from glm53_patches.exactness import same_bits

    config = TextConfig()
    table = {}
    for variant in itertools.product(range(3), range(3), range(2)):
        matched = {"collapsed": 0, "post": 0, "comb": 0}
        for seed in range(cases):
            hc = _hc.HyperConnection(config)
            verify.randomize_hyper_connection(hc, mx.random.key(2000 + seed))
            x = (3.0 * mx.random.normal((1, 1, 4, config.hidden_size), key=mx.random.key(seed))).astype(mx.bfloat16)
            expected = hc(x)
            y = x.astype(mx.float32)
            mixes = hc._mix(mx.fast.rms_norm(y.flatten(-2), None, hc.norm_eps))
            actual = hc_sinkhorn.hc_sinkhorn_collapse(
                x, mixes, hc.scale, hc.base, hc.hc_mult, hc.sinkhorn_iters, hc.hc_eps, variant=variant
            )
            for name, a, b in zip(matched, expected, actual):
                matched[name] += same_bits(a, b)
        table["affine%d_softmax%d_collapse%d" % variant] = {k: f"{v}/{cases}" for k, v in matched.items()}
    return table


def count_primitives(outputs):
    """Primitive nodes of the lazy graph behind ``outputs`` (views included)."""
    import re
    import tempfile

    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as handle:
        mx.export_to_dot(handle.name, *outputs)
        return len(re.findall(r'shape=rectangle', Path(handle.name).read_text()))


def decode_step_timing(layers, rounds, backend, **overrides):
    """Whole decode steps of a real-width model of `layers` layers (3 KDA : 1 DSA)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_vlm.models.glm5_next import language as _lang
    from mlx_vlm.models.glm5_next.config import TextConfig

    from glm53_patches.patches.hc_decode import layer
    from glm53_patches.patches.hc_decode.checks import verify

    kinds = (["linear_attention"] * 3 + ["deepseek_sparse_attention"]) * max(layers // 4, 1)
    config = TextConfig(
        num_hidden_layers=len(kinds),
        layer_types=kinds,
        n_routed_experts=8,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        index_topk_pattern="F" * len(kinds),
        **overrides,
    )
    start = time.perf_counter()
    model = _lang.LanguageModel(config)
    verify.randomize(model, mx.random.key(0))
    keep = model.cast_predicate
    model.update(
        tree_unflatten([(p, v.astype(mx.bfloat16) if keep(p) else v) for p, v in tree_flatten(model.parameters())])
    )
    nn.quantize(
        model,
        group_size=64,
        bits=4,
        class_predicate=lambda p, m: hasattr(m, "to_quantized")
        and model.quant_predicate(p, m)
        and m.weight.shape[-1] % 64 == 0,
    )
    model.eval()
    mx.eval(model.parameters())
    built = time.perf_counter() - start
    prompt = mx.random.randint(0, 1000, (1, 256), key=mx.random.key(1))

    def arm(kernel):
        cache = model.make_cache()
        mx.eval(model(prompt, cache=cache).logits)
        token = [mx.array([[5]])]

        def step():
            if kernel is None:
                logits = model(token[0], cache=cache).logits
            else:
                with layer.forcing_kernel(kernel), verify.patched_instances(model.layers):
                    logits = model(token[0], cache=cache).logits
            token[0] = mx.argmax(logits[:, -1], axis=-1)[:, None]
            return logits

        return step

    arms = {"stock": arm(None), "compiled": arm(False)}
    if backend in ("cuda", "metal"):
        arms["compiled_kernel"] = arm(True)
    timing = time_arms(arms, rounds, 8)

    primitives = {}
    for name, kernel in (("stock", None), ("compiled", False), ("compiled_kernel", True)):
        if name not in arms:
            continue
        cache = model.make_cache()
        mx.eval(model(prompt[:, :16], cache=cache).logits)
        if kernel is None:
            logits = model(mx.array([[5]]), cache=cache).logits
        else:
            with layer.forcing_kernel(kernel), verify.patched_instances(model.layers):
                logits = model(mx.array([[5]]), cache=cache).logits
        primitives[name] = count_primitives([logits])
    return {
        "model": (
            f"{len(kinds)} layers {kinds.count('linear_attention')} KDA + "
            f"{kinds.count('deepseek_sparse_attention')} DSA (full indexer), real widths, 8 routed experts "
            "top-8 + shared, all Linear/embedding/lm_head 4-bit group 64, bf16 activations, "
            "256-token prompt then decode"
        ),
        "build_s": round(built, 1),
        "ms_per_step": timing,
        "graph_primitives_per_step": primitives,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and timing samples")
    parser.add_argument("--out", help="also write the JSON summary here")
    parser.add_argument(
        "--step-layers",
        type=int,
        default=0,
        help="also time whole decode steps of a real-width model with this many layers (e.g. 8)",
    )
    args = parser.parse_args(argv)

    imported = _import_model_modules()
    import mlx.core as mx

    from mlx_vlm.models.cache import ArraysCache
    from mlx_vlm.models.deepseek_v4 import hyper_connection as _hc
    from mlx_vlm.models.glm5_next.config import TextConfig

    from glm53_patches.exactness import Tally
    from glm53_patches.kernels import hc_sinkhorn
    from glm53_patches.patches.hc_decode import layer
    from glm53_patches.patches.hc_decode.checks import verify

    backend = verify.backend_name()
    summary = {
        "backend": backend,
        "device": str(mx.default_device()),
        "mlx": getattr(mx, "__version__", "?"),
        "imports": imported,
        "checks": {},
    }
    try:
        from importlib.metadata import version

        summary["mlx_vlm"] = version("mlx-vlm")
    except Exception:
        summary["mlx_vlm"] = "?"

    # ---- 1. exactness ------------------------------------------------------------------
    seeds = 4 if args.quick else 16
    exact = True
    for name, run in (
        ("kernel", lambda t: verify.check_kernel(t, seeds=seeds)),
        ("layer", lambda t: verify.check_layer(t)),
        ("model", lambda t: verify.check_model(t, quantize=(None,))),
    ):
        tally = Tally()
        start = time.perf_counter()
        try:
            run(tally)
            result = tally.result(time.perf_counter() - start)
        except Exception as exc:  # report, do not hide
            result = {"exact": False, "cases": tally.cases, "detail": f"raised {type(exc).__name__}: {exc}"}
        if name == "kernel" and backend not in ("cuda", "metal"):
            result = {"skipped": True, "detail": "no GPU kernel on this backend"}
        else:
            exact = exact and result["exact"]
        summary["checks"][name] = result
    if backend == "cuda" and not summary["checks"]["kernel"]["exact"]:
        try:
            summary["kernel_variants"] = kernel_diagnostics(verify, hc_sinkhorn, cases=3 if args.quick else 6)
        except Exception as exc:
            summary["kernel_variants"] = f"raised {type(exc).__name__}: {exc}"

    # ---- 2. timing ------------------------------------------------------------------------
    rounds, reps = (4, 25) if args.quick else (8, 60)
    timing = {}
    config = TextConfig()
    hc = _hc.HyperConnection(config)
    verify.randomize_hyper_connection(hc, mx.random.key(7))
    norm = verify.real_width_layer(mx.bfloat16)[0].input_layernorm
    x = mx.random.normal((1, 1, config.hc_mult, config.hidden_size), key=mx.random.key(8)).astype(mx.bfloat16)
    y = x.astype(mx.float32)
    mixes = hc._mix(mx.fast.rms_norm(y.flatten(-2), None, hc.norm_eps))
    mx.eval(x, y, mixes, hc.parameters(), norm.parameters())

    def stock_collapse():
        collapsed, post, comb = hc(x)
        return norm(collapsed), post, comb

    hc_params, norm_params = dict(hc), dict(norm)
    arms = {"stock_sinkhorn_collapse": lambda: _hc._hc_ops(x, y, mixes, hc.scale, hc.base, 4, 20, hc.hc_eps)}
    collapse_arms = {"stock": stock_collapse}
    with layer.forcing_kernel(False):
        compiled = layer._compiled("collapse", hc, norm, False)
        collapse_arms["compiled"] = lambda: compiled(x, hc_params, norm_params)
    if backend in ("cuda", "metal"):
        arms["kernel_sinkhorn_collapse"] = lambda: hc_sinkhorn.hc_sinkhorn_collapse(
            x, mixes, hc.scale, hc.base, 4, 20, hc.hc_eps
        )
        hc_sinkhorn.compiled_constant(hc.hc_eps)
        kernelized = layer._compiled("collapse", hc, norm, True)
        collapse_arms["compiled_kernel"] = lambda: kernelized(x, hc_params, norm_params)
    try:
        timing["per_hyper_connection_sinkhorn_collapse"] = time_arms(arms, rounds, reps)
        timing["per_hyper_connection_collapse_with_norms_and_mix"] = time_arms(collapse_arms, rounds, reps)
    except Exception as exc:
        timing["per_hyper_connection"] = f"raised {type(exc).__name__}: {exc}"

    try:
        decoder, _ = verify.real_width_layer(mx.bfloat16)
        stock_call = verify.stock_layer_call()
        patched_call = layer.make_call(stock_call)
        step_x = mx.random.normal((1, 1, 4, 4096), key=mx.random.key(9)).astype(mx.bfloat16)
        caches = {}

        def layer_arm(name, call, kernel):
            caches[name] = ArraysCache(size=2)

            def run():
                with layer.forcing_kernel(kernel):
                    return call(decoder, step_x, None, caches[name])[0]

            return run

        layer_arms = {
            "stock": layer_arm("stock", stock_call, None),
            "compiled": layer_arm("compiled", patched_call, False),
        }
        if backend in ("cuda", "metal"):
            layer_arms["compiled_kernel"] = layer_arm("compiled_kernel", patched_call, True)
        timing["per_decoder_layer_real_width_small_branches"] = time_arms(layer_arms, rounds, max(reps // 2, 10))
    except Exception as exc:
        timing["per_decoder_layer"] = f"raised {type(exc).__name__}: {exc}"
    if args.step_layers:
        try:
            timing["per_decode_step"] = decode_step_timing(args.step_layers, rounds, backend)
        except Exception as exc:
            timing["per_decode_step"] = f"raised {type(exc).__name__}: {exc}"
    timing["conditions"] = (
        f"{backend}, bf16 activations, batch 1, hidden 4096, hc_mult 4, 20 Sinkhorn iterations; "
        f"{rounds} interleaved rounds x {reps} single evaluations (mx.eval each), median; "
        "the layer has a 2-head KDA branch and a 256-wide dense MLP, so it is mostly hyper-connection"
    )
    summary["timing"] = timing
    summary["exact"] = exact

    text = json.dumps(summary, indent=1, default=str)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "hc_decode_device_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(text)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

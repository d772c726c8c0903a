"""glm53-patches bench: stock vs patch sets on a synthetic GLM-5.3-Flash, in one process.

Builds random quantized weights at the real widths (or ``--small``), or loads
your own checkpoint (``--model DIR``), switches patch sets in-process
(enable/disable), times them interleaved (A B, B A, ...), checks that exact arms
give bit-identical logits and the same greedy tokens as stock, and writes a JSON
file, a PNG chart and a table (``--report FILE``: a Markdown file to share).
Progress goes to stderr.
"""

import argparse
import datetime
import os
import platform
import signal
import sys

SMALL_DEFAULTS = dict(layers=8, experts=8, dtype="float32", contexts="16,256", prefill="16,64",
                      rounds=2, steps=8, warmup=2, check_steps=4)
REAL_DEFAULTS = dict(layers=45, experts="auto", dtype="bfloat16", contexts="256,4096", prefill="128,512",
                     rounds=3, steps=24, warmup=4, check_steps=8)


MODEL_KEYS = ("layers", "experts", "dtype")  # a checkpoint has its own


def add_arguments(parser):
    a = parser.add_argument
    a("--small", action="store_true", help="tiny widths, fp32 activations: runs on a laptop CPU in under a minute")
    a("--model", metavar="DIR", help="your own glm5_next checkpoint (as mlx_vlm.server --model takes it) instead of "
                                     "the synthetic model; --layers, --experts, --dtype and --small do not apply")
    a("--layers", type=int, help="decoder layers (default 45; --small 8)")
    a("--experts", help="routed experts per MoE layer, or 'auto' (default: what fits, at most 64)")
    a("--dtype", choices=("bfloat16", "float32"), help="activation dtype (default bfloat16; --small float32)")
    a("--arms", default="stock,each,all",
      help="comma list: stock, a patch name, a+b, 'each' (every patch alone), 'all' (what GLM53_PATCHES=all turns on here: the exact patches, kernels only where verified), all+name")
    a("--contexts", help="decode context lengths, short,long (default 256,4096; --small 16,256)")
    a("--prefill", help="prefill prompt lengths (default 128,512; --small 16,64; '' skips)")
    a("--verify-blocks", default="1,2,3,4",
      help="verify section: speculative verify block sizes (bonus token + drafts) at each decode context; "
           "1 is the plain decode step they are compared with (default 1,2,3,4)")
    a("--rounds", type=int, help="interleaved rounds per measurement (default 3)")
    a("--steps", type=int, help="timed steps per round (default 24)")
    a("--warmup", type=int, help="untimed steps per round before timing (default 4)")
    a("--pipelined-steps", type=int,
      help="decode: timed tokens per round of mlx-vlm's async_eval decode loop, run beside the synchronous steps "
           "(default: --steps; 0 skips it)")
    a("--prefill-rounds", type=int, help="interleaved rounds for prefill (default: --rounds)")
    a("--check-steps", type=int, help="greedy steps compared bit for bit with stock (default 8)")
    a("--prefill-check-tokens", type=int,
      help="compare prefills with stock (and warm up) on the prompt's first N tokens, once, instead of the whole "
           "prompt at every length: long prompts then cost one timed run per arm (default: the whole prompt)")
    a("--prefill-untimed-stock", action="store_true",
      help="prefill: stock runs only as the check's reference, untimed; the other arms are timed and "
           "compared with the first of them (stock's long prefills cost minutes)")
    a("--sections", help="which sections, in order (default: every one, in the bench's order)")
    a("--budget-s", type=float, help="stop starting new sections/rounds after this many seconds")
    a("--force", action="store_true", help="apply patches even where the drift guard refuses them (noted)")
    a("--seed", type=int, default=0)
    a("--out", help="JSON path, the PNG beside it (default glm53-bench.json; with --from-json: beside that file)")
    a("--no-png", action="store_true")
    a("--report", metavar="FILE", help="also write a Markdown report to share: machine, OS, versions, arms, "
                                       "figures, exactness")
    a("--from-json", metavar="PATH", help="measure nothing: print the table of a saved run and redraw its PNG")
    a("--quiet", action="store_true", help="no progress on stderr")


def _finish_args(args):
    defaults = SMALL_DEFAULTS if args.small else REAL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None and not (args.model and key in MODEL_KEYS):
            setattr(args, key, value)
    args.out = args.out or "glm53-bench.json"
    if args.pipelined_steps is None:
        args.pipelined_steps = args.steps
    ints = lambda text: [int(x) for x in str(text).split(",") if x.strip()]  # noqa: E731
    args.contexts, args.prefill = ints(args.contexts), ints(args.prefill)
    args.verify_blocks = ints(args.verify_blocks)
    if args.sections is None:  # sections imports mlx: only once a bench really runs
        from .sections import SECTIONS

        args.sections = ",".join(SECTIONS)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    args.prefill_rounds = args.prefill_rounds or args.rounds
    return args


def _png_path(json_path):
    return (json_path[:-5] if json_path.endswith(".json") else json_path) + ".png"


def replot(args):
    """--from-json: the table of a saved run; its PNG (and --report) redrawn, beside --out where given."""
    import json

    from . import report

    with open(args.from_json) as f:
        results = json.load(f)
    results["verdicts"] = report.verdicts(results)
    print(report.table(results))
    out = args.out or args.from_json
    if args.out and not (os.path.exists(args.out) and os.path.samefile(args.out, args.from_json)):
        report.write_json(results, args.out)
        print(f"wrote {args.out}")
    if not args.no_png:
        note = report.write_png(results, _png_path(out))
        print(f"note: {note}" if note else f"drew {_png_path(out)}")
    if args.report:
        report.write_report(results, args.report)
        print(f"wrote {args.report}")
    return 0


def _refusal(args):
    """Why these options cannot run together, or None."""
    if args.model:
        given = [f"--{k}" for k in ("small", *MODEL_KEYS) if getattr(args, k)]
        if given:
            return f"--model DIR runs the checkpoint as it is: drop {', '.join(given)}"
    return None


def machine():
    """Where the run happened, for the JSON and the shareable report."""
    from .. import registry

    return {"machine": platform.machine(), "processor": platform.processor(), "os": platform.platform(),
            "python": platform.python_version(), "glm53_patches": registry._version("glm53-patches")}


def _synthetic(args, progress):
    """(model, config, the results' ``model`` entry) of the synthetic GLM-5.3-Flash."""
    import mlx.core as mx

    from . import synthetic

    dtype = getattr(mx, args.dtype)
    preset = "small" if args.small else "real"
    config = synthetic.text_config(preset, layers=args.layers)
    experts = synthetic.auto_experts(config, dtype_bytes=dtype.size) if args.experts == "auto" else int(args.experts)
    config = synthetic.text_config(preset, layers=args.layers, experts=experts)
    progress(f"building {preset} model: {config.num_hidden_layers} layers, {experts} experts, {args.dtype}")
    model = synthetic.build(config, dtype=dtype, seed=args.seed, progress=progress)
    kda_layers = config.layer_types.count("linear_attention")
    return model, config, {
        "preset": preset, "layers": config.num_hidden_layers, "kda_layers": kda_layers,
        "dsa_layers": config.num_hidden_layers - kda_layers, "hidden_size": config.hidden_size,
        "experts": experts, "top_k": config.num_experts_per_tok, "dtype": args.dtype,
        "quantization": {"routed experts": 4, "KDA projections": 8, "other Linear/MultiLinear/embedding/lm_head": 6,
                         "group_size": synthetic.GROUP, "mode": "affine",
                         "unquantized": "router, hyper-connections, norms, conv, A_log, dt_bias, index_kpool_compress"},
        "note": (f"{experts} routed experts per MoE layer instead of {synthetic.REAL_EXPERTS}: a decode token "
                 f"reads only its top-{config.num_experts_per_tok}, so the weight bytes per token are the same "
                 "(the router alone is smaller)"),
    }


def run(args):
    if args.from_json:
        return replot(args)
    from . import checkpoint

    refusal = _refusal(args)
    if args.model and not refusal:
        try:  # the cheap checks, before anything is built or printed
            checkpoint_config = checkpoint.check(args.model)
        except checkpoint.CheckpointError as exc:
            refusal = str(exc)
    if refusal:
        print(f"glm53-patches bench: {refusal}", file=sys.stderr)
        return 2
    import mlx.core as mx

    from .. import registry
    from .. import upstream_import
    from . import measure, report, sections, synthetic

    args = _finish_args(args)
    unknown = [s for s in args.sections if s not in sections.SECTIONS]
    if unknown:
        print(f"unknown sections: {', '.join(unknown)} (know {', '.join(sections.SECTIONS)})", file=sys.stderr)
        return 2
    progress = measure.Progress(args.quiet)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still gets the JSON and PNG
    upstream_import.import_language()
    arms = measure.Arms(args.arms, progress, force=args.force)
    if args.prefill_untimed_stock and len(arms.labels) < 2:
        print("--prefill-untimed-stock needs an arm besides stock to time", file=sys.stderr)
        return 2
    if args.model:
        progress(f"loading {args.model} with mlx_vlm.utils.load_model")
        try:
            model = checkpoint.load(args.model)
        except checkpoint.CheckpointError as exc:
            print(f"glm53-patches bench: {exc}", file=sys.stderr)
            return 2
        config = model.config
        described = checkpoint.describe(args.model, checkpoint_config, model, config)
    else:
        model, config, described = _synthetic(args, progress)
    kda_layers = config.layer_types.count("linear_attention")
    weights = synthetic.decode_bytes(model, config)
    state = kda_layers * (config.linear_num_heads * config.linear_head_dim ** 2 * 4)
    results = {
        "schema": "glm53-bench/1",
        "date": datetime.date.today().isoformat(),
        "argv": sys.argv,
        "command": getattr(args, "command", None) or ["glm53-patches", "bench", *sys.argv[2:]],
        "device": {"backend": registry.backend(), **{k: str(v) for k, v in mx.device_info().items()},
                   "mlx": registry._version("mlx"), "mlx_vlm": registry._version("mlx-vlm"), **machine()},
        "model": {**described, "active_memory_after_build": mx.get_active_memory()},
        "bytes_per_token": {"weights": weights["total"], "by_category": weights["by_category"],
                            "weights_with_288_experts": weights["total_with_288_experts"], "kda_state": 2 * state,
                            "kda_state_note": "KDA recurrent state (fp32) read and written per token"},
        "arms": arms.state, "correctness": {}, "peak_memory": {"after_build": mx.get_peak_memory()},
        "graph_primitives": {}, "skipped": [], "notes": list(arms.notes),
        "sections": args.sections, "options": {k: v for k, v in vars(args).items() if k not in ("run", "command")},
    }
    results["notes"].append("decode contexts start from caches filled with random data (no prefill)")
    png = None if args.no_png else _png_path(args.out)

    def save():
        for label in arms.labels:
            results["arms"][label]["counters"] = dict(arms.counters[label])
        results["verdicts"] = report.verdicts(results)
        results["elapsed_s"] = progress.elapsed()
        report.write_json(results, args.out)

    bench = sections.Bench(args, model, config, arms, progress, save)
    bench.results = results
    try:
        for name in args.sections:
            if bench.runner.past_deadline():
                results["skipped"].append(f"{name}: time budget spent")
                continue
            progress(f"section {name}")
            getattr(bench, name)()
            save()
    finally:
        arms.close()
        save()
        if png:
            note = report.write_png(results, png)
            if note:
                print(f"note: {note}", file=sys.stderr)
                png = None
    print(report.table(results))
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    if args.report:
        report.write_report(results, args.report)
        print(f"wrote {args.report}")
    wrong = [l for l, v in results["verdicts"].items() if v.startswith("WRONG")]
    return 1 if wrong else 0


def add_parser(subparsers):
    """Register ``bench`` on the glm53-patches command line."""
    parser = subparsers.add_parser("bench", help="benchmark stock vs patch sets on a synthetic model",
                                   description=__doc__)
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def main(argv=None):
    parser = argparse.ArgumentParser(prog="glm53-patches bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command = ["glm53-patches", "bench", *(sys.argv[1:] if argv is None else argv)]
    return run(args)

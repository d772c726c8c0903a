"""Time to first token with vault_cache: cold, warm (memory tier), warm after a restart (disk tier).

    python3 -m glm53_patches.patches.vault_cache.checks.ttft --out ttft.json [--small] [--layers 45]
        [--experts 8] [--prompts 4096,16384] [--dir DIR] [--patches gathered_prefill,kda_prefill_kernel]
        [--budget-s 600] [--warmup 2100]

The model is a synthetic GLM-5.3-Flash (``bench.synthetic``: real widths, random
quantized weights, fewer routed experts) saved as a directory ``mlx_vlm.utils.load``
reads, with the tiny model's 512-token tokenizer. Every phase runs in a fresh
process (so "after restart" is a real new process) with APC_ENABLED=1,
APC_DISK_PATH=<dir>/vault, GLM53_PATCHES=vault_cache[,--patches]:

* build: writes the model directory (skipped when <dir>/model already holds the same build);
* first: for each prompt length, cold (empty vault) then the same prompt again (warm, memory tier);
* restart: the same prompts again (warm from the disk tier).

TTFT is the wall time from the stream_generate call to its first result (whose
token is a Python int, so the step was evaluated). The first-step logits of
every run are saved and compared here, bit for bit, against the cold run.
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# mlx-vlm's server dependencies, absent on the GPU machine (--simulate-bare hides them here).
SERVER_DEPS = ("fastapi", "uvicorn", "pydantic", "datasets", "mlx_audio", "llguidance", "starlette",
               "websockets", "multipart", "python_multipart", "cv2", "miniaudio", "cryptography",
               "sentencepiece")
SHARD_BYTES = 2 << 30  # several weight files, so the vault hashes them on several threads
SPECIAL = 18  # the tiny tokenizer's control tokens come first; prompts avoid them


def _say(message):
    print(f"[ttft {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- imports that work where mlx-vlm's package __init__ cannot ------------------------------------


def _import_upstream(simulate_bare):
    """glm5_next, mlx_vlm.utils.load, stream_generate and apc, through bare packages if need be."""
    if simulate_bare:  # what the GPU machine lacks, and an __init__ that fails as it does there
        for name in SERVER_DEPS:
            sys.modules[name] = None
        sys.modules["mlx_vlm.convert"] = None
    from glm53_patches import upstream_import

    upstream_import.import_language()
    package = sys.modules["mlx_vlm.models.glm5_next"]
    if not hasattr(package, "Model"):  # a bare package: load() needs its Model, ModelConfig, ...
        package.__spec__.loader.exec_module(package)
    from mlx_vlm import apc
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.utils import load

    return load, stream_generate, apc, upstream_import.bare_reason


def _apply_patches(names, force):
    """Apply the named patches here (a source tree on the GPU machine has no entry points)."""
    from glm53_patches import registry
    from glm53_patches.bench.measure import discover_patches

    _, errors = discover_patches()
    todo = [n for n in names if n not in registry.applied()]
    states = registry.apply(todo, force=tuple(names) if force else ())
    out = {n: {"state": states.get(n, {}).get("state") or "unknown", "reason": states.get(n, {}).get("reason", "")}
           for n in names}
    if out["vault_cache"]["state"] != "applied":
        raise SystemExit(f"vault_cache is not applied: {out['vault_cache']} {errors}")
    return out, errors


# -- build -------------------------------------------------------------------------------------------


def _build(spec):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from glm53_patches.bench import synthetic
    from glm53_patches.tiny_model import EOS_TOKEN_IDS, _init_param, tiny_config, write_tiny_model

    _import_upstream(spec["simulate_bare"])
    from mlx_vlm.models.glm5_next.config import VisionConfig
    from mlx_vlm.models.glm5_next.vision import VisionModel

    out = Path(spec["model_dir"])
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    preset = "small" if spec["small"] else "real"
    dtype = mx.float32 if spec["small"] else mx.bfloat16  # bf16 gather_mm has no CPU kernel
    config = synthetic.text_config(preset, layers=spec["layers"], experts=spec["experts"])
    model = synthetic.build(config, dtype=dtype, seed=spec["seed"], progress=_say)
    # The tiny checkpoint's tokenizer, chat template and generation config; its
    # config and weights are replaced below.
    write_tiny_model(out)
    (out / "model.safetensors").unlink()
    text = dataclasses.asdict(config)
    text.update(dtype="float32" if spec["small"] else "bfloat16", eos_token_id=EOS_TOKEN_IDS, pad_token_id=0)
    cfg = tiny_config(**text)
    # Per-module bits as synthetic.build chose them (load() reads "<module path>": {...}).
    quantization = {"group_size": synthetic.GROUP, "bits": synthetic.BITS["other"], "mode": "affine"}
    for path, module in model.named_modules():
        if hasattr(module, "bits") and "scales" in module:
            quantization[f"language_model.{path}"] = {"group_size": module.group_size, "bits": module.bits,
                                                      "mode": module.mode}
    cfg["quantization"] = cfg["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    # A tiny vision tower (never run) keeps the checkpoint complete for load().
    vision = VisionModel(VisionConfig.from_dict(cfg["vision_config"]))
    params = [(f"vision_tower.{p}", _init_param(p, v.shape, mx.random.key(i)).astype(dtype))
              for i, (p, v) in enumerate(sorted(tree_flatten(vision.parameters())))]
    params += [(f"language_model.{p}", v) for p, v in tree_flatten(model.parameters())]
    shards, current, size = [], [], 0
    for name, value in sorted(params):
        if current and size + value.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, value))
        size += value.nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / file), dict(shard), metadata={"format": "mlx"})
        for name, value in shard:
            weight_map[name] = file
            total += value.nbytes
        _say(f"wrote {file}")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return {"build_s": time.perf_counter() - t0, "weights_bytes": total, "weight_files": len(shards),
            "quantization": "per module as bench.synthetic builds it: routed experts 4-bit, KDA projections "
                            "8-bit, other Linear/embedding/lm_head 6-bit, affine, group 64"}


# -- one measuring process -----------------------------------------------------------------------------


def _prompt(seed, length, vocab):
    import numpy as np

    rng = np.random.default_rng([seed, length])
    return [int(t) for t in rng.integers(SPECIAL, vocab, length)]


def _stats_delta(before, after):
    out = {}
    for key in ("hits", "fallbacks", "bytes"):
        delta = {k: v - before.get(key, {}).get(k, 0) for k, v in after.get(key, {}).items()}
        out[key] = {k: v for k, v in delta.items() if v}
    return out


def _phase(spec, phase, out_path):
    """One process: load, fingerprint, warm up, then the runs; the result is saved after every run."""
    t_start = time.perf_counter()
    load, stream_generate, apc, bare = _import_upstream(spec["simulate_bare"])
    import mlx.core as mx
    import numpy as np

    from glm53_patches import registry
    from glm53_patches.patches.vault_cache import PATCH

    patches, plugin_errors = _apply_patches(spec["patches"], spec["force"])
    result = {"phase": phase, "pid": os.getpid(), "bare_packages": bare, "patches": patches,
              "mlx_vlm_dir": str(Path(sys.modules["mlx_vlm"].__path__[0])), "mlx": mx.__version__,
              "plugin_errors": plugin_errors, "backend": registry.backend(), "runs": {}, "skipped": {}}

    def save():
        result["process_s"] = time.perf_counter() - t_start
        Path(out_path).write_text(json.dumps(result, indent=1, default=str))

    save()
    t = time.perf_counter()
    model, processor = load(spec["model_dir"])
    result["load_s"] = time.perf_counter() - t
    save()
    tokenizer = getattr(processor, "tokenizer", processor)
    tok_vocab = len(tokenizer)
    model_vocab = int(model.language_model.config.vocab_size)
    result["vocab"] = {"tokenizer": tok_vocab, "model": model_vocab}
    # Ids beyond the tokenizer cannot be detokenized: masked after the logits are
    # recorded, in every run alike, so generation only ever yields known ids.
    allowed = mx.arange(model_vocab) < tok_vocab

    def generate(ids, manager):
        recorded = []

        def record(tokens, logits):
            if not recorded:
                recorded.append(logits.astype(mx.float32))
            return logits

        def mask(tokens, logits):
            return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        stream = stream_generate(model, processor, "", input_ids=mx.array([ids]), max_tokens=2,
                                 temperature=0.0, apc_manager=manager, logits_processors=[record, mask])
        first = next(stream)
        ttft = time.perf_counter() - t0
        tokens = [first.token]
        for later in stream:
            tokens.append(later.token)
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        if manager is not None and manager.disk is not None:
            manager.disk.flush()  # APC writes on a background thread: not inside the next timing
        mx.eval(recorded)
        return {"ttft_s": ttft, "total_s": total, "flush_s": time.perf_counter() - t1,
                "cached_tokens": int(getattr(first, "cached_tokens", 0) or 0), "tokens": tokens,
                "peak_gb": mx.get_peak_memory() / 1e9}, np.array(recorded[0])

    # The weights fingerprint (SHA-256 of the weight files, once per file
    # version) is taken at the first keyed request; taken here so it is not
    # inside the first cold TTFT.
    before = PATCH.stats.snapshot()
    t = time.perf_counter()
    apc.model_key_dependencies(model, processor)
    result["fingerprint"] = {"s": time.perf_counter() - t, **_stats_delta(before, PATCH.stats.snapshot())["hits"]}
    # Warm-up: MLX compiles its kernels at first use; a prompt of its own, in a
    # vault of its own, run twice (cold, then restored) so that the restore path
    # is compiled too. Counted apart from the measured runs.
    warmups = []
    if spec["warmup"]:
        warm_manager = apc.from_env(overrides={"disk_path": str(Path(spec["dir"]) / "warmup-vault")})
        try:
            for _ in range(2):
                run, _ = generate(_prompt(spec["seed"] + 1, spec["warmup"], tok_vocab), warm_manager)
                warmups.append(run)
                _say(f"{phase}: warm-up {spec['warmup']} tokens ttft {run['ttft_s']:.2f} s "
                     f"(cached {run['cached_tokens']})")
        finally:
            warm_manager.close()
            del warm_manager  # its memory-tier entries
            mx.clear_cache()
    result["warmup"] = warmups
    save()
    manager = apc.from_env()
    result["apc"] = {"env": {k: v for k, v in os.environ.items() if k.startswith(("APC_", "GLM53_"))},
                     "checkpoint_interval_tokens": manager.checkpoint_interval_tokens,
                     "memory_entries": manager._exact_cache_max, "disk": str(getattr(manager.disk, "dir", None))}
    rate = None  # cold prefill tokens/s measured so far
    try:
        for n, length in enumerate(spec["lengths"]):
            left = spec["deadline"] - time.time()
            if phase == "first" and n:
                # this cold prefill (longer prompts run slower), its warm run, and the restart process
                guess = 1.5 * length / rate + result["load_s"] + spec["reserve_s"]
                if guess > left:
                    result["skipped"][length] = (f"budget: about {guess:.0f} s needed at {rate:.3g} tok/s "
                                                 f"(cold prefill so far), {left:.0f} s left")
                    save()
                    _say(f"skipping {length}: {result['skipped'][length]}")
                    continue
            ids = _prompt(spec["seed"], length, tok_vocab)
            kinds = ("cold", "warm") if phase == "first" else ("restart",)
            runs = result["runs"][length] = {}
            for kind in kinds:
                s0 = PATCH.stats.snapshot()
                run, logits = generate(ids, manager)
                run["vault"] = _stats_delta(s0, PATCH.stats.snapshot())
                np.save(Path(spec["dir"]) / "logits" / f"{length}-{kind}.npy", logits)
                runs[kind] = run
                _say(f"{phase}: {length} tokens {kind}: ttft {run['ttft_s']:.3f} s, cached "
                     f"{run['cached_tokens']}, vault {run['vault']['hits']} {run['vault']['fallbacks']}")
                save()
            if phase == "first":
                rate = length / max(runs["cold"]["ttft_s"], 1e-6)
    finally:
        if manager.disk is not None:
            manager.disk.flush()
        manager.close()
    result["vault_totals"] = PATCH.stats.snapshot()
    result["vault_status"] = registry.status()["patches"]["vault_cache"].get("detail")
    save()
    return result


# -- the parent ------------------------------------------------------------------------------------------


def _child(spec, phase, timeout):
    """Run one phase in a fresh interpreter; its result as a dict (or the error)."""
    spec_path = Path(spec["dir"]) / f"spec-{phase}.json"
    out_path = Path(spec["dir"]) / f"result-{phase}.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = dict(os.environ, APC_ENABLED="1", APC_DISK_PATH=str(Path(spec["dir"]) / "vault"),
               GLM53_PATCHES=",".join(spec["patches"]), GLM53_PATCHES_STATE_DIR=str(Path(spec["dir"]) / "state"))
    command = [sys.executable, "-X", "faulthandler", "-m", "glm53_patches.patches.vault_cache.checks.ttft",
               "--child", phase, "--spec", str(spec_path), "--out", str(out_path)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, timeout=max(timeout, 30))
        error = None if done.returncode == 0 else f"exit status {done.returncode}"
    except subprocess.TimeoutExpired:
        error = f"killed after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    if out_path.exists():
        result = json.loads(out_path.read_text())
    else:
        result = {"error": error or "no result written"}
    result["wall_s"] = wall
    if error:
        result["error"] = error
    return result


def _dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m glm53_patches.patches.vault_cache.checks.ttft",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--small", action="store_true", help="tiny widths (CPU)")
    parser.add_argument("--layers", type=int, default=None, help="default 45 (8 with --small)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    parser.add_argument("--prompts", default=None, help="prompt lengths (default 4096,16384; 40,70 with --small)")
    parser.add_argument("--dir", default=None, help="work folder: model, vault, logits (default /tmp/...)")
    parser.add_argument("--patches", default="", help="more patches, e.g. gathered_prefill,kda_prefill_kernel")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="skip the remaining prompt lengths when they would end after this (from start)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up prompt tokens per process "
                        "(default 2100; 24 with --small; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="apply patches despite drift")
    parser.add_argument("--simulate-bare", action="store_true",
                        help="hide mlx-vlm's server dependencies in the phases, as on the GPU machine")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        if args.child == "build":
            Path(args.out).write_text(json.dumps(_build(spec), indent=1, default=str))
        else:
            _phase(spec, args.child, args.out)
        return 0

    start = time.time()
    work = Path(args.dir or f"/tmp/glm53-vault-ttft-{'small' if args.small else 'real'}").resolve()
    lengths = [int(x) for x in (args.prompts or ("40,70" if args.small else "4096,16384")).split(",") if x]
    patches = list(dict.fromkeys(["vault_cache"] + [p for p in args.patches.split(",") if p]))
    build = {"small": args.small, "layers": args.layers or (8 if args.small else 45), "experts": args.experts,
             "seed": args.seed}
    spec = {**build, "dir": str(work), "model_dir": str(work / "model"), "lengths": lengths, "patches": patches,
            "force": args.force, "simulate_bare": args.simulate_bare, "deadline": start + args.budget_s,
            "warmup": args.warmup if args.warmup is not None else (24 if args.small else 2100),
            "reserve_s": 5.0 if args.small else 30.0}  # the restart process: start, load, warm-up
    work.mkdir(parents=True, exist_ok=True)
    out = {"what": "vault_cache time to first token: cold, warm (memory tier), warm after restart (disk tier)",
           "command": sys.argv, "build": build, "prompts": lengths, "patches": patches,
           "env": {"APC_ENABLED": "1", "APC_DISK_PATH": str(work / "vault"), "GLM53_PATCHES": ",".join(patches),
                   "GLM53_PATCHES_STATE_DIR": str(work / "state")},
           "budget_s": args.budget_s, "max_tokens": 2,
           "decoding": "ids >= the tokenizer's vocabulary are masked (-inf) after the first-step logits are "
                       "recorded, in every run alike, so every generated id can be detokenized",
           "ttft": "wall time from the stream_generate call to its first result; weights fingerprint and a "
                   "warm-up prompt (own vault) run before, timed apart"}

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))

    # Build (or reuse) the model directory.
    marker = work / "model" / "ttft-build.json"
    if marker.exists() and json.loads(marker.read_text()).get("build") == build:
        out["model"] = {**json.loads(marker.read_text()), "reused": True}
        _say(f"reusing {work / 'model'}")
    else:
        _say(f"building the model in {work / 'model'}")
        built = _child(spec, "build", timeout=3600)
        if built.get("error"):
            out["model"] = built
            save()
            raise SystemExit(f"building the model failed: {built['error']}")
        marker.write_text(json.dumps({"build": build, **built}))
        out["model"] = {"build": build, **built, "reused": False}
    out["model"]["dir"] = str(work / "model")
    out["model"]["dir_bytes"] = _dir_bytes(work / "model")
    for stale in ("vault", "warmup-vault", "state", "logits"):  # cold means an empty vault
        shutil.rmtree(work / stale, ignore_errors=True)
    (work / "logits").mkdir()
    save()

    first = _child(spec, "first", timeout=spec["deadline"] - time.time() + 300)
    out["first"] = first
    save()
    done = [int(k) for k, v in first.get("runs", {}).items() if "warm" in v]
    restart = {}
    if done:
        restart = _child({**spec, "lengths": done}, "restart", timeout=max(spec["deadline"] - time.time(), 0) + 300)
    out["restart"] = restart

    # Compare, and the per-length summary.
    import numpy as np

    from glm53_patches import exactness

    rows = {}
    for length in lengths:
        runs = {**first.get("runs", {}).get(str(length), {}), **restart.get("runs", {}).get(str(length), {})}
        if not runs:
            rows[length] = {"skipped": first.get("skipped", {}).get(str(length), first.get("error", "not run"))}
            continue
        row = {f"{kind}_s": run["ttft_s"] for kind, run in runs.items()}
        row.update({f"{kind}_cached_tokens": run["cached_tokens"] for kind, run in runs.items()})
        row.update({f"{kind}_vault": run["vault"] for kind, run in runs.items()})
        if "cold_s" in row:
            row["cold_prefill_tok_s"] = length / row["cold_s"]
            row.update({f"{kind}_speedup": row["cold_s"] / row[f"{kind}_s"] for kind in ("warm", "restart")
                        if f"{kind}_s" in row})
        cold = work / "logits" / f"{length}-cold.npy"
        for kind in ("warm", "restart"):
            other = work / "logits" / f"{length}-{kind}.npy"
            if cold.exists() and other.exists() and kind in runs:
                row[f"{kind}_identical"] = exactness.same_bits(np.load(cold), np.load(other))
                row[f"{kind}_same_tokens"] = runs["cold"]["tokens"] == runs[kind]["tokens"]
        rows[length] = row
    out["results"] = rows
    out["wall_s"] = time.time() - start
    save()
    _print(out, first, restart, args.out)
    return 0 if not first.get("error") and not restart.get("error") else 1


def _print(out, first, restart, path):
    nan = float("nan")
    model, build = out["model"], out["build"]
    print(f"vault_cache TTFT: {'small widths' if build['small'] else 'real widths'}, {build['layers']} layers, "
          f"{build['experts']} routed experts, backend {first.get('backend')}, mlx {first.get('mlx')}, "
          f"mlx-vlm {first.get('mlx_vlm_dir')}")
    states = first.get("patches", {})
    print("patches: " + ", ".join(f"{n} ({states.get(n, {}).get('state', '?')}"
                                  + (f": {states[n]['reason']}" if states.get(n, {}).get("reason") else "") + ")"
                                  for n in out["patches"]))
    print(f"model dir {model['dir_bytes'] / 1e6:.1f} MB, build {model.get('build_s', nan):.1f} s"
          f"{' (reused)' if model.get('reused') else ''}; load {first.get('load_s', nan):.1f} s / after restart "
          f"{restart.get('load_s', nan):.1f} s")
    for name, phase in (("first", first), ("restart", restart)):
        fp = phase.get("fingerprint", {})
        warm = ", ".join(f"{w['ttft_s']:.2f} s" for w in phase.get("warmup", []))
        print(f"  {name}: weights fingerprint {fp.get('s', nan):.2f} s (files hashed {fp.get('weights_hashed', 0)}, "
              f"cached {fp.get('weights_cached', 0)}); warm-up TTFT {warm or '-'}; "
              f"process {phase.get('process_s', nan):.0f} s")
    print(f"{'prompt':>7} {'cold s':>9} {'tok/s':>7} {'warm s':>8} {'x':>6} {'restart s':>9} {'x':>6} "
          f"{'cached w/r':>12} {'identical w/r':>14}  restart vault")
    for length, row in out["results"].items():
        if "skipped" in row:
            print(f"{length:>7} skipped: {row['skipped']}")
            continue
        get = lambda k: row.get(k, nan)  # noqa: E731
        hits = row.get("restart_vault", {})
        print(f"{length:>7} {get('cold_s'):>9.3f} {get('cold_prefill_tok_s'):>7.0f} {get('warm_s'):>8.3f} "
              f"{get('warm_speedup'):>6.1f} {get('restart_s'):>9.3f} {get('restart_speedup'):>6.1f} "
              f"{str(row.get('warm_cached_tokens')) + '/' + str(row.get('restart_cached_tokens')):>12} "
              f"{str(row.get('warm_identical')) + '/' + str(row.get('restart_identical')):>14}  "
              f"{hits.get('hits', {})} {hits.get('fallbacks', {})}")
    for name, phase in (("first", first), ("restart", restart)):
        if phase.get("error"):
            print(f"{name}: ERROR {phase['error']}")
    print(f"wall {out['wall_s']:.0f} s; JSON: {path}")


if __name__ == "__main__":
    raise SystemExit(main())

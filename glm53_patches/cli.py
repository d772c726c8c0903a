"""glm53-patches: status | list | doctor | verify | bench | stage | warmup | tiny-model | fingerprints."""

import argparse
import json
import os
import site
import sys
import time
from pathlib import Path

from . import backend, bench, config, drift, pins, stage, verify_records, warmup

# Subcommands that run MLX: where it cannot load they say so in one line.
NEEDS_MLX = ("verify", "bench", "stage", "tiny-model", "warmup")


def _registry():
    from . import registry

    return registry


def _live_reports():
    """Status files published by processes that are still running."""
    reports = []
    folder = config.state_dir()
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if not path.stem.isdigit():
            continue
        pid = int(path.stem)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)  # that process has exited
            continue
        except PermissionError:
            pass
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def _here(registry):
    """What this shell's environment asks for, and whether upstream matches a verified pin."""
    settings = config.read()
    patches = registry.available()
    mlx_problem = backend.mlx_problem()
    view = {}
    for name, patch in patches.items():
        problems = drift.check_patch(patch)
        view[name] = {
            # None: unknown without MLX (`all` depends on this backend's verify records)
            "requested": None if mlx_problem else settings.wants(name, registry.covered_by_all(patch)),
            "env": patch.env_var,
            "numerics": patch.numerics,
            "drift": problems or None,
            "verified_on": drift.verified_versions(patch),
            "kernels_verified_here": {
                b: verify_records.passed(name, b) for b in patch.needs_verify_on
            },
        }
    knob_errors, warnings = config.knob_problems(patches)
    errors = settings.errors + config.unknown_name_errors(settings, patches) + knob_errors
    problem = config.state_dir_problem()
    warnings += [problem] if problem else []
    warnings += [mlx_problem] if mlx_problem else []
    return {"environment_errors": errors, "warnings": warnings, "plugin_errors": registry.status()["plugin_errors"],
            "patches": view}


def _yes_no(value):
    return "?" if value is None else ("yes" if value else "no")


def cmd_status(args):
    registry = _registry()
    report = {"here": _here(registry), "processes": _live_reports()}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    here = report["here"]
    for error in here["environment_errors"] + here["plugin_errors"]:
        print(f"error: {error}")
    for warning in here["warnings"]:
        print(f"warning: {warning}")
    print("patch                      this shell would apply  upstream")
    for name, entry in here["patches"].items():
        upstream = "verified" if not entry["drift"] else "DRIFT: " + drift.summary(entry["drift"])
        print(f"{name:26} {_yes_no(entry['requested']):23} {upstream}")
    if not report["processes"]:
        print("no running process has applied patches")
    for process in report["processes"]:
        print(f"\nprocess {process['pid']}: backend={process['backend']} mlx={process['mlx']} "
              f"mlx-vlm={process['mlx_vlm']}\n  command: {' '.join(process['argv'])}")
        for error in process.get("hook_errors", []):
            print(f"  hook error: {error}")
        for error in process.get("configuration_errors", []):
            print(f"  configuration error: {error} (nothing applied)")
        for name, entry in process["patches"].items():
            stats = entry["stats"]
            hits = sum(stats["hits"].values())
            fallbacks = ", ".join(f"{k}={v}" for k, v in sorted(stats["fallbacks"].items())) or "none"
            reason = f" ({entry['reason']})" if entry["reason"] else ""
            print(f"  {name:24} {entry['state']}{reason}; hits {hits}, fallbacks: {fallbacks}")
            if entry.get("detail"):
                print(f"  {'':24} {entry['detail']}")
    return 0


def cmd_list(args):
    for name, patch in _registry().available().items():
        print(f"{name}  [{patch.numerics}]  {patch.env_var}\n    {patch.summary}")
        for target in patch.targets:
            print(f"    replaces {target}")
        for knob, spec in sorted(patch.knobs.items()):
            print(f"    {config.knob_variable(name, knob)}: {spec.doc} (accepted: {spec.accepted})")
        print(f"    upstream: {patch.upstream}")
    return 0


def _bootstrap_files():
    folders = site.getsitepackages() + [site.getusersitepackages()]
    return [p for f in folders for p in Path(f).glob("glm53_patches_bootstrap.pth")]


def cmd_doctor(args):
    registry = _registry()
    problems = 0
    files = _bootstrap_files()
    print(f"bootstrap .pth: {', '.join(map(str, files)) or 'MISSING (reinstall glm53-patches)'}")
    problems += not files
    status = registry.status()
    pinned = pins.mlx_vlm_versions()
    in_pins = status["mlx_vlm"] in pinned
    print(f"mlx-vlm {status['mlx_vlm']} ({'pinned' if in_pins else 'NOT in upstream_pins: ' + ', '.join(pinned)})")
    problems += not in_pins
    mlx_problem = backend.mlx_problem()
    print(f"mlx {status['mlx']}; backend {mlx_problem or backend.current()}")
    problems += bool(mlx_problem)
    here = _here(registry)
    for error in here["environment_errors"] + here["plugin_errors"]:
        print(f"error: {error}")
        problems += 1
    for warning in here["warnings"]:
        if warning != mlx_problem:
            print(f"warning: {warning}")
    for name, entry in here["patches"].items():
        if entry["requested"] is None:
            would = "unknown until MLX loads"
        elif entry["requested"]:
            would = "would apply" if not entry["drift"] else "requested but refused (drift)"
        else:
            would = "not requested"
        print(f"{name}: {would}")
    return 1 if problems else 0


def cmd_verify(args):
    """Run each patch's exactness check on this backend and record the result."""
    registry = _registry()
    patches = registry.available()
    unknown = [n for n in args.patches if n not in patches]
    if unknown:
        print(f"unknown patch(es): {', '.join(unknown)}; patches: {', '.join(patches)}", file=sys.stderr)
        return 2
    from .exactness import verify_result
    from .upstream_import import import_language

    import_language()  # works on a bare GPU machine too
    here = registry.backend()
    failed, results = 0, {}
    print(f"{'patch':26} {'backend':8} {'result':24} time")
    for name in args.patches or list(patches):
        patch = patches[name]
        if patch.verify is None:
            print(f"{name:26} {here:8} {'no check (nothing to verify)':24}")
            continue
        start = time.perf_counter()
        try:
            result = patch.verify()
        except Exception as exc:
            result = verify_result(False, float("nan"), 0, f"check raised {exc!r}")
        seconds = time.perf_counter() - start
        result = {**result, "passed": bool(result["exact"]), "seconds": round(seconds, 2), "date": time.strftime("%Y-%m-%d")}
        results[name] = result
        verify_records.record(name, here, {k: v for k, v in result.items() if k != "case_results"})
        failed += not result["passed"]
        verdict = "exact" if result["passed"] else f"FAILED (max |d| {result['max_abs_diff']:.3g})"
        print(f"{name:26} {here:8} {verdict:24} {seconds:.1f}s  {result['cases']} cases; {result['detail']}")
    if args.cases or here == "metal":  # a Mac user's first look: every case, readable
        print(_case_table(results))
    if args.report:
        report = {"command": "glm53-patches verify " + " ".join(args.patches), "date": time.strftime("%Y-%m-%d %H:%M"),
                  "machine": backend.machine(), "patches": results}
        Path(args.report).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.report} (machine, versions and every case: attach it to a bug report)")
    return 1 if failed else 0


def _case_table(results):
    cases = [case["case"] for result in results.values() for case in result.get("case_results") or []]
    width = max([52, *map(len, cases)])  # whole names: two cases must never print alike
    lines = ["", f"{'patch':22} {'case':{width}} result"]
    for name, result in results.items():
        for case in result.get("case_results") or []:
            outcome = case["result"]
            if outcome == "differs":
                outcome += f" (max |d| {case.get('max_abs_diff', float('nan')):.3g}{'; ' + case['where'] if case.get('where') else ''})"
            elif outcome == "failed":
                outcome += f": {case['error']}"
            elif outcome == "inconclusive":
                outcome += f": {case['why']}"
            lines.append(f"{name:22} {case['case']:{width}} {outcome}")
    return "\n".join(lines)


def cmd_tiny_model(args):
    from .tiny_model import write_tiny_model

    path = write_tiny_model(args.dir, quantize_bits=args.quantize_bits, seed=args.seed)
    print(path)
    if args.drafter:
        from .tiny_drafter import write_tiny_drafter

        print(write_tiny_drafter(path, args.drafter, seed=args.seed))
    return 0


def cmd_fingerprints(args):
    """Each patch's upstream fingerprints, from the pinned releases' wheels, into its own file."""
    patches = _registry().available()
    names = args.patch or list(patches)
    unknown = [n for n in names if n not in patches]
    if unknown:
        print(f"unknown patch(es): {', '.join(unknown)}; patches: {', '.join(patches)}", file=sys.stderr)
        return 2
    versions = args.versions or pins.mlx_vlm_versions()
    targets = sorted({t for n in names for t in patches[n].all_fingerprinted()})
    known = drift.regenerate(targets, versions, Path(args.cache))
    for name in names:
        patch = patches[name]
        own = {t: known[t] for t in sorted(patch.all_fingerprinted()) if t in known}
        text = json.dumps(own, indent=1, sort_keys=True) + "\n"
        if args.write:
            patch.fingerprints_path().write_text(text)
            print(f"wrote {patch.fingerprints_path()} ({len(own)} objects, versions {', '.join(versions)})")
        else:
            print(f"# {name}: {patch.fingerprints_path()}\n{text}")
    missing = [t for t in targets if t not in known]
    for target in missing:
        print(f"warning: {target} exists in none of {versions}", file=sys.stderr)
    return 1 if missing else 0


def cmd_manifest(args):
    from . import manifest

    changed = manifest.stale(_registry().available())
    for path, text in changed.items():
        if args.write:
            Path(path).write_text(text)
        print(f"{'wrote' if args.write else 'stale'}: {path}")
    if not changed:
        print("entry_points.toml and README's settings table match the declarations")
    return 1 if changed and not args.write else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="glm53-patches", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="what is on, applied, refused, and why")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=cmd_status)
    commands.add_parser("list", help="the installed patches").set_defaults(run=cmd_list)
    commands.add_parser("doctor", help="check the installation").set_defaults(run=cmd_doctor)
    verify = commands.add_parser("verify", help="run exactness checks on this machine's backend and record them")
    verify.add_argument("patches", nargs="*")
    verify.add_argument("--report", metavar="FILE", help="write a JSON to attach to a bug report: machine, OS, "
                        "versions, and per case exact / max deviation / the exception")
    verify.add_argument("--cases", action="store_true", help="print every case (always on Metal)")
    verify.set_defaults(run=cmd_verify)
    bench.add_parser(commands)
    stage.add_parser(commands)
    warmup.add_parser(commands)
    from .patches.vault_cache import inventory  # `vault list|prune`, vault_cache's entries on disk

    inventory.add_parser(commands)
    tiny = commands.add_parser("tiny-model", help="write a small random-weight glm5_next checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--quantize-bits", type=int, choices=(4, 6, 8), default=None)  # tiny_model.QUANTIZE_BITS (it imports mlx)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--drafter", metavar="DRAFT_DIR",
                      help="also write a matching MTP drafter (--draft-model DRAFT_DIR --draft-kind mtp)")
    tiny.set_defaults(run=cmd_tiny_model)
    manifest = commands.add_parser("manifest", help="regenerate entry_points.toml and README's settings table from the declarations")
    manifest.add_argument("--write", action="store_true", help="write them (default: say which are stale)")
    manifest.set_defaults(run=cmd_manifest)
    prints = commands.add_parser("fingerprints", help="regenerate upstream fingerprints from the pinned releases")
    prints.add_argument("patch", nargs="*", help="only these patches (default: every installed one)")
    prints.add_argument("--write", action="store_true", help=f"update each patch's {drift.FILE_NAME} beside its declaration")
    prints.add_argument("--versions", nargs="*", help="mlx-vlm versions (default: upstream_pins.txt)")
    prints.add_argument("--cache", default=str(config.state_dir() / "releases"))
    prints.set_defaults(run=cmd_fingerprints)
    args = parser.parse_args(argv)
    if args.command in NEEDS_MLX:
        problem = backend.mlx_problem()
        if problem:
            print(f"glm53-patches {args.command}: {problem}", file=sys.stderr)
            return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

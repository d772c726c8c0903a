"""glm53-patches: status | list | doctor | verify | bench | stage | tiny-model | fingerprints."""

import argparse
import json
import os
import site
import sys
import time
from pathlib import Path

from . import bench, config, drift, pins, stage, verify_records


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
    """What this environment asks for and whether upstream matches a verified pin."""
    settings = config.read()
    patches = registry.available()
    view = {}
    for name, patch in patches.items():
        problems = drift.check(patch.all_fingerprinted())
        view[name] = {
            "requested": settings.wants(name, registry.covered_by_all(patch)),
            "env": patch.env_var,
            "numerics": patch.numerics,
            "drift": problems or None,
            "verified_on": drift.verified_versions(patch.all_fingerprinted()),
            "kernels_verified_here": {
                b: verify_records.passed(name, b) for b in patch.kernel_backends
            },
        }
    errors = settings.errors + config.unknown_name_errors(settings, patches)
    return {"environment_errors": errors, "plugin_errors": registry.status()["plugin_errors"], "patches": view}


def cmd_status(args):
    registry = _registry()
    report = {"here": _here(registry), "processes": _live_reports()}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    for error in report["here"]["environment_errors"] + report["here"]["plugin_errors"]:
        print(f"error: {error}")
    print("patch                      requested  upstream")
    for name, entry in report["here"]["patches"].items():
        upstream = "verified" if not entry["drift"] else "DRIFT: " + drift.summary(entry["drift"])
        print(f"{name:26} {'yes' if entry['requested'] else 'no':10} {upstream}")
    if not report["processes"]:
        print("no running process has applied patches")
    for process in report["processes"]:
        print(f"\nprocess {process['pid']} ({' '.join(process['argv'])[:60]}) backend={process['backend']} "
              f"mlx={process['mlx']} mlx-vlm={process['mlx_vlm']}")
        for error in process.get("hook_errors", []):
            print(f"  hook error: {error}")
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
    print(f"mlx {status['mlx']}; backend {registry.backend()}")
    here = _here(registry)
    for error in here["environment_errors"] + here["plugin_errors"]:
        print(f"error: {error}")
        problems += 1
    for name, entry in here["patches"].items():
        would = "would apply" if entry["requested"] and not entry["drift"] else (
            "requested but refused (drift)" if entry["requested"] else "not requested")
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
    from .upstream_import import import_language

    import_language()  # works on a bare GPU machine too
    backend = registry.backend()
    failed = 0
    print(f"{'patch':26} {'backend':8} {'result':24} time")
    for name in args.patches or list(patches):
        patch = patches[name]
        if patch.verify is None:
            print(f"{name:26} {backend:8} {'no check (nothing to verify)':24}")
            continue
        start = time.perf_counter()
        try:
            result = patch.verify()
        except Exception as exc:
            result = {"exact": False, "max_abs_diff": float("nan"), "cases": 0, "detail": f"check raised {exc!r}"}
        seconds = time.perf_counter() - start
        result = {**result, "passed": bool(result["exact"]), "seconds": round(seconds, 2), "date": time.strftime("%Y-%m-%d")}
        verify_records.record(name, backend, result)
        failed += not result["passed"]
        verdict = "exact" if result["passed"] else f"FAILED (max |d| {result['max_abs_diff']:.3g})"
        print(f"{name:26} {backend:8} {verdict:24} {seconds:.1f}s  {result['cases']} cases; {result['detail']}")
    return 1 if failed else 0


def cmd_tiny_model(args):
    from .tiny_model import write_tiny_model

    path = write_tiny_model(args.dir, quantize_bits=args.quantize_bits, seed=args.seed)
    print(path)
    return 0


def cmd_fingerprints(args):
    targets = sorted({t for p in _registry().available().values() for t in p.all_fingerprinted()})
    versions = args.versions or pins.mlx_vlm_versions()
    known = drift.regenerate(targets, versions, Path(args.cache))
    missing = [t for t in targets if t not in known]
    text = json.dumps(known, indent=1, sort_keys=True) + "\n"
    if args.write:
        drift.KNOWN_FILE.write_text(text)
        print(f"wrote {drift.KNOWN_FILE} ({len(known)} targets, versions {', '.join(versions)})")
    else:
        print(text)
    for target in missing:
        print(f"warning: {target} exists in none of {versions}", file=sys.stderr)
    return 1 if missing else 0


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
    verify.set_defaults(run=cmd_verify)
    bench.add_parser(commands)
    stage.add_parser(commands)
    from .patches.vault_cache import inventory  # `vault list|prune`, vault_cache's entries on disk

    inventory.add_parser(commands)
    tiny = commands.add_parser("tiny-model", help="write a small random-weight glm5_next checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--quantize-bits", type=int, choices=(4, 8), default=None)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=cmd_tiny_model)
    prints = commands.add_parser("fingerprints", help="regenerate upstream fingerprints from the pinned releases")
    prints.add_argument("--write", action="store_true", help=f"update {drift.KNOWN_FILE.name} in the package")
    prints.add_argument("--versions", nargs="*", help="mlx-vlm versions (default: upstream_pins.txt)")
    prints.add_argument("--cache", default=str(config.state_dir() / "releases"))
    prints.set_defaults(run=cmd_fingerprints)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

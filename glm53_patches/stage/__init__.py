"""glm53-patches stage: a patch as an mlx-vlm change (PATCH.diff, EVIDENCE.md, SUMMARY.md), checked.

For one patch and one mlx-vlm source tree (``--upstream``, or each pinned
release's wheel, unpacked into a cache):

1. generate the upstream form from the patch's own modules (``source.py``,
   driven by the patch's ``checks/upstream.py``) and write ``PATCH.diff``;
2. ``git apply --check``, then ``git apply``, in a clean git copy of the tree;
3. in that applied tree, in ``python -I -S`` on an import path without
   glm53-patches (``checks.isolated_path``): run the staged tests, and decode
   the tiny checkpoints greedily with the switch on and off (``runner.py``);
4. decode the same with the plugin applied to the stock tree, and compare
   the logits bit for bit;
5. write ``PATCH.diff``, ``EVIDENCE.md`` and ``SUMMARY.md`` (``pr.py``) and
   ``stage.json``. A failed stage writes ``stage.json`` alone, saying why;
   ``--no-run`` writes ``PATCH.diff`` and ``stage.json``.

Nothing here imports mlx at module level, so the CLI stays fast.
"""

import datetime
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .. import config, drift, pins
from .source import Description, StageError, describe, stage_source

__all__ = ["StageError", "Result", "stage", "stage_patches", "find_patch", "stageable", "add_parser", "main"]


@dataclass
class Result:
    """What staging one patch onto one tree gave."""

    patch: str
    pin: str
    tree: str
    tree_source: str
    date: str
    stageable: bool = True
    applies: bool = False
    error: str = ""
    diff: Dict = field(default_factory=dict)
    drift: Dict = field(default_factory=dict)
    tests: Dict = field(default_factory=dict)
    equivalence: Dict = field(default_factory=dict)
    backend: str = "cpu"
    mlx: str = ""
    seconds: float = 0.0
    out: str = ""

    @property
    def ok(self) -> bool:
        return not self.why

    @property
    def why(self) -> str:
        """Empty when the stage passed (or there is nothing to stage); else the first reason, one line."""
        if not self.stageable:
            return ""
        tests, eq = self.tests, self.equivalence
        reasons = [
            (self.error, self.error),
            (not self.applies, "the diff does not apply"),
            (tests and not tests.get("ok"), tests.get("error") or "the staged tests did not run"),
            (tests and tests.get("failed"), f"staged tests failed: {', '.join(tests.get('failed') or [])}"),
            (tests and not tests.get("passed"), "no staged test passed"),
            (tests and tests.get("counts", {}).get("skipped"), "staged tests were skipped"),
            (eq and not eq.get("ok"), eq.get("error") or "the equivalence check failed"),
        ]
        why = next((str(text).strip() for failed, text in reasons if failed), "")
        return why.splitlines()[-1] if why else ""  # a traceback's last line says what failed


# -- which patches, which trees ------------------------------------------------------------------


def find_patch(name: str):
    """The Patch called ``name``: installed plugins first, then the patches/ folder."""
    from .. import registry

    patch = registry.available().get(name)
    if patch is not None:
        return patch
    try:
        module = importlib.import_module(f"glm53_patches.patches.{name}")
    except ModuleNotFoundError:
        raise StageError(f"no patch named {name!r} (installed: {', '.join(registry.available())})") from None
    return module.PATCH


def stageable() -> Dict[str, object]:
    """Every patch the plugins provide or the patches/ folder holds, by name."""
    from .. import registry

    found = dict(registry.available())
    folder = Path(__file__).resolve().parents[1] / "patches"
    for path in sorted(folder.iterdir()):
        if (path / "__init__.py").is_file() and path.name not in found:
            try:
                found[path.name] = importlib.import_module(f"glm53_patches.patches.{path.name}").PATCH
            except Exception as exc:  # a patch being written must not stop the others
                found[path.name] = exc
    return dict(sorted(found.items()))


def default_cache() -> Path:
    return config.state_dir() / "releases"


def pinned_trees(cache: Path, versions: Optional[List[str]] = None) -> Dict[str, Path]:
    """{version: unpacked wheel} for each pinned mlx-vlm (downloaded once into ``cache``)."""
    return {v: drift.unpack_release(v, Path(cache)) for v in (versions or pins.mlx_vlm_versions())}


def tiny_models(cache: Path) -> Dict[str, str]:
    """The fp32 and 4-bit tiny checkpoints the logits comparison decodes (written once)."""
    from ..tiny_model import write_tiny_model

    models = {}
    for name, bits in (("fp32", None), ("q4", 4)):
        folder = Path(cache) / f"tiny-{name}"
        if not (folder / "config.json").is_file():
            partial = Path(tempfile.mkdtemp(prefix=f"tiny-{name}-", dir=cache))
            write_tiny_model(partial, quantize_bits=bits)
            shutil.rmtree(folder, ignore_errors=True)
            partial.rename(folder)
        models[name] = str(folder)
    return models


def _tree_version(tree: Path) -> str:
    """The mlx-vlm version of a source tree (mlx_vlm/version.py), else its path."""
    text = (tree / "mlx_vlm" / "version.py").read_text() if (tree / "mlx_vlm" / "version.py").is_file() else ""
    for line in text.splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("'\"")
    return str(tree)


# -- one patch, one tree ---------------------------------------------------------------------


OUTPUTS = ("PATCH.diff", "EVIDENCE.md", "SUMMARY.md", "PR.md")  # PR.md: what stage wrote before


def stage(patch, tree: Path, out: Path, *, models: Optional[Dict[str, str]] = None, run: bool = True,
          tree_source: str = "", pin: Optional[str] = None, work: Optional[Path] = None) -> Result:
    """Stage ``patch`` onto ``tree``; write into ``out`` what passed (module docstring) and stage.json.

    ``run`` False stops after ``git apply --check``/``git apply``. ``models``
    (from ``tiny_models``) is needed when ``run`` is True.
    """
    from .. import registry

    started = time.perf_counter()
    tree, out = Path(tree).resolve(), Path(out)
    result = Result(patch=patch.name, pin=pin or _tree_version(tree), tree=str(tree),
                    tree_source=tree_source or str(tree), date=datetime.date.today().isoformat())
    try:
        described = describe(patch)
    except StageError as exc:
        result.error = f"upstream.py: {exc}"
        return _write(result, out, {})
    if described is None:
        result.stageable = False
        result.error = "no checks/upstream.py in the patch folder: nothing to stage"
        return result
    if run and models is None:
        models = tiny_models(default_cache())
    owned_work = work is None
    work = Path(tempfile.mkdtemp(prefix=f"stage-{patch.name}-")) if owned_work else Path(work)
    files = {}
    try:
        files = _stage_into(result, patch, described, tree, work, models, run)
    except StageError as exc:
        result.error = str(exc)
    except (OSError, subprocess.SubprocessError) as exc:  # git missing, a run timed out, ...
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if owned_work:
            shutil.rmtree(work, ignore_errors=True)
    import mlx.core as mx

    result.backend = registry.backend()
    result.mlx = mx.__version__
    result.seconds = round(time.perf_counter() - started, 1)
    if result.ok and run:
        from . import pr

        record = asdict(result)
        files["EVIDENCE.md"] = pr.evidence(described, patch, record, files["PATCH.diff"], _checkpoints(models))
        files["SUMMARY.md"] = pr.summary(described, patch, record)
    return _write(result, out, files if result.ok else {})


def _write(result: Result, out: Path, files: Dict[str, str]) -> Result:
    """``files`` and stage.json into ``out``; what an earlier stage wrote there goes first."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    result.out = str(out)
    record = {"ok": result.ok, "why": result.why, "written": sorted(files) + ["stage.json"], **asdict(result)}
    (out / "stage.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return result


def _checkpoints(models: Dict[str, str]) -> Dict[str, str]:
    """{name: 'N layers, hidden H, float32' or '..., 4-bit'} of the tiny checkpoints."""
    found = {}
    for name, folder in (models or {}).items():
        config = json.loads((Path(folder) / "config.json").read_text())
        text = config.get("text_config", config)
        bits = config.get("quantization", {}).get("bits")
        found[name] = (f"{text.get('num_hidden_layers')} layers, hidden {text.get('hidden_size')}, "
                       + (f"{bits}-bit weights" if bits else f"{text.get('dtype', 'float32')} weights"))
    return found


def _stage_into(result, patch, described: Description, tree, work, models, run) -> Dict[str, str]:
    """Fill ``result``; return the files to write if it passes ({'PATCH.diff': text})."""
    from . import checks, pr

    staged = stage_source(described, tree)
    diff = staged.diff()
    work.mkdir(parents=True, exist_ok=True)
    diff_path = work / "PATCH.diff"
    diff_path.write_text(diff, encoding="utf-8")
    result.diff = {
        "lines": diff.count("\n"),
        "bytes": len(diff.encode()),
        "added": sum(1 for l in diff.splitlines() if l.startswith("+") and not l.startswith("+++")),
        "removed": sum(1 for l in diff.splitlines() if l.startswith("-") and not l.startswith("---")),
        "files": {**{p: "new" for p in staged.new_files}, **{p: "changed" for p in staged.changed_files}},
    }
    result.drift = drift.check_patch(patch, root=tree)
    repo = checks.git_copy(tree, work / "tree")
    check = checks.git_apply(repo, diff_path, check=True)
    if check.returncode:
        result.error = f"git apply --check failed: {check.stderr.strip()[-1500:]}"
        return {}
    applied = checks.git_apply(repo, diff_path, check=False)
    if applied.returncode:
        result.error = f"git apply failed: {applied.stderr.strip()[-1500:]}"
        return {}
    if "offset" in applied.stderr:
        result.error = f"git apply needed offsets: {applied.stderr.strip()[-500:]}"
        return {}
    changes = checks.git_changes(repo)
    expected = {p: "??" for p in staged.new_files} | {p: "M" for p in staged.changed_files}
    if changes != expected:
        result.error = f"git apply changed {changes}, expected {expected}"
        return {}
    result.applies = True
    pr.check(described, diff, [stock for stock, _ in staged.changed_files.values()])
    if not run:
        return {"PATCH.diff": diff}
    tests = checks.staged_tests(repo, list(described.tests.values()), described.switch_module, work / "pytest")
    result.tests = _summary(tests, ("exit_code", "seconds", "counts", "passed", "failed", "outcomes",
                                    "enabled_at_import", "isolation", "blocked_imports", "mlx_vlm_file"))
    if described.fast_path:
        root = patch.folder().parents[described.package.count(".")]  # the import root of an outside plugin too
        plugin = checks.plugin_logits(tree, models, patch.name, described.package, work / "plugin",
                                      described.equivalence, plugin_fast_path(described), str(root))
        staged_run = checks.staged_logits(repo, models, described.switch, described.switch_module,
                                          described.fast_path, work / "staged", described.equivalence)
        result.equivalence = _equivalence(patch, plugin, staged_run, work, described.gpu_only)
    return {"PATCH.diff": diff}


def plugin_fast_path(described: Description) -> Optional[str]:
    """The plugin module that FAST_PATH's upstream module is generated from (warm-cold runs call it)."""
    if described.equivalence != "warm-cold":
        return None
    upstream = described.fast_path.partition(":")[0]
    for module, path in described.modules.items():
        if path[:-3].replace("/", ".") == upstream:
            return module
    raise StageError(f"{described.name}: FAST_PATH {described.fast_path} is not in a module of MODULES")


def _summary(report: Dict, keys) -> Dict:
    summary = {k: report.get(k) for k in keys if k in report}
    summary["ok"] = bool(report.get("ok")) and report.get("exit_code", 0) == 0
    if not report.get("ok"):
        summary["error"] = report.get("error") or report.get("output", "")[-2000:]
    elif report.get("exit_code"):
        summary["error"] = report.get("output", "")[-3000:]
    return summary


def _equivalence(patch, plugin: Dict, staged: Dict, work: Path, gpu_only: bool = False) -> Dict:
    from . import checks

    summary = {"ok": False}
    if not plugin.get("ok") or not staged.get("ok"):
        summary["error"] = "plugin run: " + str(plugin.get("error", "ok")) + "\nstaged run: " + str(staged.get("error", "ok"))
        return summary
    summary.update(checks.compare_logits(work / "plugin" / "plugin.safetensors", work / "staged" / "staged.safetensors"))
    hits = plugin.get("plugin_stats", {}).get("hits", {})
    summary["plugin_hits"] = hits
    summary["served"] = staged.get("fast_path", {}).get("served", 0)
    summary["declined"] = staged.get("fast_path", {}).get("declined", 0)
    summary["served_when_off"] = staged.get("fast_path_off", {}).get("served", 0)
    summary["enabled_at_import"] = staged.get("enabled_at_import")
    summary["kind"] = staged.get("equivalence", "logits")
    summary["case_specs"] = staged.get("cases")
    summary["isolation"] = staged.get("isolation")
    summary["blocked_imports"] = staged.get("blocked_imports")
    summary["ok"] = (
        all(summary["staged_equals_plugin"].values())
        and all(summary["off_equals_stock"].values())
        and (patch.numerics != "exact" or all(summary["staged_equals_stock"].values()))
        and _fast_path_ran(summary, hits, plugin, gpu_only)
        and summary["served_when_off"] == 0
        and summary["enabled_at_import"] in (True, None)
        and not summary["blocked_imports"]
    )
    return summary


def _fast_path_ran(summary, hits, plugin, gpu_only):
    """Served and counted; for a GPU-only kernel on the CPU: reached, declined and counted as a fallback."""
    from ..registry import backend

    if gpu_only and backend() == "cpu":
        fallbacks = plugin.get("plugin_stats", {}).get("fallbacks", {})
        return summary["served"] == 0 and summary["declined"] > 0 and sum(fallbacks.values()) > 0
    return summary["served"] > 0 and sum(hits.values()) > 0


# -- many ----------------------------------------------------------------------------------------


def stage_patches(names: List[str], trees: Dict[str, Path], out: Path, *, run: bool = True,
                  cache: Optional[Path] = None, nested: bool = True, progress=None,
                  upstream_given: bool = False) -> List[Result]:
    """Stage each patch onto each tree ({version: folder}).

    Output goes to out/<patch>/mlx-vlm-<version>/, without the levels that
    have a single entry.
    """
    patches = stageable()
    models = tiny_models(Path(cache or default_cache())) if run else None
    results = []
    today = datetime.date.today().isoformat()
    # Each stage's scratch folder goes at the end, not after each stage: here (ext4 mounted with
    # `discard`) a clone right after deleting the last one's ~1,600 files took 2-3 s instead of 0.2.
    with tempfile.TemporaryDirectory(prefix="stage-") as scratch:
        for name in names:
            patch = patches.get(name) if name in patches else find_patch(name)
            if isinstance(patch, Exception):
                results.append(Result(name, "-", "", "", today, stageable=False,
                                      error=f"the patch does not import: {patch!r}"))
                continue
            try:
                described = describe(patch)
            except StageError as exc:
                results.append(Result(name, "-", "", "", today, error=f"upstream.py: {exc}"))
                continue
            if described is None:
                results.append(Result(name, "-", "", "", today, stageable=False,
                                      error="no checks/upstream.py in the patch folder: nothing to stage"))
                continue
            for label, tree in trees.items():
                folder = Path(out)
                if nested and len(names) > 1:
                    folder = folder / name
                if nested and len(trees) > 1:
                    folder = folder / f"mlx-vlm-{label}"
                if progress:
                    progress(f"staging {name} onto mlx-vlm {label} ...")
                results.append(stage(patch, tree, folder, models=models, run=run,
                                     tree_source=(f"the source tree {tree}" if upstream_given else
                                                  f"the {label} wheel from PyPI, unpacked"), pin=label,
                                     work=Path(scratch) / f"{name}-{label}"))
    return results


def table(results: List[Result]) -> str:
    rows = [("patch", "mlx-vlm", "applies", "diff lines", "diff bytes", "staged tests", "logits vs plugin", "result")]
    for r in results:
        if not r.stageable:
            rows.append((r.patch, r.pin, "-", "-", "-", "-", "-", r.error))
            continue
        tests = r.tests
        tests_cell = (f"{tests.get('passed', 0)} passed, {len(tests.get('failed') or [])} failed"
                      + (f", {tests['counts']['skipped']} skipped" if tests.get("counts", {}).get("skipped") else "")
                      if tests else "not run")
        eq = r.equivalence
        if not eq:
            eq_cell = "not run"
        elif "staged_equals_plugin" in eq:
            same = sum(eq["staged_equals_plugin"].values())
            eq_cell = f"{'bitwise' if eq['ok'] else 'DIFFER'} {same}/{len(eq['cases'])}, {eq['served']} served"
        else:
            eq_cell = "ERROR"
        verdict = "ok" if r.ok else f"FAILED: {r.why[:120]}"
        if r.drift:
            verdict += f" (drift: {len(r.drift)} upstream objects never verified)"
        rows.append((r.patch, r.pin, "applies" if r.applies else "DOES NOT APPLY",
                     str(r.diff.get("lines", "-")), str(r.diff.get("bytes", "-")), tests_cell, eq_cell, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


# -- command line ----------------------------------------------------------------------------------


def missing(run: bool) -> str:
    """What stage needs and this environment lacks, as one line ('' when nothing)."""
    if shutil.which("git") is None:
        return "git is not on PATH, and stage applies the diff with it: install git"
    if run and importlib.util.find_spec("pytest") is None:
        return ("pytest is not installed here, and the staged tests run under it: "
                "pip install 'glm53-patches[stage]' (or pass --no-run to stop after git apply)")
    return ""


def run_command(args) -> int:
    if bool(args.patch) == bool(args.all):
        print("stage: name one patch, or --all", file=sys.stderr)
        return 2
    lacking = missing(run=not args.no_run)
    if lacking:
        print(f"stage: {lacking}", file=sys.stderr)
        return 2
    if args.upstream:
        trees = {_tree_version(Path(args.upstream)): Path(args.upstream)}
    else:
        trees = pinned_trees(Path(args.cache), args.pin)
    names = list(stageable()) if args.all else [args.patch]
    try:
        results = stage_patches(names, trees, Path(args.out), run=not args.no_run, cache=Path(args.cache),
                                progress=lambda m: print(m, file=sys.stderr, flush=True),
                                upstream_given=bool(args.upstream))
    except StageError as exc:
        print(f"stage: {exc}", file=sys.stderr)
        return 2
    print(table(results))
    summary = Path(args.out) / "summary.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str) + "\n")
    print(f"wrote {args.out}/: per patch and pin, stage.json, and where the stage passed PATCH.diff, "
          "EVIDENCE.md and SUMMARY.md (a draft for a person to rewrite); summary.json")
    if not args.all and not results[0].stageable:
        return 2
    return 0 if all(r.ok for r in results) else 1


def add_arguments(parser):
    parser.add_argument("patch", nargs="?", help="the patch to stage (or --all)")
    parser.add_argument("--all", action="store_true", help="every patch, and print a table")
    parser.add_argument("--upstream", help="an mlx-vlm source tree (default: each pinned release's wheel)")
    parser.add_argument("--out", required=True, help="where PATCH.diff, EVIDENCE.md, SUMMARY.md and stage.json go")
    parser.add_argument("--pin", action="append", help="only this pinned mlx-vlm version (repeatable)")
    parser.add_argument("--no-run", action="store_true", help="only generate and git-apply; run no tests")
    parser.add_argument("--cache", default=str(default_cache()), help="where pinned wheels and tiny models are kept")


def add_parser(subparsers):
    """Register ``stage`` on the glm53-patches command line."""
    parser = subparsers.add_parser("stage", help="write a patch as an mlx-vlm pull request, and check it",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(run=run_command)
    return parser


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="glm53-patches stage", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

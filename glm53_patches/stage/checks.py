"""Checks of a staged patch: git apply, staged tests and logits in clean interpreters."""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

RUNNER = Path(__file__).with_name("runner.py")
REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds glm53_patches/
GIT = ["git", "-c", "user.name=glm53-stage", "-c", "user.email=stage@localhost", "-c", "commit.gpgsign=false"]
PACKAGE = "glm53_patches"


def site_path() -> List[str]:
    """The folders ``site`` puts on sys.path here: user site (where enabled), site-packages,
    and the folders their .pth files name. No .pth ``import`` line runs (that is the point of -S)."""
    import site

    folders = ([site.getusersitepackages()] if site.ENABLE_USER_SITE else []) + site.getsitepackages()
    owned = owned_names()
    path = []
    for folder in folders:
        if not os.path.isdir(folder) or folder in path:
            continue
        path.append(folder)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".pth") or name in owned:  # an editable install's .pth names our source
                continue
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                lines = [line.strip() for line in f]
            entries = [os.path.join(folder, line) for line in lines
                       if line and not line.startswith(("#", "import ", "import\t"))]
            path += [e for e in entries if os.path.isdir(e) and e not in path]
    return path


def owned_names() -> set:
    """Top-level names that the installed glm53-patches put in its site folder (its RECORD:
    the package, its .dist-info, the bootstrap .pth, an editable install's .pth), and the package."""
    from importlib import metadata

    try:
        files = metadata.distribution("glm53-patches").files or []
    except metadata.PackageNotFoundError:
        files = []
    return {PACKAGE} | {f.parts[0] for f in files if f.parts and f.parts[0] != ".."}


def isolated_path(work: Path) -> List[str]:
    """site_path() without glm53-patches: a folder that holds any of its names is replaced
    by a folder of links to everything else in it (mlx, pytest, mlx-vlm's dependencies)."""
    owned = owned_names()
    path = []
    for folder in site_path():
        names = os.listdir(folder)
        if owned.isdisjoint(names):
            path.append(folder)
            continue
        Path(work).mkdir(parents=True, exist_ok=True)
        view = Path(tempfile.mkdtemp(prefix=f"{Path(folder).name}-", dir=work))
        for name in names:
            if name not in owned:
                (view / name).symlink_to(Path(folder) / name)
        path.append(str(view))
    return path


def clean_environment(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """os.environ without GLM53_*, PYTHON* and any staged switch, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("GLM53_", "PYTHON", "MLX_VLM_"))
    }
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env.update(extra or {})
    return env


def run_isolated(job: Dict, work: Path, *, env: Dict[str, str], timeout: float = 600) -> Dict:
    """Run runner.py on ``job`` in ``python -I -S``; return its JSON report."""
    work.mkdir(parents=True, exist_ok=True)
    job = {**job, "work": str(work), "out": str(work / f"{job['task']}-report.json")}
    job_path = work / f"{job['task']}-job.json"
    job_path.write_text(json.dumps(job, indent=1))
    completed = subprocess.run(
        [sys.executable, "-I", "-S", str(RUNNER), str(job_path)],
        cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
    )
    (work / f"{job['task']}-output.txt").write_text(completed.stdout + completed.stderr)
    try:
        report = json.loads(Path(job["out"]).read_text())
    except (OSError, ValueError):
        report = {"ok": False, "error": f"runner exited {completed.returncode}: {completed.stderr[-2000:]}"}
    report["output"] = completed.stdout[-3000:] + completed.stderr[-3000:]
    return report


# -- git ------------------------------------------------------------------------------------


_UPSTREAM_REPOS: Dict[Path, Path] = {}  # tree -> its one-commit repository, made once per process


def git_copy(tree: Path, dest: Path) -> Path:
    """A clean git repository holding a copy of the upstream tree's mlx_vlm/.

    A clone of one repository per tree, committed once per process: committing
    the ~1,600 files again for every patch and pin took most of ``stage --all``.
    """
    tree = Path(tree).resolve()
    if tree not in _UPSTREAM_REPOS:
        origin = Path(tempfile.mkdtemp(prefix="upstream-"))
        atexit.register(shutil.rmtree, origin, ignore_errors=True)
        shutil.copytree(tree / "mlx_vlm", origin / "mlx_vlm", ignore=shutil.ignore_patterns("__pycache__"))
        # one pack, so that each clone links one file instead of every object
        for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "upstream"], ["repack", "-a", "-d", "-q"]):
            subprocess.run(GIT + command, cwd=origin, check=True, capture_output=True)
        _UPSTREAM_REPOS[tree] = origin
    dest.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(GIT + ["clone", "-q", str(_UPSTREAM_REPOS[tree]), str(dest)], check=True, capture_output=True)
    return dest


def git_apply(repo: Path, diff: Path, check: bool) -> subprocess.CompletedProcess:
    """``git apply [--check]``: git applies only when every context line matches (no fuzz)."""
    command = GIT + ["apply", "--verbose"] + (["--check"] if check else []) + [str(diff)]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True)


def git_changes(repo: Path) -> Dict[str, str]:
    """{path: status} of the working tree against the upstream commit."""
    listing = subprocess.run(GIT + ["status", "--porcelain", "-uall"], cwd=repo, check=True,
                             capture_output=True, text=True).stdout
    return {line[3:]: line[:2].strip() for line in listing.splitlines()}


# -- jobs -------------------------------------------------------------------------------------


def staged_tests(repo: Path, tests: List[str], switch_module: Optional[str], work: Path) -> Dict:
    """The staged tests, run in the applied tree with glm53_patches unimportable."""
    job = {
        "task": "pytest", "isolated": True, "tree": str(repo),
        "path": [str(repo)] + isolated_path(work),
        "tests": [str(repo / t) for t in tests], "switch_module": switch_module,
    }
    return run_isolated(job, work, env=clean_environment())


def staged_logits(repo: Path, models: Dict[str, str], switch: Optional[str], switch_module: Optional[str],
                  fast_path: str, work: Path, equivalence: str = "logits") -> Dict:
    """Greedy logits of the tiny checkpoints in the applied tree, switch on (then off)."""
    job = {
        "task": "logits", "isolated": True, "tree": str(repo), "equivalence": equivalence,
        "path": [str(repo)] + isolated_path(work), "models": models,
        "switch_module": switch_module, "fast_path": fast_path, "arrays": str(work / "staged.safetensors"),
    }
    return run_isolated(job, work, env=clean_environment({switch: "1"} if switch else {}))


def plugin_logits(tree: Path, models: Dict[str, str], name: str, package: str, work: Path,
                  equivalence: str = "logits", fast_path: Optional[str] = None, package_root: str = "") -> Dict:
    """The same logits from the stock tree with the plugin's patch applied (and without).

    ``warm-cold``: ``fast_path`` names the plugin module whose
    ``write_exact_cache_snapshot``/``load_exact_cache_file`` make the warm runs.
    """
    job = {
        "task": "logits", "isolated": False, "tree": str(tree), "equivalence": equivalence,
        "plugin_module": fast_path,
        "path": [str(tree), str(REPO_ROOT)] + ([package_root] if package_root else []) + site_path(), "models": models,
        "plugin": {"name": name, "package": package}, "arrays": str(work / "plugin.safetensors"),
    }
    state = tempfile.mkdtemp(prefix="glm53-stage-state-")
    try:
        return run_isolated(job, work, env=clean_environment({"GLM53_PATCHES_STATE_DIR": state}))
    finally:
        shutil.rmtree(state, ignore_errors=True)


def compare_logits(plugin_file: Path, staged_file: Path) -> Dict:
    """Per case: staged == plugin, switch off == stock, staged == stock, and how far staged is from stock."""
    import mlx.core as mx

    from ..exactness import same_bits

    plugin, staged = mx.load(str(plugin_file)), mx.load(str(staged_file))
    cases = sorted(k.split("/", 1)[1] for k in plugin if k.startswith("plugin/"))
    result = {"cases": cases, "staged_equals_plugin": {}, "off_equals_stock": {}, "staged_equals_stock": {},
              "max_abs_diff_vs_stock": {}, "tokens_equal_stock": {}}
    for case in cases:
        stock, on = plugin[f"stock/{case}"], staged[f"staged/{case}"]
        result["staged_equals_plugin"][case] = same_bits(plugin[f"plugin/{case}"], on)
        result["staged_equals_stock"][case] = same_bits(stock, on)
        if f"off/{case}" in staged:
            result["off_equals_stock"][case] = same_bits(stock, staged[f"off/{case}"])
        if stock.shape == on.shape:
            result["max_abs_diff_vs_stock"][case] = mx.abs(stock.astype(mx.float32) - on.astype(mx.float32)).max().item()
            result["tokens_equal_stock"][case] = bool(mx.array_equal(mx.argmax(stock, -1), mx.argmax(on, -1)).item())
        result.setdefault("tokens", {})[case] = int(plugin[f"plugin/{case}"].shape[0])
    return result

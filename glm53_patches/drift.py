"""Drift guard: AST fingerprints of the upstream objects a patch touches.

A fingerprint is the SHA-256 of the object's AST with docstrings removed, so
formatting and comments do not count but any change of code does. Fingerprints
are read from source files, never by importing, so they can be computed for
every pinned mlx-vlm release straight from its wheel.
"""

import ast
import functools
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional

FILE_NAME = "fingerprints.json"  # one per patch, beside its declaration: two patch PRs never touch one file


def split_target(target: str):
    """'pkg.mod:Owner.attr' -> ('pkg.mod', 'Owner.attr')."""
    module, _, qualname = target.partition(":")
    return module, qualname


def _strip_docstrings(node):
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return node


def _find(tree: ast.Module, qualname: str):
    scope = tree
    for part in qualname.split("."):
        for node in getattr(scope, "body", []):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part:
                scope = node
                break
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    scope = node
                    break
            if isinstance(node, ast.ImportFrom) and scope is tree:
                # A module-level name bound by an import (glm5_next's `linear`): the fingerprint is
                # of where it comes from; the object itself is fingerprinted where it is defined.
                alias = next((a for a in node.names if (a.asname or a.name) == part), None)
                if alias is not None:
                    scope = ast.ImportFrom(module=node.module, names=[alias], level=node.level)
                    break
        else:
            return None
    return scope


def _canonical(value) -> str:
    """Like ast.dump, but stable across Python versions: fields that are empty
    or None are left out, since newer Pythons add such fields (3.12's
    `type_params`) to nodes that older ones dump without them."""
    if isinstance(value, ast.AST):
        fields = [
            f"{name}={_canonical(field)}"
            for name, field in ast.iter_fields(value)
            if field is not None and field != []
        ]
        return f"{type(value).__name__}({','.join(fields)})"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(item) for item in value) + "]"
    return repr(value)


def _digest(node) -> str:
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:16]


def fingerprint_source(source: str, qualname: str) -> Optional[str]:
    """Fingerprint `qualname` in a module's source text; None if it is absent."""
    node = _find(ast.parse(source), qualname)
    return None if node is None else _digest(_strip_docstrings(node))


def module_path(root: Path, module: str) -> Path:
    """The source file of `module` inside a site-packages-like `root`."""
    base = Path(root, *module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def installed_root(package: str = "mlx_vlm") -> Optional[Path]:
    """The folder holding the installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


@functools.lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module:
    """Parse each source file once (keyed by its stat), docstrings stripped."""
    return _strip_docstrings(ast.parse(Path(path).read_text(encoding="utf-8")))


def _fingerprint_file(path: Path, qualname: str) -> Optional[str]:
    stat = path.stat()
    node = _find(_parsed(str(path), stat.st_mtime_ns, stat.st_size), qualname)
    return None if node is None else _digest(node)


def fingerprint(target: str, root: Optional[Path] = None) -> Optional[str]:
    module, qualname = split_target(target)
    if root is None:
        loaded = sys.modules.get(module)
        path = Path(loaded.__file__) if loaded is not None else None
        if path is None:
            root = installed_root(module.split(".")[0])
            if root is None:
                return None
            path = module_path(root, module)
    else:
        path = module_path(root, module)
    if not path.is_file():
        return None
    return _fingerprint_file(path, qualname)


def load_known(path: Path) -> Dict[str, Dict[str, List[str]]]:
    """{target: {fingerprint: [mlx-vlm versions]}} from one patch's file ({} if it has none)."""
    path = Path(path)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def known_for(patch) -> Dict[str, Dict[str, List[str]]]:
    return load_known(patch.fingerprints_path())


def check_patch(patch, root=None) -> Dict[str, str]:
    """{target: problem} for the patch's targets and relied-on objects, against its own fingerprints."""
    return check(patch.all_fingerprinted(), known_for(patch), root)


def check(targets: Iterable[str], known, root=None) -> Dict[str, str]:
    """{target: problem} for every target whose fingerprint is not in `known`."""
    problems = {}
    for target in targets:
        found = fingerprint(target, root)
        if found is None:
            problems[target] = "not found in the installed mlx-vlm"
        elif found not in known.get(target, {}):
            problems[target] = f"fingerprint {found} was never verified"
    return problems


def summary(problems: Dict[str, str], shown: int = 2) -> str:
    """One short line for a log or a table; `status --json` has the full list."""
    items = [f"{target.split(':')[-1]} ({problem})" for target, problem in problems.items()]
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return f"{len(items)} upstream object(s) differ from every verified mlx-vlm: " + "; ".join(items[:shown]) + more


def verified_versions(patch) -> List[str]:
    """Pinned versions on which every object the patch fingerprints has a known fingerprint."""
    known, targets = known_for(patch), patch.all_fingerprinted()
    sets = [set(v for versions in known.get(t, {}).values() for v in versions) for t in targets]
    return sorted(set.intersection(*sets)) if sets else []


# -- regeneration ---------------------------------------------------------


def unpack_release(version: str, cache: Path) -> Path:
    """Download (once) and unpack the mlx-vlm wheel of `version`; return its root."""
    root = cache / f"mlx_vlm-{version}"
    if (root / "mlx_vlm").is_dir():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--only-binary=:all:", "--dest", tmp, f"mlx-vlm=={version}"],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("mlx_vlm/") and m.endswith(".py")]
            archive.extractall(root, members)
    return root


def regenerate(targets: Iterable[str], versions: Iterable[str], cache: Path) -> Dict:
    """Fingerprint `targets` in every release in `versions`."""
    known: Dict[str, Dict[str, List[str]]] = {}
    for version in versions:
        root = unpack_release(version, cache)
        for target in targets:
            found = fingerprint(target, root)
            if found is not None:
                known.setdefault(target, {}).setdefault(found, []).append(version)
    return {t: {fp: sorted(v, key=_version_key) for fp, v in fps.items()} for t, fps in sorted(known.items())}


def _version_key(version: str):
    return tuple(int(p) if p.isdigit() else p for p in version.split("."))

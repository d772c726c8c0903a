"""The upstream form of a patch, generated from the patch's own modules.

A patch folder's ``checks/upstream.py`` (pure data) says what the pull request is:

``MODULES``      {plugin module: new mlx-vlm file}. A key is a module of the
                 patch folder (``"step"``) or a full name
                 (``"glm53_patches.kernels.x"``).
``PLUGIN_ONLY``  top-level names (functions, classes, assignments) those
                 modules define for the plugin alone (e.g. the wrapper it
                 installs); dropped, with the comment lines right above them.
``REPLACE``      optional {top-level name: upstream source}: a definition or
                 assignment that must read differently upstream (e.g. a
                 setting read from GLM53_* variables; keep these rare).
``TEXT``         optional {plugin text: upstream text}: replaced inside string
                 literals only (docstrings included), e.g. a kernel name or a
                 sentence that names the plugin. Each must occur somewhere.
``SWITCH``       ``MLX_VLM_...`` variable, or None when upstream runs it always.
                 The first module gets ``ENABLED``, read once at import.
``HOOKS``        [{file, function, import, code}]: ``code`` goes first in the
                 body of ``function`` (a qualname, found in the AST of ``file``
                 in the tree being staged, so line numbers do not matter) and
                 ``import`` among that file's imports.
``TESTS``        {file in the patch folder: path under mlx_vlm/tests/}:
                 upstream-style tests, copied as they are.
``FAST_PATH``    ``"module:function"`` whose non-None results count as hits.
``EQUIVALENCE``  optional: ``"logits"`` (the default: greedy decoding of the
                 tiny checkpoints, staged vs plugin vs stock) or
                 ``"warm-cold"`` (for a cache patch: each checkpoint decoded
                 cold, and warm from an entry written and read back through
                 ``DiskBlockStore``; see ``runner.py``).
``GPU_ONLY``     optional ``True``: the fast path runs on GPUs only (a kernel);
                 on the CPU the staged hook must be reached and decline.
``TITLE``, ``SUMMARY``, ``MEASURED``: the pull request material (see ``pr.py``):
                 a title, a short factual summary in upstream terms (what the
                 change does, where it is exact), and the measurements of this
                 change, each ``(label, PATCH.md section, excerpt)``: the label
                 starts with the backend (CPU, CUDA, Metal) and names the
                 hardware; the excerpt is quoted from that section.

A plugin module becomes an upstream module by these rules only:

1. ``mlx_vlm.*`` imports become relative to the new file; imports of other
   mapped modules become imports of their new files.
2. Imports of anything else from ``glm53_patches`` (``from . import PATCH``,
   ``config``, ...) are dropped, and so is every top-level assignment that
   uses a dropped name (``stats = PATCH.stats``).
3. Counters: every statement ``<dropped name>.<method>(...)``, at any depth
   (``stats.hit()``, ``stats.fallback(reason)``), is dropped. A block left
   empty is an error: the plugin code must not need its counters to work.
4. ``PLUGIN_ONLY`` and ``REPLACE`` as above (``TEXT`` first of all).
5. An import that the drops above left unused goes too (``functools`` used
   only by a plugin-only wrapper), and the relative imports close up into one
   block; then ``ENABLED`` after the imports.
6. Names imported from the plugin's shared helpers (``INLINED``: backend
   detection, the kernel builder) are copied in: their definitions, with what
   they use of their module, after the imports, and the imports those need.
   A staged module stands alone, and two pull requests never add one file.

Everything else is kept byte for byte, comments included. The result must
parse, use no dropped name and never mention glm53.
"""

import ast
import difflib
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import drift

PLUGIN_ROOT = "glm53_patches"
INLINED = ("glm53_patches.backend", "glm53_patches.kernels.build", "glm53_patches.kernels.rowwise")  # rule 6


class StageError(ValueError):
    """The patch cannot be put into upstream form (or not onto this tree)."""


@dataclass
class Description:
    """A patch's upstream.py, checked and with paths resolved."""

    name: str
    package: str  # e.g. glm53_patches.patches.compiled_kda_decode
    folder: Path
    title: str
    switch: Optional[str]
    modules: Dict[str, str]  # full plugin module name -> mlx_vlm/... path
    plugin_only: Tuple[str, ...]
    replace: Dict[str, str]
    hooks: Tuple[Dict[str, str], ...]
    tests: Dict[str, str]  # file in the folder -> mlx_vlm/tests/... path
    fast_path: Optional[str]
    summary: str
    measured: Tuple[Tuple[str, str, str], ...]
    data: object = field(repr=False, default=None)
    text: Dict[str, str] = field(default_factory=dict)  # TEXT: substitutions inside string literals
    equivalence: str = "logits"  # EQUIVALENCE: which check the logits runs make
    gpu_only: bool = False  # GPU_ONLY: on the CPU the fast path declines every call

    @property
    def switch_module(self) -> Optional[str]:
        """The upstream module that holds ``ENABLED`` (the first new module)."""
        return _module_name(next(iter(self.modules.values()))) if self.switch else None


def _module_name(path: str) -> str:
    """'mlx_vlm/models/x/y.py' -> 'mlx_vlm.models.x.y'."""
    if not path.startswith("mlx_vlm/") or not path.endswith(".py"):
        raise StageError(f"{path!r}: upstream files are .py files under mlx_vlm/")
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def package_of(patch) -> str:
    """The package that declares ``patch`` (its checks/upstream.py holds the staging data): ``Patch.package``."""
    return patch.package


def describe(patch) -> Optional[Description]:
    """The patch's upstream description, or None when it has no upstream.py."""
    package = package_of(patch)
    try:
        data = importlib.import_module(f"{package}.checks.upstream")  # staging data sits with the checks
    except ModuleNotFoundError as exc:
        if exc.name in (f"{package}.checks", f"{package}.checks.upstream"):
            return None
        raise
    folder = Path(data.__file__).parent.parent  # the patch folder (PATCH.md)
    missing = [key for key in ("TITLE", "SUMMARY", "MODULES") if not hasattr(data, key)]
    if missing:
        raise StageError(f"{patch.name}: upstream.py does not define {', '.join(missing)}")
    modules = {}
    for key, path in data.MODULES.items():
        full = key if key.startswith(f"{PLUGIN_ROOT}.") else f"{package}.{key}"
        _module_name(path)
        modules[full] = path
    tests = dict(getattr(data, "TESTS", {}))
    for source, path in tests.items():
        if not (folder / "checks" / source).is_file():
            raise StageError(f"{patch.name}: upstream test {source!r} is not in {folder}")
        if not path.startswith("mlx_vlm/tests/test_"):
            raise StageError(f"{patch.name}: {path!r}: tests go to mlx_vlm/tests/test_*.py")
    return Description(
        name=patch.name,
        package=package,
        folder=folder,
        title=data.TITLE,
        switch=getattr(data, "SWITCH", None),
        modules=modules,
        plugin_only=tuple(getattr(data, "PLUGIN_ONLY", ())),
        replace=dict(getattr(data, "REPLACE", {})),
        hooks=tuple(getattr(data, "HOOKS", ())),
        tests=tests,
        fast_path=getattr(data, "FAST_PATH", None),
        summary=data.SUMMARY.strip(),
        measured=_measured(patch.name, getattr(data, "MEASURED", ())),
        data=data,
        text=dict(getattr(data, "TEXT", {})),
        equivalence=_equivalence_kind(patch.name, getattr(data, "EQUIVALENCE", "logits")),
        gpu_only=bool(getattr(data, "GPU_ONLY", False)),
    )


EQUIVALENCES = ("logits", "warm-cold")
BACKENDS = ("CPU", "CUDA", "Metal")


def _measured(name: str, entries) -> Tuple[Tuple[str, str, str], ...]:
    for entry in entries:
        if not (isinstance(entry, tuple) and len(entry) == 3 and all(isinstance(e, str) for e in entry)):
            raise StageError(f"{name}: MEASURED entries are (label, PATCH.md section, excerpt): {entry!r}")
        if not entry[0].startswith(BACKENDS):
            raise StageError(f"{name}: MEASURED label {entry[0]!r} does not start with its backend "
                             f"({', '.join(BACKENDS)})")
    return tuple(entries)


def _equivalence_kind(name: str, kind: str) -> str:
    if kind not in EQUIVALENCES:
        raise StageError(f"{name}: EQUIVALENCE {kind!r} is not one of {', '.join(EQUIVALENCES)}")
    return kind


# -- imports -------------------------------------------------------------------------


def _absolute(node: ast.ImportFrom, module: str) -> str:
    """The absolute module an ImportFrom in ``module`` (a plugin module) reads from."""
    if not node.level:
        return node.module
    base = module.split(".")[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def relative(target: str, module: str) -> Tuple[int, str]:
    """(level, name) to import ``target`` from inside ``module`` (both in mlx_vlm)."""
    package = module.split(".")[:-1]
    parts = target.split(".")
    common = 0
    while common < min(len(package), len(parts)) and package[common] == parts[common]:
        common += 1
    if common == 0:
        raise StageError(f"{target} is not inside {package[0]}")
    return len(package) - common + 1, ".".join(parts[common:])


def _from_import(level: int, name: str, aliases) -> str:
    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
    return f"from {'.' * level}{name} import {names}"


# -- line edits ------------------------------------------------------------------------


def _span(node) -> Tuple[int, int]:
    """0-based [start, end) line span of a statement, decorators included."""
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return start - 1, node.end_lineno


def _apply_edits(lines: List[str], edits) -> List[str]:
    """edits: [(start, end, replacement lines)], non-overlapping."""
    out = list(lines)
    for start, end, replacement in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        out[start:end] = replacement
    return out


def _comment_lines_above(lines: List[str], start: int) -> int:
    while start > 0 and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return start


def _tidy_blank_lines(lines: List[str]) -> List[str]:
    """At most two blank lines in a row, none at the end."""
    out = []
    for line in lines:
        if not line.strip() and len(out) >= 2 and not out[-1].strip() and not out[-2].strip():
            continue
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def _bound(node) -> set:
    """Names a top-level definition or assignment binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _names_used(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _in_strings(source: str, substitutions: Dict[str, str], used: set) -> str:
    """``source`` with each {old: new} replaced inside its string literals only."""
    if not substitutions:
        return source
    data = source.encode()
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line.encode()))
    spans, inside_fstrings = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):  # its parts carry the f-string's position
            inside_fstrings.update(id(n) for n in ast.walk(node) if n is not node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in inside_fstrings:
            spans.append((offsets[node.lineno - 1] + node.col_offset, offsets[node.end_lineno - 1] + node.end_col_offset))
    out, last = [], 0
    for start, end in sorted(spans):
        segment = data[start:end].decode()
        for old, new in substitutions.items():
            if old in segment:
                used.add(old)
                segment = segment.replace(old, new)
        out += [data[last:start], segment.encode()]
        last = end
    return b"".join(out + [data[last:]]).decode()


def _tidy_imports(text: str, used_before: set) -> str:
    """Without the top-level imports whose names the plugin used and the upstream
    text no longer does; relative imports (once plugin and mlx_vlm groups) in one block."""
    tree = ast.parse(text)
    used = _names_used(tree)
    lines = text.splitlines(keepends=True)
    edits = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
            if not bound & used and bound & used_before:
                edits.append((*_span(node), []))
    kept = [n for n in _leading_imports(tree) if not any(e[0] == _span(n)[0] for e in edits)]
    for before, after in zip(kept, kept[1:]):
        relative_pair = all(isinstance(n, ast.ImportFrom) and n.level for n in (before, after))
        if relative_pair and not "".join(lines[before.end_lineno:after.lineno - 1]).strip():
            edits.append((before.end_lineno, after.lineno - 1, []))
    lines = _tidy_blank_lines(_apply_edits(lines, edits))
    # One blank line at most among the leading imports (a dropped group leaves two).
    imports = _leading_imports(ast.parse("".join(lines)))
    start, end = (imports[0].lineno - 2, imports[-1].end_lineno) if imports else (0, 0)
    return "".join(l for i, l in enumerate(lines) if not start <= i < end or l.strip() or lines[i - 1].strip())


def upstream_module(source: str, module: str, target_path: str, described: Description, switch: Optional[str],
                    used_text: Optional[set] = None) -> str:
    """The upstream text of plugin module ``module`` (see the module docstring)."""
    target = _module_name(target_path)
    mapped = {m: _module_name(p) for m, p in described.modules.items()}
    used_before = _names_used(ast.parse(source))
    source = _in_strings(source, described.text, set() if used_text is None else used_text)
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    edits, dropped, inlined = [], set(), {}
    where = f"{module} ({described.name})"

    def drop(node, with_comments=False):
        start, end = _span(node)
        if with_comments:
            start = _comment_lines_above(lines, start)
        edits.append((start, end, []))

    plugin_roots = {PLUGIN_ROOT, described.package.split(".")[0]}  # this package's and the patch's own (an outside one)
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in {"mlx_vlm"} | plugin_roots:
                    raise StageError(f"{where}: write `import {alias.name}` as a from-import")
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, module)
            fulls = [f"{source_module}.{a.name}" for a in node.names]
            if source_module.split(".")[0] in plugin_roots:
                if source_module in mapped:
                    level, name = relative(mapped[source_module], target)
                    edits.append((*_span(node), [_from_import(level, name, node.names) + "\n"]))
                elif all(full in mapped for full in fulls):
                    packages = {mapped[f].rpartition(".")[0] for f in fulls}
                    if len(packages) != 1:
                        raise StageError(f"{where}: line {node.lineno}: split this import (one upstream package each)")
                    level, name = relative(packages.pop(), target)
                    renamed = []
                    for full, alias in zip(fulls, node.names):
                        new_name, bound = mapped[full].rpartition(".")[2], alias.asname or alias.name
                        renamed.append(ast.alias(new_name, None if bound == new_name else bound))
                    edits.append((*_span(node), [_from_import(level, name, renamed) + "\n"]))
                elif any(full in mapped for full in fulls):
                    raise StageError(f"{where}: line {node.lineno}: split this import (mapped and plugin names)")
                elif source_module in INLINED:
                    if any(a.asname and a.asname != a.name for a in node.names):
                        raise StageError(f"{where}: line {node.lineno}: import inlined helpers without `as`")
                    drop(node)
                    inlined.setdefault(source_module, set()).update(a.name for a in node.names)
                else:
                    drop(node)
                    dropped.update(a.asname or a.name for a in node.names)
            elif source_module.split(".")[0] == "mlx_vlm":
                level, name = relative(source_module, target)
                edits.append((*_span(node), [_from_import(level, name, node.names) + "\n"]))
        elif _bound(node) & set(described.plugin_only):
            drop(node, with_comments=True)
        elif _bound(node) & set(described.replace):
            (name,) = _bound(node) & set(described.replace)
            start, end = _span(node)
            text = described.replace[name].strip("\n") + "\n"
            edits.append((start, end, text.splitlines(keepends=True)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _names_used(node.value or ast.Pass()) & dropped:
            drop(node)
            dropped.update(_bound(node))

    # Counter statements, at any depth: `stats.hit(...)`.
    def is_counter(stmt):
        call = getattr(stmt, "value", None) if isinstance(stmt, ast.Expr) else None
        func = getattr(call, "func", None)
        return (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in dropped
        )

    covered = [(start, end) for start, end, _ in edits if start < end]
    for parent in ast.walk(tree):
        for attr in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(parent, attr, None)
            if not isinstance(block, list) or not block or not isinstance(block[0], ast.stmt):
                continue
            counters = [s for s in block if is_counter(s)]
            inside = any(s <= _span(block[0])[0] and _span(block[-1])[1] <= e for s, e in covered)
            if counters and len(counters) == len(block) and not inside:  # a dropped definition goes whole
                raise StageError(f"{where}: line {block[0].lineno}: a block holds only counters")
            for stmt in counters:
                start, end = _span(stmt)
                if any(s <= start and end <= e for s, e in covered):
                    continue  # inside a dropped or replaced definition
                if lines[start].strip().startswith(("if ", "for ", "while ")) or ";" in "".join(lines[start:end]):
                    raise StageError(f"{where}: line {stmt.lineno}: put the counter call on a line of its own")
                edits.append((start, end, []))

    out = _apply_edits(lines, edits)
    text = _tidy_imports("".join(_tidy_blank_lines(out)), used_before)
    if switch:
        text = _add_switch(text, switch)
    if inlined:
        text = _inline(text, inlined, where)
    _check_clean(text, dropped | set(described.plugin_only), where)
    return text


def _inline(text: str, inlined: Dict[str, set], where: str) -> str:
    """Rule 6: the helpers' definitions (and what they use of their module) after the imports and ENABLED."""
    tree = ast.parse(text)
    defined = set().union(*(_bound(n) for n in tree.body))
    have_imports = {ast.unparse(n) for n in _leading_imports(tree)}
    new_imports, blocks = [], []
    for helper, names in sorted(inlined.items()):
        spec = importlib.util.find_spec(helper)
        helper_source = Path(spec.origin).read_text(encoding="utf-8")
        helper_lines = helper_source.splitlines(keepends=True)
        helper_tree = ast.parse(helper_source)
        top = {name: node for node in helper_tree.body for name in _bound(node)}
        wanted, todo = set(), list(names)
        while todo:  # the closure of what the names use among the helper's top-level definitions
            name = todo.pop()
            if name in wanted:
                continue
            if name not in top:
                raise StageError(f"{where}: {helper} defines no {name!r} to inline")
            wanted.add(name)
            todo.extend(n for n in _names_used(top[name]) if n in top and n not in wanted)
        clash = wanted & defined
        if clash:
            raise StageError(f"{where}: inlining {sorted(clash)} from {helper} would shadow the module's own")
        nodes = [n for n in helper_tree.body if _bound(n) & wanted]
        used = set().union(*(_names_used(n) for n in nodes))
        for node in _leading_imports(helper_tree):
            bound = {(a.asname or a.name).split(".")[0] for a in node.names}
            if bound & used and ast.unparse(node) not in have_imports:
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PLUGIN_ROOT:
                    raise StageError(f"{where}: {helper} imports {node.module}, which cannot be inlined")
                new_imports.append(ast.unparse(node) + "\n")
                have_imports.add(ast.unparse(node))
        for node in nodes:
            start, end = _span(node)
            start = _comment_lines_above(helper_lines, start)
            blocks.append("".join(helper_lines[start:end]).rstrip("\n") + "\n")
    lines = text.splitlines(keepends=True)
    imports = _leading_imports(tree)
    at = imports[-1].end_lineno if imports else 0
    lines[at:at] = new_imports
    tree = ast.parse("".join(lines))
    body = [n for n in tree.body if not isinstance(n, ast.Expr) or n is not tree.body[0]]
    after = _leading_imports(tree)
    last = after[-1].end_lineno if after else 0
    for node in body:  # after ENABLED too, where there is one
        if isinstance(node, ast.Assign) and _bound(node) == {"ENABLED"}:
            last = node.end_lineno
    lines[last:last] = ["\n\n", "\n\n".join(blocks), "\n\n"]
    return "".join(_tidy_blank_lines("".join(lines).splitlines(keepends=True)))


def _add_switch(text: str, switch: str) -> str:
    """``import os`` (if missing) and ``ENABLED`` right after the leading imports."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    imports = _leading_imports(tree)
    if not imports:
        raise StageError("a module with a switch needs at least one import")
    switch_lines = [
        "\n",
        f"# Off unless {switch}=1 (read once, at import).\n",
        f'ENABLED = os.environ.get("{switch}", "0") == "1"\n',
    ]
    edits = [(imports[-1].end_lineno, imports[-1].end_lineno, switch_lines)]
    has_os = any(isinstance(n, ast.Import) and any(a.name == "os" and not a.asname for a in n.names) for n in imports)
    if not has_os:
        plain = [n for n in imports if isinstance(n, ast.Import) and "." not in n.names[0].name]
        after = [n for n in plain if n.names[0].name < "os"]
        line = after[-1].end_lineno if after else (plain[0].lineno - 1 if plain else imports[0].lineno - 1)
        edits.append((line, line, ["import os\n"]))
    return "".join(_apply_edits(lines, edits))


def _leading_imports(tree: ast.Module):
    """The import statements before the first other statement (a docstring aside)."""
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    imports = []
    for node in body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        imports.append(node)
    return imports


def _check_clean(text: str, dropped: set, where: str):
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise StageError(f"{where}: the upstream form does not parse: {exc}") from None
    left = _names_used(tree) & dropped
    if left:
        raise StageError(f"{where}: plugin-only names still used upstream: {', '.join(sorted(left))}")
    mentions = [i + 1 for i, line in enumerate(text.splitlines()) if re.search("glm53", line, re.I)]
    if mentions:
        raise StageError(f"{where}: the upstream form mentions glm53 on line(s) {mentions}")


# -- hooks into upstream files -----------------------------------------------------------


def insert_hook(source: str, hook: Dict[str, str], where: str) -> str:
    """``hook['code']`` first in ``hook['function']``, ``hook['import']`` among the imports."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    function = drift._find(tree, hook["function"])
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise StageError(f"{where}: {hook['function']} is not a function in {hook['file']}")
    body = function.body
    first = 1 if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) else 0
    anchor = body[first] if first < len(body) else body[-1]
    if anchor.lineno == function.lineno:
        raise StageError(f"{where}: {hook['function']} is written on one line")
    indent = " " * anchor.col_offset
    code = [indent + line if line.strip() else "\n" for line in hook["code"].strip("\n").splitlines(keepends=True)]
    code[-1] = code[-1].rstrip("\n") + "\n"
    insert_at = body[0].end_lineno if first else _span(anchor)[0]
    edits = [(insert_at, insert_at, code)]

    statement = ast.parse(hook["import"]).body
    if len(statement) != 1 or not isinstance(statement[0], (ast.Import, ast.ImportFrom)):
        raise StageError(f"{where}: hook import must be one import statement")
    new = statement[0]
    imports = _leading_imports(tree)
    if any(ast.dump(n) == ast.dump(new) for n in imports):
        pass  # already there (another hook of the same patch)
    else:
        edits.append((_import_position(imports, new), _import_position(imports, new), [hook["import"].strip() + "\n"]))
    text = "".join(_apply_edits(lines, edits))
    try:
        ast.parse(text)
    except SyntaxError as exc:
        raise StageError(f"{where}: {hook['file']} does not parse with the hook: {exc}") from None
    return text


def _import_position(imports, new) -> int:
    """0-based line before which ``new`` goes, in isort (profile black) order for
    relative imports: deeper levels first, then by module name; else at the end."""
    if not imports:
        raise StageError("the hooked file has no imports to place the hook's import among")

    def key(node):
        return (-node.level, node.module or "")

    if isinstance(new, ast.ImportFrom) and new.level:
        for node in imports:
            if isinstance(node, ast.ImportFrom) and node.level and key(node) > key(new):
                return node.lineno - 1
    return imports[-1].end_lineno


# -- the whole patch ------------------------------------------------------------------------


@dataclass
class Staged:
    """The files a patch adds to or changes in one upstream tree."""

    description: Description
    new_files: Dict[str, str]  # path -> text
    changed_files: Dict[str, Tuple[str, str]]  # path -> (stock text, staged text)

    def diff(self) -> str:
        return unified_diff(self.changed_files, self.new_files)


def _module_source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise StageError(f"cannot find the plugin module {module}")
    return Path(spec.origin).read_text(encoding="utf-8")


def stage_source(described: Description, tree: Path) -> Staged:
    """Generate the staged files of one patch for the upstream tree ``tree``."""
    tree = Path(tree)
    new_files, used_text = {}, set()
    for index, (module, path) in enumerate(described.modules.items()):
        if (tree / path).exists():
            raise StageError(f"{described.name}: {path} already exists in {tree}")
        switch = described.switch if index == 0 else None
        new_files[path] = upstream_module(_module_source(module), module, path, described, switch, used_text)
    unused = sorted(set(described.text) - used_text)
    if unused:
        raise StageError(f"{described.name}: TEXT entries found in no string literal: {unused}")
    for source, path in described.tests.items():
        if (tree / path).exists():
            raise StageError(f"{described.name}: {path} already exists in {tree}")
        text = (described.folder / "checks" / source).read_text(encoding="utf-8")
        _check_clean(text, set(), f"{described.name} test {source}")
        new_files[path] = text
    changed = {}
    for hook in described.hooks:
        path = hook["file"]
        if not (tree / path).is_file():
            raise StageError(f"{described.name}: {path} is not in {tree}")
        stock = changed[path][0] if path in changed else (tree / path).read_text(encoding="utf-8")
        current = changed[path][1] if path in changed else stock
        changed[path] = (stock, insert_hook(current, hook, described.name))
    return Staged(described, new_files, changed)


def unified_diff(changed: Dict[str, Tuple[str, str]], new: Dict[str, str]) -> str:
    """A git-style unified diff (a/ b/ prefixes) of changed and new text files."""
    chunks = []
    for path in sorted(set(changed) | set(new)):
        if path in new:
            before, after = "", new[path]
            header = [f"diff --git a/{path} b/{path}\n", "new file mode 100644\n", "--- /dev/null\n", f"+++ b/{path}\n"]
        else:
            before, after = changed[path]
            header = [f"diff --git a/{path} b/{path}\n", f"--- a/{path}\n", f"+++ b/{path}\n"]
        hunks = list(difflib.unified_diff(_diff_lines(before), _diff_lines(after), n=3, lineterm=""))[2:]
        if hunks:
            chunks.append("".join(header) + "".join(h if h.endswith("\n") else h + "\n" for h in hunks))
    return "".join(chunks)


def _diff_lines(text: str) -> List[str]:
    """Lines with their newline; a last line without one is marked the way git does."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines

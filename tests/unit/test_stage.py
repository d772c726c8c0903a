"""`glm53-patches stage`: every patch with an upstream form, on every pinned mlx-vlm.

For each (patch, pin): the diff applies with `git apply --check` and `git apply`
to a clean git copy of that release's source, touching exactly the files it
names; the staged tests pass there in an interpreter where glm53_patches
cannot be imported; and the tiny model's greedy logits from that tree are
bitwise those of the plugin applied to the stock release. Each pin's wheel is
downloaded once per session into a temporary cache.
"""

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches import pins, stage
from glm53_patches.exactness import same_bits
from glm53_patches.stage import checks, pr, runner, source

PINS = pins.mlx_vlm_versions()


def _described():
    found = {}
    for name, patch in stage.stageable().items():
        if not isinstance(patch, Exception) and source.describe(patch) is not None:
            found[name] = (patch, source.describe(patch))
    return found


DESCRIBED = _described()
CASES = [(name, pin) for name in DESCRIBED for pin in PINS]


def git(repo, *args, check=True):
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, check=check)


def clean_repo(tree, dest):
    """A git repository whose only commit is the release's mlx_vlm/ package."""
    dest.mkdir()
    subprocess.run(["cp", "-r", str(tree / "mlx_vlm"), str(dest)], check=True)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "release")
    return dest


def diff_files(diff_text):
    """{path: 'new' | 'changed'} from the diff's own headers."""
    files, current = {}, None
    for line in diff_text.splitlines():
        if line.startswith("diff --git a/"):
            current = line.split(" b/", 1)[1]
            files[current] = "changed"
        elif line == "new file mode 100644":
            files[current] = "new"
    return files


# -- the upstream form is the plugin's code ----------------------------------------------------------


def _top_level_names(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


class _InStrings(ast.NodeTransformer):
    """Applies upstream.py's TEXT substitutions to string constants (outside f-strings)."""

    def __init__(self, substitutions):
        self.substitutions = substitutions

    def visit_JoinedStr(self, node):
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            for old, new in self.substitutions.items():
                node.value = node.value.replace(old, new)
        return node


class _DropCallsOn(ast.NodeTransformer):
    """Removes statements `name.method(...)` for the given names."""

    def __init__(self, names):
        self.names = names

    def visit_Expr(self, node):
        func = getattr(node.value, "func", None)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.names:
            return None
        return node


def _bound_name(imported):
    """The name an (absolute module, name, alias) import binds."""
    base, name, alias = imported
    return alias or (name or base).split(".")[0]


def _imports(tree, module):
    """{(absolute module, name, alias)} of a module's top-level from-imports."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.rpartition(".")[0]) \
                if node.level else node.module
            found.update((base, a.name, a.asname) for a in node.names)
        elif isinstance(node, ast.Import):
            found.update((a.name, None, a.asname) for a in node.names)
    return found


@pytest.mark.parametrize("name", DESCRIBED)
def test_upstream_module_is_the_plugin_module(name, releases):
    """Same statements, in the same order, as the plugin module, except: plugin
    wiring (names that do not exist upstream, and calls on them), the declared
    plugin-only definitions and rewrites, TEXT in string literals, imports left
    unused, and the switch."""
    patch, described = DESCRIBED[name]
    staged = source.stage_source(described, releases[PINS[0]])
    defined = set()  # top-level names of all the plugin modules
    for module, path in described.modules.items():
        plugin_tree = _InStrings(described.text).visit(ast.parse(Path(importlib.util.find_spec(module).origin).read_text()))
        upstream_tree = ast.parse(staged.new_files[path])
        upstream_module = path[:-3].replace("/", ".")
        defined |= _top_level_names(plugin_tree)
        gone = _top_level_names(plugin_tree) - _top_level_names(upstream_tree)
        assert gone >= set(described.plugin_only) & _top_level_names(plugin_tree)
        # declared upstream rewrites: compared by name only
        replaced = set(described.replace) & _top_level_names(plugin_tree)
        kept = [
            ast.dump(_DropCallsOn(gone).visit(node))
            for node in plugin_tree.body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (_top_level_names(ast.Module([node], [])) & (gone | replaced))
        ]
        # Rule 6: definitions of the shared helpers the module imports, copied in verbatim.
        helpers = {base for base, _, _ in _imports(plugin_tree, module) if base in source.INLINED}
        helper_nodes = {name: node for helper in helpers
                        for node in ast.parse(Path(importlib.util.find_spec(helper).origin).read_text()).body
                        for name in _top_level_names(ast.Module([node], []))}
        inlined = [node for node in upstream_tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))
                   and _top_level_names(ast.Module([node], [])) & set(helper_nodes)
                   and not _top_level_names(ast.Module([node], [])) & _top_level_names(ast.Module(
                       [n for n in plugin_tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))], []))]
        for node in inlined:
            (name, *_) = sorted(_top_level_names(ast.Module([node], [])))
            assert ast.dump(node) == ast.dump(helper_nodes[name]), name
        upstream = [
            ast.dump(node)
            for node in upstream_tree.body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (described.switch and _top_level_names(ast.Module([node], [])) == {"ENABLED"})
            and not (_top_level_names(ast.Module([node], [])) & replaced)
            and node not in inlined
        ]
        assert upstream == kept
        assert replaced <= _top_level_names(upstream_tree)
        # Imports: the plugin's, minus glm53_patches, resolved to the same modules.
        new_names = {m: p[:-3].replace("/", ".") for m, p in described.modules.items()}
        plugin_imports = set()
        for base, imported, alias in _imports(plugin_tree, module):
            if f"{base}.{imported}" in new_names:  # `from . import step`: another mapped module
                local = alias or imported  # upstream keeps the local name: `import kda_cuda as cuda`
                base, imported = new_names[f"{base}.{imported}"].rpartition(".")[::2]
                alias = local if local != imported else None
            plugin_imports.add((new_names.get(base, base), imported, alias))
        plugin_imports = {i for i in plugin_imports if not i[0].startswith("glm53_patches")}
        # An import the plugin used and upstream no longer does (left by the drops) goes.
        plugin_used, upstream_used = ({n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                                      for t in (plugin_tree, upstream_tree))
        plugin_imports = {i for i in plugin_imports
                          if _bound_name(i) in upstream_used or _bound_name(i) not in plugin_used}
        upstream_imports = _imports(upstream_tree, upstream_module)
        helper_imports = set().union(*(_imports(ast.parse(Path(importlib.util.find_spec(h).origin).read_text()), h)
                                       for h in helpers)) if helpers else set()
        assert upstream_imports - {("os", None, None)} - helper_imports == plugin_imports - {("os", None, None)} - helper_imports
        assert helper_imports >= upstream_imports - plugin_imports - {("os", None, None)}
        enabled = [n for n in upstream_tree.body if _top_level_names(ast.Module([n], [])) == {"ENABLED"}]
        if described.switch and module == next(iter(described.modules)):  # the switch module
            assert ("os", None, None) in upstream_imports
            assert len(enabled) == 1 and described.switch in ast.unparse(enabled[0])
        else:
            assert not enabled
        assert "glm53" not in staged.new_files[path].lower()
    assert set(described.plugin_only) | set(described.replace) <= defined


@pytest.mark.parametrize("pin", PINS)
@pytest.mark.parametrize("name", DESCRIBED)
def test_hooks_go_first_in_the_function_on_every_pin(name, pin, releases):
    """Remove the hook lines and the one added import: the stock file's AST is back."""
    _, described = DESCRIBED[name]
    staged = source.stage_source(described, releases[pin])
    for path, (stock_text, staged_text) in staged.changed_files.items():
        assert stock_text == (releases[pin] / path).read_text()
        tree = ast.parse(staged_text)
        for hook in (h for h in described.hooks if h["file"] == path):
            owner = tree
            *outer, function_name = hook["function"].split(".")
            for part in outer:
                owner = next(n for n in owner.body if isinstance(n, ast.ClassDef) and n.name == part)
            function = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == function_name)
            hook_code = ast.parse(hook["code"]).body
            start = 1 if ast.get_docstring(function) else 0
            assert [ast.dump(n) for n in function.body[start:start + len(hook_code)]] == [ast.dump(n) for n in hook_code]
            del function.body[start:start + len(hook_code)]
            added = ast.dump(ast.parse(hook["import"]).body[0])
            tree.body = [n for n in tree.body if ast.dump(n) != added]
        assert ast.dump(tree) == ast.dump(ast.parse(stock_text))


# -- the rules, on a synthetic plugin module ------------------------------------------------------------

PROBE = '''"""A plugin module."""

import functools

from mlx_vlm.models.cache import ArraysCache
from glm53_patches import config
from glm53_patches.kernels import helper as kernel_helper

from . import PATCH

stats = PATCH.stats
KNOB = config.knob("probe", "knob")


@functools.lru_cache
def fast(x):
    if x is None:
        stats.fallback("none")  # counted
        return None
    stats.hit()
    return kernel_helper.run(x, ArraysCache)


# The wrapper the plugin installs.
def make_call(original):
    return original
'''


def probe_description(**changes):
    fields = dict(
        name="probe", package="glm53_patches.patches.probe", folder=Path("."), title="t", switch="MLX_VLM_PROBE",
        modules={"glm53_patches.patches.probe.step": "mlx_vlm/models/glm5_next/probe.py",
                 "glm53_patches.kernels.helper": "mlx_vlm/models/glm5_next/probe_kernel.py"},
        plugin_only=("make_call",), replace={"KNOB": 'KNOB = os.environ.get("MLX_VLM_PROBE_KNOB")'},
        hooks=(), tests={}, fast_path=None, summary="", measured=(),
    )
    fields.update(changes)
    return source.Description(**fields)


def probe_upstream(text=PROBE, **changes):
    return source.upstream_module(text, "glm53_patches.patches.probe.step", "mlx_vlm/models/glm5_next/probe.py",
                                  probe_description(**changes), "MLX_VLM_PROBE")


def test_rules_on_a_synthetic_module():
    text = probe_upstream()
    lines = text.splitlines()
    assert lines[:5] == ['"""A plugin module."""', "", "import functools", "import os", ""]
    assert "from ..cache import ArraysCache" in lines
    assert "from . import probe_kernel as kernel_helper" in lines
    assert 'KNOB = os.environ.get("MLX_VLM_PROBE_KNOB")' in lines
    assert 'ENABLED = os.environ.get("MLX_VLM_PROBE", "0") == "1"' in lines
    for gone in ("PATCH", "stats", "make_call", "The wrapper", "glm53", "config", "counted"):
        assert gone not in text, gone
    function = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef))
    expected = ast.parse("@functools.lru_cache\ndef fast(x):\n    if x is None:\n        return None\n"
                         "    return kernel_helper.run(x, ArraysCache)\n").body[0]
    assert ast.dump(function) == ast.dump(expected)


@pytest.mark.parametrize("edit,message", [
    (("        return None\n", ""), "only counters"),
    (("    stats.hit()\n", "    print(PATCH.name)\n"), "plugin-only names"),
    (("    return original\n", "    return original\n\n\nHELP = 'see glm53 docs'\n"), "mentions glm53"),
    (("from glm53_patches import config\n", "from glm53_patches import config\nimport mlx_vlm.models.cache\n"),
     "from-import"),
])
def test_rules_refuse(edit, message):
    with pytest.raises(source.StageError, match=message):
        probe_upstream(PROBE.replace(*edit))


KERNEL_PROBE = '''"""Kernel for glm53_patches.patches.probe."""

import functools
import logging

from mlx_vlm.models.cache import ArraysCache

from glm53_patches.kernels import helper as kernel_helper

log = logging.getLogger("glm53_patches")
NAME = "glm53_probe_kernel"


def run(x):
    # not a string: glm53_probe_kernel stays in this comment
    return kernel_helper.launch(NAME, f"{x} never replaced", ArraysCache)


def make_call(original):
    return functools.wraps(original)(run)
'''


def test_text_in_strings_unused_imports_and_one_relative_block():
    """TEXT changes string literals only (a comment naming the plugin is still refused)."""
    used = set()
    description = probe_description(text={"glm53_probe_kernel": "probe_kernel", "glm53_patches.patches.": "",
                                          "never replaced": "replaced"},
                                    plugin_only=("make_call", "log"), replace={})
    text = source.upstream_module(KERNEL_PROBE.replace("    # not a string: glm53_probe_kernel stays in this comment\n", ""),
                                  "glm53_patches.patches.probe.step", "mlx_vlm/models/glm5_next/probe.py",
                                  description, None, used)
    assert used == {"glm53_probe_kernel", "glm53_patches.patches."}
    assert text.splitlines()[:6] == ['"""Kernel for probe."""', "", "from ..cache import ArraysCache",
                                     "from . import probe_kernel as kernel_helper", "", 'NAME = "probe_kernel"']
    assert 'f"{x} never replaced"' in text  # f-strings are left alone
    assert "import functools" not in text and "import logging" not in text  # used only by dropped names
    with pytest.raises(source.StageError, match="mentions glm53"):
        source.upstream_module(KERNEL_PROBE, "glm53_patches.patches.probe.step", "mlx_vlm/models/glm5_next/probe.py",
                               description, None)


def test_stage_source_refuses_text_found_nowhere(releases):
    _, described = DESCRIBED["hc_decode"]
    broken = source.Description(**{**vars(described), "text": {**described.text, "no such text": "x"}})
    with pytest.raises(source.StageError, match="no such text"):
        source.stage_source(broken, releases[PINS[0]])


def test_package_of_lazy_factories():
    """Factories declared with `lazy` live in glm53_patches.patch; the package is the one holding PATCH."""
    for name, (patch, described) in DESCRIBED.items():
        assert source.package_of(patch) == f"glm53_patches.patches.{name}" == described.package


HOOKED = '''import mlx.core as mx

from ..cache import ArraysCache
from .config import TextConfig


class Layer:
    def __call__(self, x):
        """Doc."""
        return x

    def short(self, x): return x
'''


def test_hook_placement_and_refusals():
    hook = {"file": "f.py", "function": "Layer.__call__", "import": "from . import fast", "code": "if fast.ON:\n    return 1\n"}
    text = source.insert_hook(HOOKED, hook, "probe")
    assert text.splitlines()[3:5] == ["from . import fast", "from .config import TextConfig"]
    assert '        """Doc."""\n        if fast.ON:\n            return 1\n        return x\n' in text
    with pytest.raises(source.StageError, match="one line"):
        source.insert_hook(HOOKED, {**hook, "function": "Layer.short"}, "probe")
    with pytest.raises(source.StageError, match="not a function"):
        source.insert_hook(HOOKED, {**hook, "function": "Layer.missing"}, "probe")


def test_diff_of_a_file_without_final_newline_applies(tmp_path):
    repo = tmp_path / "repo"
    (repo / "mlx_vlm").mkdir(parents=True)
    (repo / "mlx_vlm" / "a.py").write_text("x = 1\ny = 2")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    diff = source.unified_diff({"mlx_vlm/a.py": ("x = 1\ny = 2", "x = 1\ny = 3\n")}, {"mlx_vlm/b.py": "z = 0"})
    (tmp_path / "d.diff").write_text(diff)
    git(repo, "apply", "--check", str(tmp_path / "d.diff"))
    git(repo, "apply", str(tmp_path / "d.diff"))
    assert (repo / "mlx_vlm" / "a.py").read_text() == "x = 1\ny = 3\n"
    assert (repo / "mlx_vlm" / "b.py").read_text() == "z = 0"


# -- every patch, every pin: apply, run the staged tests without the plugin, same logits ---------------


def test_the_staged_interpreter_cannot_import_glm53_patches(tmp_path):
    """The staged runs' import path: mlx, mlx-vlm's dependencies and pytest, but no glm53-patches at all
    (neither its package nor its metadata), in `python -I -S` (no .pth file runs)."""
    path = checks.isolated_path(tmp_path / "work")
    probe = (
        "import importlib.util, sys; from importlib import metadata; sys.path[:0] = %r\n"
        "try:\n    metadata.distribution('glm53-patches'); installed = True\n"
        "except metadata.PackageNotFoundError:\n    installed = False\n"
        "print(importlib.util.find_spec('glm53_patches'), installed, 'site' in sys.modules,"
        " *(importlib.util.find_spec(m) is not None for m in ('mlx.core', 'pytest', 'transformers')))"
    ) % (path,)
    env = checks.clean_environment()
    assert not [k for k in env if k.startswith("GLM53_")]
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], env=env, cwd=tmp_path,
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["None", "False", "False", "True", "True", "True"], done.stdout
    # This environment's site-packages holds glm53-patches' metadata (an editable or wheel install),
    # so the staged path has a linked copy of it in its place, without those names.
    holder = next(f for f in checks.site_path() if not checks.owned_names().isdisjoint(__import__("os").listdir(f)))
    assert holder not in path
    copy = next(Path(p) for p in path if Path(p).parent == tmp_path / "work")
    assert (copy / "mlx").resolve() == (Path(holder) / "mlx").resolve()
    assert not checks.owned_names() & {child.name for child in copy.iterdir()}
    # While the same interpreter with site (the .pth files) can import it:
    done = subprocess.run([sys.executable, "-c", "import glm53_patches.registry"], cwd=tmp_path)
    assert done.returncode == 0


@pytest.mark.parametrize("name,pin", CASES)
def test_stage_applies_passes_and_matches_the_plugin(name, pin, releases, models, tmp_path):
    """On every pin the diff applies without fuzz and its tests pass in an interpreter that cannot
    import the plugin; on the newest, the staged tree also decodes as the plugin does."""
    patch, described = DESCRIBED[name]
    tree = releases[pin]
    result = stage.stage(patch, tree, tmp_path / "out", run=False, pin=pin)
    assert result.applies and not result.error, result.error
    diff = (tmp_path / "out" / "PATCH.diff").read_text()
    assert result.diff["lines"] == len(diff.splitlines()) and result.diff["bytes"] == len(diff.encode())

    repo = clean_repo(tree, tmp_path / "repo")
    git(repo, "apply", "--check", str(tmp_path / "out" / "PATCH.diff"))
    applied = git(repo, "apply", "--verbose", str(tmp_path / "out" / "PATCH.diff"))
    assert "offset" not in applied.stderr and "fuzz" not in applied.stderr
    status = {line[3:]: line[:2].strip() for line in git(repo, "status", "--porcelain", "-uall").stdout.splitlines()}
    expected = {path: ("??" if kind == "new" else "M") for path, kind in diff_files(diff).items()}
    assert status == expected
    assert set(described.tests.values()) <= {p for p, kind in diff_files(diff).items() if kind == "new"}

    tests = checks.staged_tests(repo, list(described.tests.values()), described.switch_module, tmp_path / "pytest")
    assert tests["ok"], tests.get("error")
    assert tests["exit_code"] == 0, tests["output"]
    assert tests["counts"]["tests"] > 0 and tests["counts"]["tests"] == tests["passed"], tests["counts"]
    assert tests["failed"] == [] and tests["counts"]["skipped"] == 0
    assert tests["isolation"]["glm53_patches_found"] is None and not tests["isolation"]["site_imported"]
    assert tests["isolation"]["glm53_patches_installed"] is None
    assert tests["blocked_imports"] == []
    assert Path(tests["mlx_vlm_file"]).resolve().is_relative_to(repo.resolve())
    if described.switch:
        assert tests["enabled_at_import"] is False  # default off
    if pin != PINS[0]:
        return  # an upstream PR targets the newest release: the logits runs are made there only (CI time)

    plugin = checks.plugin_logits(tree, models, name, described.package, tmp_path / "plugin",
                                  described.equivalence, stage.plugin_fast_path(described))
    staged = checks.staged_logits(repo, models, described.switch, described.switch_module,
                                  described.fast_path, tmp_path / "staged", described.equivalence)
    # "logits": greedy decoding, plugin applied vs staged tree; "warm-cold" (a cache
    # patch): decoding warm from an entry written and read back through DiskBlockStore,
    # plugin module vs staged tree, both also compared with the cold run ("stock/").
    assert plugin["equivalence"] == staged["equivalence"] == described.equivalence
    assert plugin["ok"], plugin.get("error")
    assert staged["ok"], staged.get("error")
    assert staged["isolation"]["glm53_patches_found"] is None and staged["blocked_imports"] == []
    assert staged["enabled_at_import"] is (True if described.switch else None)
    if described.gpu_only:  # a kernel: on the CPU the hook is reached and hands every call to stock
        assert staged["fast_path"]["served"] == 0 and staged["fast_path"]["declined"] > 0
        assert sum(plugin["plugin_stats"]["fallbacks"].values()) > 0
    else:
        assert staged["fast_path"]["served"] > 0 and sum(plugin["plugin_stats"]["hits"].values()) > 0
    plugin_arrays = mx.load(str(tmp_path / "plugin" / "plugin.safetensors"))
    staged_arrays = mx.load(str(tmp_path / "staged" / "staged.safetensors"))
    cases = [key.split("/", 1)[1] for key in plugin_arrays if key.startswith("plugin/")]
    assert len(cases) >= 3
    for case in cases:
        ref, got = plugin_arrays[f"plugin/{case}"], staged_arrays[f"staged/{case}"]
        assert ref.shape == got.shape and ref.shape[0] >= 12
        assert same_bits(ref, got), f"{case}: staged differs from the plugin"
        if patch.numerics == "exact":
            assert same_bits(plugin_arrays[f"stock/{case}"], got), f"{case}: differs from stock"
        if described.switch:  # switched off, the staged tree is the stock release
            assert same_bits(plugin_arrays[f"stock/{case}"], staged_arrays[f"off/{case}"])
    if described.switch:
        assert staged["fast_path_off"]["served"] == 0


def test_a_diff_is_exact_to_its_pin(releases, tmp_path):
    """The context of a diff staged on one pin does not match another pin's file."""
    name = next(iter(DESCRIBED))
    patch, described = DESCRIBED[name]
    texts = {pin: (releases[pin] / described.hooks[0]["file"]).read_text() for pin in PINS}
    first, other = PINS[0], next((p for p in PINS if texts[p] != texts[PINS[0]]), None)
    assert other is not None, "every pin has the same hooked file"
    stage.stage(patch, releases[first], tmp_path / "out", run=False, pin=first)
    repo = clean_repo(releases[other], tmp_path / "repo")
    check = git(repo, "apply", "--check", str(tmp_path / "out" / "PATCH.diff"), check=False)
    assert check.returncode != 0


def test_stage_reports_a_tree_without_the_hooked_function(releases, tmp_path):
    name = next(iter(DESCRIBED))
    patch, described = DESCRIBED[name]
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(releases[PINS[0]]), str(tree)], check=True)
    hook = described.hooks[0]
    path = tree / hook["file"]
    owner, function = hook["function"].rsplit(".", 1)
    head, tail = path.read_text().split(f"class {owner.split('.')[-1]}(", 1)
    tail = tail.replace(f"def {function}(", f"def renamed_{function.strip('_')}(", 1)
    path.write_text(f"{head}class {owner.split('.')[-1]}({tail}")
    result = stage.stage(patch, tree, tmp_path / "out", run=False)
    assert not result.applies and hook["function"] in result.error
    assert "DOES NOT APPLY" in stage.table([result])


# -- the command and the PR text --------------------------------------------------------------------------


FIRST_PERSON = re.compile(r"\b(I|[Mm]e|[Mm]y|[Ww]e|[Oo]ur)\b")


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _in_patch_md(excerpt, markdown):
    """An excerpt's table lines are the leading cells of a PATCH.md table line; its prose is in PATCH.md."""
    cells = _cells
    rows = [cells(line) for line in markdown.splitlines() if line.strip().startswith("|")]
    flat = " ".join(markdown.split())
    for paragraph in excerpt.strip().split("\n\n"):
        if paragraph.startswith("|"):
            assert all(any(row[:len(cells(line))] == cells(line) for row in rows) for line in paragraph.splitlines())
        else:
            assert " ".join(paragraph.split()) in flat, paragraph


@pytest.mark.parametrize("name", DESCRIBED)
def test_measurements_name_their_backend_and_come_from_patch_md(name):
    _, described = DESCRIBED[name]
    markdown = (described.folder / "PATCH.md").read_text()
    for label, section, excerpt in described.measured:
        assert label.split()[0] in ("CPU", "CUDA", "Metal"), label
        assert f"## {section}" in markdown
        _in_patch_md(excerpt, markdown)
        for word in ("did not finish", "killed", "crash", "refused", "timed out", "not run", "not timed"):
            assert word not in excerpt.lower()


def _staged_test_names(described):
    """The test functions of the staged test files (read from their source, not from a run)."""
    names = set()
    for source_file in described.tests:
        tree = ast.parse((described.folder / "checks" / source_file).read_text())
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return names


@pytest.mark.parametrize("name", [n for n in ("compiled_kda_decode", "latent_prefill") if n in DESCRIBED])
def test_a_passing_stage_writes_evidence_and_a_summary(name, releases, models, tmp_path):
    """EVIDENCE.md carries the diff's own counts, every staged test with its result, the equivalence
    cases and the quoted measurements; SUMMARY.md is marked for a person to rewrite. Neither speaks of
    the plugin or in the first person."""
    patch, described = DESCRIBED[name]
    out = tmp_path / "out"
    work = tmp_path / "work"
    result = stage.stage(patch, releases[PINS[0]], out, models=models, pin=PINS[0], work=work)
    assert result.ok, result.why
    assert {f.name for f in out.iterdir()} == {"PATCH.diff", "EVIDENCE.md", "SUMMARY.md", "stage.json"}
    evidence, summary = (out / "EVIDENCE.md").read_text(), (out / "SUMMARY.md").read_text()
    diff = (out / "PATCH.diff").read_text()
    for text in (evidence, summary):
        assert "glm53" not in text.lower() and "plugin" not in text.lower()
        assert not FIRST_PERSON.search(text), FIRST_PERSON.search(text)

    files = diff_files(diff)
    for path, chunk in zip(files, diff.split("diff --git ")[1:]):
        lines = chunk.splitlines()
        added = sum(1 for l in lines if l.startswith("+") and not l.startswith("+++"))
        removed = sum(1 for l in lines if l.startswith("-") and not l.startswith("---"))
        assert f"| `{path}` | {files[path]} | {added} | {removed} |" in evidence
    assert f"{len(diff.splitlines())} lines, {len(diff.encode())} bytes" in evidence

    rows = [line for line in evidence.split("## Staged tests", 1)[1].split("##", 1)[0].splitlines()
            if line.startswith("| `test_")]
    assert {row.split("`")[1].split("[")[0] for row in rows} == _staged_test_names(described)
    assert all(row.endswith("| passed |") for row in rows)
    assert f"**{len(rows)} passed, 0 failed, 0 skipped**" in evidence

    # The equivalence rows against the logits files the runs left in the work folder.
    plugin_arrays = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(work / "plugin" / "plugin.safetensors")).items()}
    staged_arrays = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(work / "staged" / "staged.safetensors")).items()}
    section = evidence.split("## Equivalence check", 1)[1].split("## Measurements", 1)[0]
    rows = {line.split(" | ")[0][2:]: _cells(line) for line in section.splitlines() if line.startswith("| ")}
    assert set(rows) - {"case"} == set(runner.CASES)
    for case, (checkpoint, prompts, steps) in runner.CASES.items():
        stock, on, off = plugin_arrays[f"stock/{case}"], staged_arrays[f"staged/{case}"], staged_arrays[f"off/{case}"]
        cells = rows[case]
        assert cells[:4] == [case, f"`{checkpoint}`", ", ".join(str(len(p)) for p in prompts), str(steps)]
        assert cells[4:6] == [("yes" if np.array_equal(stock, on) else "**no**"), "yes"] and np.array_equal(stock, off)
        if patch.numerics == "exact":
            assert cells[4] == "yes" and len(cells) == 6
        else:  # how far the switch-on logits are, and whether the greedy tokens stay
            assert float(cells[6]) == pytest.approx(np.abs(stock - on).max(), rel=0.01, abs=1e-12)
            assert cells[7] == ("yes" if np.array_equal(stock.argmax(-1), on.argmax(-1)) else "**no**")

    measured = evidence.split("## Measurements", 1)[1]
    for label, _, excerpt in described.measured:
        assert f"**{label}**" in measured and excerpt.strip() in measured

    assert summary.startswith(f"# {described.title}\n")
    assert "rewrite" in summary and "mlx-lm" in summary and "AI-written" in summary
    assert described.summary in summary and f"`{described.switch}=1`" in summary
    assert sorted(line[3:].split("`")[0] for line in summary.splitlines() if line.startswith("- `")) == sorted(files)
    record = json.loads((out / "stage.json").read_text())
    assert record["ok"] and record["written"] == ["EVIDENCE.md", "PATCH.diff", "SUMMARY.md", "stage.json"]


def test_a_failed_stage_writes_only_stage_json(releases, models, tmp_path):
    """Staged tests that cannot import: no diff, evidence or summary (and none left from before)."""
    name = next(iter(DESCRIBED))
    patch, _ = DESCRIBED[name]
    tree = tmp_path / "tree"
    subprocess.run(["cp", "-r", str(releases[PINS[0]]), str(tree)], check=True)
    with open(tree / "mlx_vlm/models/glm5_next/config.py", "a") as f:
        f.write("\nraise RuntimeError('broken on purpose')\n")
    out = tmp_path / "out"
    out.mkdir()
    for stale in ("PATCH.diff", "EVIDENCE.md", "SUMMARY.md", "PR.md"):
        (out / stale).write_text("from an earlier run")
    result = stage.stage(patch, tree, out, models=models)
    assert result.applies and not result.ok
    assert [f.name for f in out.iterdir()] == ["stage.json"]
    record = json.loads((out / "stage.json").read_text())
    assert record["ok"] is False and record["written"] == ["stage.json"] and record["why"]
    assert "broken on purpose" in record["tests"]["error"]


@pytest.mark.parametrize("summary,measured,message", [
    ("Also see glm53_patches.", (), "names the plugin"),
    ("We measured it.", (), "first person"),
    ("It keeps `_COMPILED_ELSEWHERE`.", (), "in neither the diff"),
    ("Faster with dsa_decode.", (), "names dsa_decode"),
    ("", (("CPU", "Measured (CPU)", "| fp32, B=1 | 2995 [2855, 3807] | 2898 [2809, 3554] | 1.04× |"),),
     "not in PATCH.md"),
    ("", (("CPU", "Measured (CPU)", "The first bf16 run had a wide spread, it did not finish."),),
     "a run without a result"),
    ("", (("CPU", "Measured (CPU)", "The first bf16 run had a wide spread (patched max 6055 µs)"),),
     "not in PATCH.md"),
])
def test_text_for_a_maintainer_is_refused(summary, measured, message, releases):
    patch, described = DESCRIBED["compiled_kda_decode"]
    staged = source.stage_source(described, releases[PINS[0]])
    stock = [s for s, _ in staged.changed_files.values()]
    pr.check(described, staged.diff(), stock)  # as shipped: accepted
    cut = (("CPU", "Measured (CPU)", "| case | stock µs/step |\n| --- | --- |\n| fp32, B=1 | 2995 [2855, 3807] |"),)
    pr.check(source.Description(**{**vars(described), "measured": cut}), staged.diff(), stock)  # cut after a column
    broken = source.Description(**{**vars(described), "summary": f"{described.summary} {summary}",
                                   "measured": described.measured + measured})
    with pytest.raises(source.StageError, match=message):
        pr.check(broken, staged.diff(), stock)


def test_a_measurement_without_its_backend_is_refused():
    with pytest.raises(source.StageError, match="does not start with its backend"):
        source._measured("probe", (("H200: one layer", "Measured", "x"),))

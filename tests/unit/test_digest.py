"""verify's code digest: the patch's folder and what it declares it uses, nothing more, nothing less."""

import ast
import dataclasses
import shutil

from glm53_patches import registry, verify_records

# Infrastructure every patch may import without declaring it (its behaviour is tested on its own).
CORE = {"glm53_patches", "glm53_patches.config", "glm53_patches.log", "glm53_patches.patch", "glm53_patches.hookspecs",
        "glm53_patches.stats", "glm53_patches.registry", "glm53_patches.backend", "glm53_patches.kernel_switch",
        "glm53_patches.verify_records", "glm53_patches.upstream_import"}


def _imported(path, package):
    """glm53_patches modules a runtime file imports, relative imports resolved against its package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {m for m in found if m.startswith("glm53_patches")}


def test_every_module_a_patch_borrows_is_declared_in_uses():
    for name, patch in registry.available().items():
        folder = patch.folder()
        declared = set(patch.uses)
        for path in folder.rglob("*.py"):
            if "checks" in path.relative_to(folder).parts:  # harness: not run when serving
                continue
            for module in _imported(path, patch.package):
                inside = module == patch.package or module.startswith(patch.package + ".")
                covered = inside or any(module == d or module.startswith(d + ".") or d.startswith(module + ".")
                                        for d in declared | CORE)
                assert covered, f"{name}: {path.name} imports {module}, not declared in Patch.uses"


def test_the_digest_follows_what_is_used_and_nothing_else(tmp_path, monkeypatch):
    """Real files: a copy of a patch whose used module is edited gets a new digest; an unused one does not."""
    package = tmp_path / "outside_patch"
    shutil.copytree(registry.available()["router_select"].folder(), package, ignore=shutil.ignore_patterns("__pycache__"))
    used, unused = tmp_path / "helper_used.py", tmp_path / "helper_unused.py"
    used.write_text("X = 1\n")
    unused.write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patch = dataclasses.replace(registry.available()["router_select"], package="outside_patch", uses=("helper_used",))
    labels = [label for label, _ in patch.source_files()]
    assert "helper_used:helper_used.py" in labels and "outside_patch:kernel.py" in labels
    assert not [label for label in labels if "unused" in label]
    before = verify_records.code_digest(patch)
    unused.write_text("Y = 2\n")
    assert verify_records.code_digest(patch) == before
    used.write_text("X = 2  # longer\n")
    assert verify_records.code_digest(patch) != before
    (package / "kernel.py").write_text((package / "kernel.py").read_text() + "\n# an edit\n")
    assert verify_records.code_digest(patch) != before


def test_fused_kda_kernels_digest_covers_the_compiled_step_it_calls():
    labels = [label for label, _ in registry.available()["fused_kda_kernel"].source_files()]
    assert "glm53_patches.patches.compiled_kda_decode.step:step.py" in labels
    assert not [label for label in labels if label.startswith("glm53_patches.checks.host_emulation")]


def _runtime_modules(patch):
    folder = patch.folder()
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder)
        if "checks" not in relative.parts and "__pycache__" not in relative.parts:
            yield ".".join((patch.package, *relative.with_suffix("").parts)).removesuffix(".__init__")


def test_runtime_code_never_imports_checks():
    """Checks and benchmarks sit apart (patches/<name>/checks/, glm53_patches/checks/): serving never loads them."""
    import subprocess
    import sys

    modules = [m for patch in registry.available().values() for m in _runtime_modules(patch)]
    for name, patch in registry.available().items():
        for path in patch.folder().rglob("*.py"):
            if "checks" in path.relative_to(patch.folder()).parts:
                continue
            assert not [m for m in _imported(path, patch.package) if ".checks" in m], (name, path.name)
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('glm53_patches') and 'checks' in m.split('.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout

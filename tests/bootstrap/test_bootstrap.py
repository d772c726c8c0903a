"""The .pth bootstrap, in real Python processes: silent and free when unused, never a traceback."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PTH = "glm53_patches_bootstrap.pth"
PROBE = (
    "import sys; heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
    "('glm53_patches', 'mlx', 'mlx_vlm', 'pluggy', 'wrapt')); print(heavy)"
)
PROBE_ALL = "import sys; print(sorted(sys.modules))"
# stdlib modules small enough to allow (the config parser's dataclasses, pathlib, stat)
STDLIB_SMALL = {"dataclasses", "inspect", "ast", "dis", "opcode", "_opcode", "collections.abc", "enum", "linecache",
                "tokenize", "token", "pathlib", "fnmatch", "ntpath", "urllib", "urllib.parse", "ipaddress",
                "typing", "copy", "keyword", "operator", "reprlib", "functools", "contextlib", "weakref",
                "_weakrefset", "re", "re._casefix", "re._compiler", "re._constants", "re._parser", "sre_compile",
                "sre_constants", "sre_parse", "_sre", "itertools", "collections", "heapq", "_heapq", "types",
                "warnings", "errno", "stat", "_stat", "posixpath", "genericpath", "string", "_string",
                "_collections", "_functools", "_operator", "_struct", "struct", "locale", "_locale", "importlib",
                "importlib._bootstrap", "importlib._bootstrap_external", "importlib.machinery", "textwrap",
                "_weakref", "logging", "threading", "traceback", "time", "atexit", "_threading_local", "encodings.idna",
                "stringprep", "unicodedata", "_thread", "os", "sys", "io", "abc", "_abc", "codecs", "_codecs",
                "math", "select", "selectors", "signal", "_signal", "fcntl", "_posixsubprocess", "subprocess", "zlib",
                "binascii", "_bisect", "bisect", "random", "_random", "_sha512", "hashlib", "_hashlib", "_blake2",
                "_sha1", "_sha256", "_md5", "_sha3", "base64", "_io"}
PATCHED = (
    "import mlx_vlm.models.glm5_next.language as L; "
    "print(L.Glm5NextLinearAttention.__dict__['__call__'].__code__.co_filename)"
)


def run(code, env_extra=None, args=()):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_no_variable_imports_nothing():
    result = run(PROBE)
    assert result.returncode == 0 and result.stdout.strip() == "[]" and result.stderr == ""


def test_a_variable_loads_only_the_stdlib_bootstrap():
    """With a GLM53_* variable the start-up imports the bootstrap and nothing heavy (issue: 60-70 ms)."""
    modules = set(eval(run(PROBE_ALL, {"GLM53_PATCHES": "all"}).stdout))
    baseline = set(eval(run(PROBE_ALL).stdout))
    added = modules - baseline
    assert "glm53_patches._bootstrap" in added
    heavy = {m for m in added if m.split(".")[0] in ("mlx", "mlx_vlm", "pluggy", "wrapt", "asyncio")
             or m.startswith("importlib.metadata")}
    assert not heavy, heavy
    assert added <= {"glm53_patches", "glm53_patches._bootstrap", "glm53_patches.config"} | STDLIB_SMALL, added


def test_the_hook_fires_once_after_the_module_ran_and_hides_itself(tmp_path):
    code = (
        "import sys, glm53_patches._bootstrap as b\n"
        "print(sum(isinstance(f, b.PostImportFinder) for f in sys.meta_path))\n"
        "import mlx_vlm.models.glm5_next.language as L\n"
        "from glm53_patches import registry\n"
        "print(sum(isinstance(f, b.PostImportFinder) for f in sys.meta_path), type(L.__loader__).__name__, "
        "registry.applied())\n"
    )
    result = run(code, {"GLM53_PATCHES": "compiled_kda_decode", "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.strip().splitlines()
    assert before == "1"
    assert after == "0 SourceFileLoader ['compiled_kda_decode']"


def test_patches_apply_when_upstream_imports_glm5_next(tmp_path):
    result = run(PATCHED, {"GLM53_PATCHES": "compiled_kda_decode", "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "glm53_patches/patches/compiled_kda_decode" in result.stdout
    assert "compiled_kda_decode: applied" in result.stderr


BAD_VALUES = (  # (environment, the variable its one line must name)
    ({"GLM53_PATCHES": "bogus"}, "GLM53_PATCHES"),
    ({"GLM53_PATCHES": "all", "GLM53_PATCH_COMPILED_KDA_DECODE": "maybe"}, "GLM53_PATCH_COMPILED_KDA_DECODE"),
    # a patch's own setting: nothing is applied either (it used to leave its patch applied)
    ({"GLM53_PATCHES": "all", "GLM53_GATHERED_PREFILL_MAX_ELEMENTS": "0"}, "GLM53_GATHERED_PREFILL_MAX_ELEMENTS"),
    ({"GLM53_PATCHES": "all", "GLM53_HC_DECODE_KERNEL": "sometimes"}, "GLM53_HC_DECODE_KERNEL"),
)


def test_bad_values_print_one_line_and_leave_stock_code(tmp_path):
    for env, variable in BAD_VALUES:
        result = run(PATCHED, {**env, "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
        assert result.returncode == 0
        assert result.stdout.strip().endswith("mlx_vlm/models/glm5_next/language.py")
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert variable in lines[0] and "accepted" in lines[0] and "no patch applied" in lines[0], lines


def test_yes_turns_a_kernel_knob_on_and_the_cpu_says_it_has_none(tmp_path):
    """The kernel knobs take the same words as every other switch; on the CPU, on is said, not ignored."""
    code = PATCHED + "; from glm53_patches.patches.hc_decode import layer; print(layer.kernel_wanted('cpu'))"
    result = run(code, {"GLM53_PATCHES": "hc_decode", "GLM53_HC_DECODE_KERNEL": "yes",
                        "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0 and "hc_decode: applied" in result.stderr, result.stderr
    assert "not valid" not in result.stderr and result.stdout.strip().endswith("False")


def test_a_state_dir_that_is_a_file_gets_one_warning(tmp_path):
    a_file = tmp_path / "state"
    a_file.write_text("")
    result = run(PATCHED, {"GLM53_PATCHES": "compiled_kda_decode", "GLM53_PATCHES_STATE_DIR": str(a_file)})
    assert result.returncode == 0 and "compiled_kda_decode: applied" in result.stderr, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "GLM53_PATCHES_STATE_DIR" in warnings[0] and str(a_file) in warnings[0], warnings


def test_strict_mode_raises(tmp_path):
    result = run(PATCHED, {"GLM53_PATCHES": "bogus", "GLM53_PATCHES_STRICT": "1", "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    assert result.returncode != 0 and "PatchError" in result.stderr


def test_missing_package_is_silent(tmp_path):
    """The .pth left behind without the package (or a broken sys.path) stays quiet."""
    (tmp_path / PTH).write_text((ROOT / PTH).read_text())
    code = f"import site, sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; site.addsitedir({str(tmp_path)!r}); print('ok')"
    result = run(code, {"GLM53_PATCHES": "all"}, args=("-S", "-I"))
    assert result.returncode == 0 and result.stdout.strip() == "ok" and result.stderr == ""


def test_the_wheel_carries_the_pth_at_its_root(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, timeout=300)
    (wheel,) = tmp_path.glob("glm53_patches-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert PTH in names and "glm53_patches/upstream_pins.txt" in names
    assert zipfile.ZipFile(wheel).read(PTH).decode() == (ROOT / PTH).read_text()
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[glm53_patches]" in entry_points and "glm53-patches = glm53_patches.cli:main" in entry_points


def test_installed_pth_sorts_after_editable_finders():
    import site

    folder = Path(site.getsitepackages()[0])
    assert (folder / PTH).is_file(), "install the package (pip install -e . or the wheel) before testing"
    for other in folder.glob("*.pth"):
        if "editable" in other.name or other.name.startswith("_"):
            assert other.name < PTH

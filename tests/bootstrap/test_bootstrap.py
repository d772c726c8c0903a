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


def test_a_variable_loads_only_the_stdlib_bootstrap_and_wrapt():
    result = run(PROBE, {"GLM53_PATCHES": "none"})
    modules = eval(result.stdout)
    assert "glm53_patches._bootstrap" in modules
    assert not [m for m in modules if m.split(".")[0] in ("mlx", "mlx_vlm", "pluggy")]
    assert "glm53_patches.registry" not in modules


def test_patches_apply_when_upstream_imports_glm5_next(tmp_path):
    result = run(PATCHED, {"GLM53_PATCHES": "compiled_kda_decode", "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "glm53_patches/patches/compiled_kda_decode" in result.stdout
    assert "compiled_kda_decode: applied" in result.stderr


def test_bad_values_print_one_line_and_leave_stock_code(tmp_path):
    for env in ({"GLM53_PATCHES": "bogus"}, {"GLM53_PATCHES": "all", "GLM53_PATCH_COMPILED_KDA_DECODE": "maybe"}):
        result = run(PATCHED, {**env, "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
        assert result.returncode == 0
        assert result.stdout.strip().endswith("mlx_vlm/models/glm5_next/language.py")
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        variable = next(iter(k for k in env if env[k] in ("bogus", "maybe")))
        assert variable in lines[0] and "accepted" in lines[0]


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

"""`glm53-patches stage` from real installs into a fresh venv: the wheel (the installed package
sits in the same site-packages as mlx and mlx-vlm's dependencies), and an editable install.

The venv gets this environment's mlx and mlx-vlm from the package index, as a user's would;
pytest only through the package's `stage` extra.
"""

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from glm53_patches import pins, stage

ROOT = Path(__file__).resolve().parents[2]
PIN = pins.mlx_vlm_versions()[0]
PATCH = "compiled_kda_decode"


def run(*command, check=True, **kwargs):
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, check=check, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", folder, ROOT)
    (built,) = folder.glob("glm53_patches-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
    """A fresh venv with the wheel, mlx and mlx-vlm (this environment's versions), nothing else asked for."""
    folder = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", folder)
    mlx = f"mlx[cpu]=={metadata.version('mlx')}" if _installed("mlx-cpu") else f"mlx=={metadata.version('mlx')}"
    run(folder / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile", wheel, mlx,
        f"mlx-vlm=={metadata.version('mlx-vlm')}")
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The pinned release and tiny checkpoints, prepared here so the venv's runs download nothing."""
    folder = tmp_path_factory.mktemp("stage-cache")
    stage.pinned_trees(folder, [PIN])
    stage.tiny_models(folder)
    return folder


def _installed(name):
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def pip(venv, *args):
    return run(venv / "bin" / "python", "-m", "pip", *args)


def glm53(venv, *args, cwd):
    return run(venv / "bin" / "glm53-patches", *args, check=False, cwd=cwd)


def assert_one_line_about_pytest(done, out):
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("stage: pytest is not installed") and "glm53-patches[stage]" in line and "--no-run" in line
    assert not out.exists()  # nothing written


def test_stage_without_pytest_says_so_in_one_line(venv, tmp_path):
    pip(venv, "uninstall", "--quiet", "--yes", "pytest")
    done = glm53(venv, "stage", "--all", "--out", tmp_path / "out", cwd=tmp_path)
    assert_one_line_about_pytest(done, tmp_path / "out")


def test_stage_from_the_wheel(venv, wheel, cache, tmp_path):
    """The wheel's glm53_patches is in the venv's site-packages, next to mlx: the staged runs still
    reach mlx, pytest and mlx-vlm's dependencies, and not glm53_patches."""
    pip(venv, "install", "--quiet", "--no-compile", "--force-reinstall", "--no-deps", wheel)
    pip(venv, "install", "--quiet", "--no-compile", f"{wheel}[stage]")
    site = Path(run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    where = run(venv / "bin" / "python", "-c", "import glm53_patches, mlx.core; print(glm53_patches.__file__, mlx.core.__file__)")
    assert [Path(p).parents[1] for p in where.stdout.split()] == [site, site]
    out = tmp_path / "out"
    done = glm53(venv, "stage", PATCH, "--pin", PIN, "--out", out, "--cache", cache, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {f.name for f in out.iterdir()} == {"PATCH.diff", "EVIDENCE.md", "SUMMARY.md", "stage.json", "summary.json"}
    record = json.loads((out / "stage.json").read_text())
    assert record["ok"], record["why"]
    tests = record["tests"]
    assert tests["passed"] > 0 and tests["failed"] == [] and tests["blocked_imports"] == []
    isolation = tests["isolation"]
    assert isolation["glm53_patches_found"] is None and isolation["glm53_patches_installed"] is None
    assert str(site) not in isolation["sys_path"]  # a linked copy of it without glm53-patches instead
    assert Path(tests["mlx_vlm_file"]).parts[-3:] == ("tree", "mlx_vlm", "__init__.py")
    assert record["equivalence"]["ok"] and record["equivalence"]["served"] > 0
    assert f"**{tests['passed']} passed, 0 failed, 0 skipped**" in (out / "EVIDENCE.md").read_text()


def test_stage_from_an_editable_install_without_pytest(venv, tmp_path):
    pip(venv, "uninstall", "--quiet", "--yes", "pytest", "glm53-patches")
    pip(venv, "install", "--quiet", "--no-deps", "-e", ROOT)
    where = run(venv / "bin" / "python", "-c", "import glm53_patches; print(glm53_patches.__file__)")
    assert Path(where.stdout.strip()) == ROOT / "glm53_patches" / "__init__.py"
    done = glm53(venv, "stage", "--all", "--out", tmp_path / "out", cwd=tmp_path)
    assert_one_line_about_pytest(done, tmp_path / "out")

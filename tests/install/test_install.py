"""A real install in a fresh venv: what a Linux user gets from `pip install glm53-patches`.

Plain `pip install` brings mlx without a backend on Linux (libmlx.so is in
the backend packages). Then every subcommand must say in one line what to
install, or work without MLX; after `pip install glm53-patches[cpu]` every
subcommand must run, with no traceback anywhere.
"""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from glm53_patches import pins

ROOT = Path(__file__).resolve().parents[2]
PIN = pins.read(ROOT / "upstream_pins.txt")[0]
NEEDS_MLX = ("verify", "bench", "stage", "tiny-model")


def _commands(tmp):
    """Every subcommand, with arguments that keep it short (each still does its real work)."""
    return {
        "status": ["status"],
        "list": ["list"],
        "doctor": ["doctor"],
        "verify": ["verify", "compiled_kda_decode"],
        "bench": ["bench", "--small", "--sections", "decode", "--rounds", "1", "--steps", "2", "--warmup", "1",
                  "--contexts", "16", "--prefill", "", "--arms", "stock,compiled_kda_decode", "--out",
                  str(tmp / "bench.json"), "--quiet"],
        "stage": ["stage", "compiled_kda_decode", "--pin", PIN["mlx-vlm"], "--no-run", "--out", str(tmp / "staged")],
        "tiny-model": ["tiny-model", str(tmp / "tiny")],
        "fingerprints": ["fingerprints"],
    }


def _pip(python, *args):
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True, timeout=1200)


def _run(python, tmp, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM53_", "VIRTUAL_ENV", "PYTHON"))}
    env["GLM53_PATCHES_STATE_DIR"] = str(tmp / "state")
    script = Path(python).parent / "glm53-patches"
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env, timeout=900, cwd=tmp)


@pytest.mark.skipif(sys.platform == "darwin", reason="mlx on macOS always carries its Metal backend")
def test_linux_install_without_then_with_a_backend(tmp_path):
    folder = tmp_path / "venv"
    venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    _pip(python, str(ROOT), f"mlx=={PIN['mlx']}", f"mlx-vlm=={PIN['mlx-vlm']}")

    for name, args in _commands(tmp_path).items():  # no backend: one line, or a working command
        result = _run(python, tmp_path, args)
        assert "Traceback" not in result.stdout + result.stderr, (name, result.stderr[-2000:])
        if name in NEEDS_MLX:
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2 and len(lines) == 1, (name, result.stderr)
            assert "MLX cannot load" in lines[0] and 'pip install "glm53-patches[cpu]"' in lines[0], lines
        elif name == "doctor":
            assert result.returncode == 1 and "MLX cannot load" in result.stdout, result.stdout
        else:
            assert result.returncode == 0, (name, result.stderr)

    _pip(python, f"{ROOT}[cpu]")
    for name, args in _commands(tmp_path).items():
        result = _run(python, tmp_path, args)
        assert "Traceback" not in result.stdout + result.stderr, (name, result.stderr[-2000:])
        assert result.returncode == 0, (name, result.stdout[-2000:], result.stderr[-2000:])
    assert (tmp_path / "tiny" / "config.json").is_file() and (tmp_path / "bench.json").is_file()

"""A patch from another package works as README promises: discovered through its entry point, drift-checked
against its own fingerprints, verified, applied through the real server, and staged as a pull request."""

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest


PROBE = Path(__file__).resolve().parents[1] / "outside" / "probe_pkg"
PIN = version("mlx-vlm")
PROMPTS = ["Name three rivers.", "Count from one to five.", "What is a cache line?"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The probe package, really installed (a wheel built by pip) into a folder of its own."""
    target = tmp_path_factory.mktemp("outside-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(PROBE)], check=True, timeout=600)
    return target


def _cli(site, state, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(PYTHONPATH=str(site), GLM53_PATCHES_STATE_DIR=str(state), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "glm53_patches.cli", *args], capture_output=True, text=True,
                            env=env, timeout=timeout)
    return result


def test_an_outside_patch_package_end_to_end(site, tmp_path, server_factory, tiny_fp32_dir):
    state = tmp_path / "state"
    own = site / "outside_glm53_probe" / "fingerprints.json"

    listing = _cli(site, state, "list")
    assert "outside_probe  [exact]  GLM53_PATCH_OUTSIDE_PROBE" in listing.stdout, listing.stderr

    def probe_status():
        result = _cli(site, state, "status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["here"]["patches"]["outside_probe"]

    assert not own.exists() and probe_status()["drift"]  # nothing of the core's admits it

    builtin = sorted((Path(__file__).resolve().parents[2] / "glm53_patches" / "patches").glob("*/fingerprints.json"))
    before = {p: p.read_bytes() for p in builtin}
    written = _cli(site, state, "fingerprints", "outside_probe", "--write", "--versions", PIN)
    assert written.returncode == 0, written.stderr
    assert set(json.loads(own.read_text())) == {
        "mlx_vlm.models.glm5_next.language:Glm5NextMLP.__call__", "mlx_vlm.models.glm5_next.language:_limited_swiglu",
        "mlx_vlm.models.linear:linear"}
    assert {p: p.read_bytes() for p in builtin} == before  # its own file, nobody else's
    assert probe_status()["drift"] is None

    verified = _cli(site, state, "verify", "outside_probe")
    assert verified.returncode == 0 and "exact" in verified.stdout, verified.stdout + verified.stderr
    assert probe_status()["kernels_verified_here"]["cpu"] is True

    with server_factory(tiny_fp32_dir) as stock:
        stock_answers = [stock.chat(p, max_tokens=16)[0] for p in PROMPTS]
    env = {"GLM53_PATCHES": "all", "PYTHONPATH": str(site)}  # `all` takes it: its verify record is here
    with server_factory(tiny_fp32_dir, env=env) as patched:
        answers = [patched.chat(p, max_tokens=16)[0] for p in PROMPTS]
        report = patched.published(("outside_probe",))
        log = patched.log()
    assert answers == stock_answers
    assert "outside_probe: applied" in log
    assert report["patches"]["outside_probe"]["stats"]["hits"].get("call", 0) > 0

    out = tmp_path / "staged"
    staged = _cli(site, state, "stage", "outside_probe", "--pin", PIN, "--out", str(out), timeout=1500)
    assert staged.returncode == 0, staged.stdout[-3000:] + staged.stderr[-3000:]
    folder = next(p.parent for p in out.rglob("stage.json"))
    result = json.loads((folder / "stage.json").read_text())
    assert result["ok"] is True, result
    diff = (folder / "PATCH.diff").read_text()
    assert "mlx_vlm/models/glm5_next/outside_probe.py" in diff and "glm53" not in diff
    assert (folder / "EVIDENCE.md").is_file() and (folder / "SUMMARY.md").is_file()

"""``glm53-patches warmup --model DIR``: it runs the stock server on DIR, twice alike, and refuses bad folders.

On the CPU MLX keeps its compiled kernels in ``<TMPDIR>/mlx/<version>/cpu``
as it keeps CUDA's in ``.../ptx``, so the whole path runs here: a real
server process started with the caller's environment (GLM53_PATCHES=all
here), real HTTP requests that cover a full prefill chunk and a partial
one, a streamed and concurrent requests, the server stopped, the cache
filled, nothing else left behind; and a second run that adds nothing to the
cache (one request at a time: concurrent ones batch by arrival, which varies). What the cache saves a CUDA server is measured on the H200
(BENCHMARKS.md).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from glm53_patches import warmup
from glm53_patches.tiny_drafter import write_tiny_drafter

CHUNK = 64


def _warmup(model, tmp_path, *extra, env_extra=None):
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(HF_HUB_OFFLINE="1", TMPDIR=str(temp), PREFILL_STEP_SIZE=str(CHUNK),
               GLM53_PATCHES="all", GLM53_PATCHES_STATE_DIR=str(tmp_path / "state"), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "glm53_patches.cli", "warmup", "--model", str(model), *extra],
                          env=env, capture_output=True, text=True, timeout=600)


def test_warmup_runs_the_server_through_its_first_requests_and_again(tiny_q4_dir, tmp_path):
    # Runs 1 and 2 send one request at a time, so their shapes are the same and run 2 must add no
    # kernel. Run 3 sends the default 2 concurrent requests: whether they share a batch depends on
    # when each reaches the server, so the kernels it adds vary (a CI run saw 16 once).
    for attempt in (1, 2, 3):
        done = _warmup(tiny_q4_dir, tmp_path, *(("--concurrent", "1") if attempt < 3 else ()))
        assert done.returncode == 0, done.stderr
        steps = re.findall(r"\] (\d)/6 ([^.]+) \.\.\. [\d.]+ s", done.stderr)
        assert [int(n) for n, _ in steps] == [1, 2, 3, 4, 5, 6], done.stderr
        prompt_tokens = int(re.search(r"\((\d+) prompt tokens\)", done.stderr).group(1))
        assert prompt_tokens > CHUNK  # a full chunk and a partial one reached the server
        cache = tmp_path / "tmp" / "mlx" / mx.__version__ / "cpu"
        counted = re.search(r"kernel cache: (.+) \((\d+) files, (\d+) new\)", done.stdout)
        assert counted and Path(counted.group(1)) == cache, done.stdout
        files = len(list(cache.iterdir()))
        assert int(counted.group(2)) == files > 0
        if attempt < 3:
            assert (int(counted.group(3)) > 0) if attempt == 1 else (int(counted.group(3)) == 0), done.stdout
        assert [p.name for p in (tmp_path / "tmp").iterdir()] == ["mlx"], attempt  # its server log folder is gone
    published = list((tmp_path / "state").glob("*.json"))  # the server ran with the caller's patches
    assert published and any(json.loads(p.read_text())["patches"].get("compiled_kda_decode", {}).get("state")
                             == "applied" for p in published if p.name[0].isdigit())


def test_warmup_with_a_drafter_compiles_the_verify_blocks(tiny_q4_dir, tmp_path):
    """The server speculates during warmup: draft rounds are counted, the patches ran verify blocks,
    and a second run (one request at a time, greedy) adds no kernel."""
    drafter = write_tiny_drafter(tiny_q4_dir, tmp_path / "drafter")
    speculate = ("--concurrent", "1", "--draft-model", str(drafter), "--draft-kind", "mtp")
    for attempt in (1, 2):
        done = _warmup(tiny_q4_dir, tmp_path, *speculate)
        assert done.returncode == 0, done.stderr
        rounds = re.search(r"speculated with (.+): (\d+) draft rounds, each a verify block", done.stdout)
        assert rounds and rounds.group(1) == str(drafter) and int(rounds.group(2)) > 0, done.stdout
        new = int(re.search(r"kernel cache: .+ \(\d+ files, (\d+) new\)", done.stdout).group(1))
        assert (new > 0) if attempt == 1 else (new == 0), done.stdout
    published = [json.loads(p.read_text()) for p in (tmp_path / "state").glob("*.json") if p.name[0].isdigit()]
    blocks = [r["patches"]["layer_decode"]["stats"]["hits"].get("kda block", 0) for r in published
              if "layer_decode" in r["patches"]]
    assert blocks and all(n > 0 for n in blocks), blocks  # each warmup's server ran verify blocks through the patches


def test_a_bad_drafter_is_refused_in_one_line(tiny_q4_dir, tmp_path):
    for folder, expected in [(tmp_path / "nowhere", "no such folder"), (tmp_path, "no config.json")]:
        done = _warmup(tiny_q4_dir, tmp_path, "--draft-model", str(folder))
        assert done.returncode == 2 and "1/6" not in done.stderr  # no server was started
        assert done.stderr.strip() == f"glm53-patches warmup: --draft-model {folder}: {expected}" + (
            " in it (not a drafter checkpoint)" if expected == "no config.json" else "")
    done = _warmup(tiny_q4_dir, tmp_path, "--draft-kind", "mtp")
    assert done.returncode == 2 and done.stderr.strip() == "glm53-patches warmup: --draft-kind needs --draft-model"


@pytest.mark.parametrize("case", ["missing", "empty", "llama", "no weights"])
def test_a_bad_model_folder_is_refused_in_one_line(tmp_path, tiny_q4_dir, case):
    folder = tmp_path / "model"
    if case != "missing":
        folder.mkdir()
    if case == "llama":
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if case == "no weights":
        shutil.copy(Path(tiny_q4_dir) / "config.json", folder / "config.json")
    done = _warmup(folder, tmp_path)
    assert done.returncode == 2
    expected = {"missing": "no such folder", "empty": "no config.json", "llama": "model_type is 'llama'",
                "no weights": "no *.safetensors"}[case]
    assert done.stderr.startswith(f"glm53-patches warmup: --model {folder}: ") and expected in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "1/6" not in done.stderr  # no server was started


def test_a_server_that_cannot_load_the_model_is_reported(tiny_q4_dir, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_q4_dir, folder)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])  # a truncated file
    done = _warmup(folder, tmp_path)
    assert done.returncode == 1
    assert "glm53-patches warmup: the server exited with" in done.stderr, done.stderr


def test_the_kernel_cache_is_where_mlx_keeps_it():
    assert warmup.kernel_cache("cuda", {"MLX_PTX_CACHE_DIR": "/srv/ptx"}) == Path("/srv/ptx")
    default = warmup.kernel_cache("cuda", {})
    assert default.parts[-3:] == ("mlx", mx.__version__, "ptx")  # MLX: temp_directory_path() / mlx / version / ptx
    assert warmup.kernel_cache("cpu") == default.parent / "cpu" and warmup.kernel_cache("metal") is None


def test_the_server_waits_longer_for_a_cold_first_token_unless_told():
    assert warmup.server_environment({"PATH": "/bin"}) == {"PATH": "/bin", "MLX_VLM_TOKEN_QUEUE_TIMEOUT": "3600"}
    assert warmup.server_environment({"MLX_VLM_TOKEN_QUEUE_TIMEOUT": "90"})["MLX_VLM_TOKEN_QUEUE_TIMEOUT"] == "90"

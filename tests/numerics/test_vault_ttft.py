"""vault_cache's TTFT benchmark, --small end to end: every phase in its own process,
through bare mlx-vlm packages as on the GPU machine (--simulate-bare).

Asserts what the benchmark reports, not how fast: warm (memory tier) and
after-restart (disk tier) first-step logits bit-identical to cold, the restart
served from disk, and the JSON fields the H200 run will be read by.
"""

import json
import subprocess
import sys


def test_ttft_small_end_to_end(tmp_path):
    out = tmp_path / "ttft.json"
    command = [sys.executable, "-m", "glm53_patches.patches.vault_cache.checks.ttft", "--small", "--simulate-bare",
               "--prompts", "40,70", "--dir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(out.read_text())

    for phase in ("first", "restart"):
        assert report[phase]["bare_packages"], f"{phase} did not run through bare packages"
        assert report[phase]["patches"]["vault_cache"]["state"] == "applied"
        assert report[phase]["load_s"] >= 0 and "s" in report[phase]["fingerprint"]
    assert report["first"]["fingerprint"].get("weights_hashed", 0) > 0  # fresh state folder: hashed once
    assert report["restart"]["fingerprint"].get("weights_cached", 0) > 0  # remembered across the restart
    assert report["model"]["dir_bytes"] > 0 and "build_s" in report["model"]
    assert report["env"]["APC_ENABLED"] == "1" and "vault_cache" in report["env"]["GLM53_PATCHES"]

    assert set(report["results"]) == {"40", "70"}
    for length, row in report["results"].items():
        for key in ("cold_s", "warm_s", "restart_s"):
            assert row[key] > 0, (length, key)
        assert row["cold_cached_tokens"] == 0
        assert row["cold_vault"]["fallbacks"].get("miss") == 1
        assert row["warm_vault"]["hits"].get("memory") == 1
        assert row["restart_vault"]["hits"].get("disk") == 1
        assert 0 < row["warm_cached_tokens"] < int(length)
        assert 0 < row["restart_cached_tokens"] < int(length)
        assert not any(k.startswith("refused") for k in row["restart_vault"]["fallbacks"])
        assert row["warm_identical"] is True and row["restart_identical"] is True
        assert row["warm_same_tokens"] and row["restart_same_tokens"]
    assert "identical w/r" in done.stdout and "True/True" in done.stdout

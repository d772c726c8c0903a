"""The glm53-patches command, run as a real process."""

import json
import os
import subprocess
import sys

from glm53_patches import verify_records


def cli(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "glm53_patches.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_list_names_every_patch_with_its_switch():
    out = cli("list").stdout
    assert "compiled_kda_decode  [exact]  GLM53_PATCH_COMPILED_KDA_DECODE" in out
    assert "replaces mlx_vlm.models.glm5_next.language:Glm5NextLinearAttention.__call__" in out


def test_doctor_passes_on_a_pinned_install_and_reports_bad_values():
    good = cli("doctor")
    assert good.returncode == 0, good.stdout
    assert "bootstrap .pth:" in good.stdout and "MISSING" not in good.stdout and "pinned" in good.stdout
    bad = cli("doctor", env_extra={"GLM53_PATCHES": "bogus"})
    assert bad.returncode == 1 and "unknown patch 'bogus'" in bad.stdout


def test_verify_records_a_pass_that_status_and_all_read():
    result = cli("verify", "compiled_kda_decode")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled_kda_decode" in result.stdout and "exact" in result.stdout
    assert verify_records.passed("compiled_kda_decode", "cpu")
    status = json.loads(cli("status", "--json").stdout)
    entry = status["here"]["patches"]["compiled_kda_decode"]
    assert entry["drift"] is None and "0.7.10" in entry["verified_on"]


def test_a_record_for_other_patch_code_does_not_count():
    """A pass recorded for another version of a patch's code (another digest) admits nothing."""
    verify_records.record("dsa_decode", "cuda", {"passed": True})
    assert verify_records.passed("dsa_decode", "cuda")
    records = verify_records.load()
    (key,) = records
    assert key.endswith(f"|code {verify_records.code_digest('dsa_decode')}")
    stale = key.rsplit("|code ", 1)[0] + "|code 000000000000"
    verify_records._path().write_text(json.dumps({stale: records[key]}))
    assert not verify_records.passed("dsa_decode", "cuda")
    assert verify_records.code_digest("dsa_decode") != verify_records.code_digest("hc_decode")


def test_verify_unknown_patch_is_an_error():
    result = cli("verify", "bogus")
    assert result.returncode == 2 and "unknown patch(es): bogus" in result.stderr


def test_tiny_model_command_writes_a_loadable_checkpoint(tmp_path):
    result = cli("tiny-model", str(tmp_path / "m"), "--quantize-bits", "8")
    assert result.returncode == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8


def test_tiny_model_command_writes_a_drafter_the_stock_loader_takes(tmp_path):
    target, draft = tmp_path / "m", tmp_path / "draft"
    result = cli("tiny-model", str(target), "--quantize-bits", "4", "--drafter", str(draft),
                 env_extra={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(target), str(draft)]
    config = json.loads((draft / "config.json").read_text())
    assert config["model_type"] == "glm5_next_mtp"
    assert config["text_config"] == json.loads((target / "config.json").read_text())["text_config"]
    # What `mlx_vlm.server --draft-model DIR --draft-kind mtp` does with it, in a fresh process.
    check = ("import sys; from mlx_vlm import load; from mlx_vlm.speculative.drafters import load_drafter, "
             "validate_drafter_compatibility\n"
             "model, _ = load(sys.argv[1]); drafter, kind = load_drafter(sys.argv[2], 'mtp')\n"
             "validate_drafter_compatibility(model, drafter, kind); print(kind, type(drafter).__name__)\n")
    loaded = subprocess.run([sys.executable, "-c", check, str(target), str(draft)], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert loaded.stdout.split() == ["mtp", "Glm5NextMTPDraftModel"], loaded.stderr


def test_parallel_verify_runs_keep_every_record(tmp_path):
    """Processes recording at once (verify runs in parallel, one patch each) lose none of their records."""
    writer = ("import sys; from glm53_patches import verify_records\n"
              "for k in range(25): verify_records.record('hc_decode', f'b{sys.argv[1]}-{k}', {'passed': True})\n")
    processes = [subprocess.Popen([sys.executable, "-c", writer, str(i)], env=dict(os.environ)) for i in range(6)]
    assert [p.wait(timeout=300) for p in processes] == [0] * 6
    records = verify_records.load()
    assert len(records) == 6 * 25
    assert all(verify_records.passed("hc_decode", f"b{i}-{k}") for i in range(6) for k in range(25))


def test_the_state_folder_is_private(tmp_path):
    verify_records.record("dsa_decode", "cuda", {"passed": True})
    assert verify_records._path().parent.stat().st_mode & 0o777 == 0o700


def test_verify_report_holds_the_machine_and_every_case(tmp_path):
    report_path = tmp_path / "report.json"
    result = cli("verify", "compiled_kda_decode", "--report", str(report_path), "--cases")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    machine = report["machine"]
    assert machine["mlx"] and machine["mlx-vlm"] and machine["os"] and machine["python"] and machine["backend"] == "cpu"
    entry = report["patches"]["compiled_kda_decode"]
    assert entry["passed"] is True and len(entry["case_results"]) == entry["cases"] == 16  # 8 decode, 8 verify-block
    assert {case["result"] for case in entry["case_results"]} == {"exact"}
    assert all(case["case"] in result.stdout for case in entry["case_results"])  # --cases prints each
    stored = verify_records.load()
    assert all("case_results" not in record for record in stored.values())  # the records stay small


def test_tally_records_every_kind_of_case(capsys):
    import mlx.core as mx

    from glm53_patches.exactness import Tally

    tally = Tally()
    tally.compare("same", [mx.array([1.0, 2.0])], [mx.array([1.0, 2.0])])
    tally.compare("off by one ulp", [mx.array([1.0])], [mx.array([1.0000001])])
    tally.inconclusive("stock unstable", "stock differs from itself")
    tally.failed("raised", ValueError("no kernel for this shape"))
    result = tally.result(0.1)
    assert [c["result"] for c in result["case_results"]] == ["exact", "differs", "inconclusive", "failed"]
    assert result["case_results"][1]["max_abs_diff"] > 0 and "ValueError" in result["case_results"][3]["error"]
    assert result["exact"] is False and result["cases"] == 4
    # each case is said on stderr as it ends, in order (a verify cut short shows how far it got)
    said = [line.split()[2:] for line in capsys.readouterr().err.splitlines()]
    assert said == [["exact", "same"], ["differs", "off", "by", "one", "ulp"], ["inconclusive", "stock", "unstable"],
                    ["failed", "raised"]]
    only_inconclusive = Tally()
    only_inconclusive.inconclusive("x", "why")
    assert only_inconclusive.result(0.1)["exact"] is False  # nothing compared proves nothing


def test_tally_against_stock_is_inconclusive_where_stock_differs_from_itself():
    import mlx.core as mx

    from glm53_patches.exactness import Tally

    one, other = mx.array([1.0]), mx.array([1.0000001])
    tally = Tally()
    tally.against_stock("exact", one, one, one)
    tally.against_stock("differs", one, one, other)
    tally.against_stock("stock unstable", one, other, one)
    results = tally.result(0.1)["case_results"]
    assert [c["result"] for c in results] == ["exact", "differs", "inconclusive"]
    assert results[1]["max_abs_diff"] > 0

"""End to end: the stock mlx_vlm.server, with and without patches, over real HTTP."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import settled

PROMPTS = [
    "Tell me a story about a lighthouse keeper who counts ships.",
    "List three prime numbers and explain why each is prime.",
    "Write a haiku about cache lines.",
]


def _answers(server):
    plain = [server.chat(p, max_tokens=32)[0] for p in PROMPTS]
    streamed = server.chat(PROMPTS[0], max_tokens=32, stream=True)[0]
    with ThreadPoolExecutor(3) as pool:  # continuous batching: rows share decode steps
        concurrent = list(pool.map(lambda p: server.chat(p, max_tokens=32)[0], PROMPTS))
    return plain, streamed, concurrent


# The exact patches that serve model calls; GLM53_PATCHES=all applies them on the CPU.
SERVING = ("compiled_kda_decode", "hc_decode", "dsa_decode", "gathered_prefill")


def test_patched_server_answers_exactly_like_stock(server_factory, tiny_q4_dir, tmp_path):
    with server_factory(tiny_q4_dir, args=("-X", "importtime")) as stock:
        stock_answers = _answers(stock)
        stock_log = stock.log()
    assert "glm53_patches" not in stock_log  # -X importtime lists every module imported
    assert all(stock_answers[0]) and len(set(stock_answers[0])) == len(PROMPTS)

    with server_factory(tiny_q4_dir, env={"GLM53_PATCHES": "all"}) as patched:
        patched_answers = _answers(patched)
        report = patched.published(SERVING)
        cli = subprocess.run([sys.executable, "-m", "glm53_patches.cli", "status", "--json"], capture_output=True,
                             text=True, env={"GLM53_PATCHES_STATE_DIR": str(tmp_path / "state"), "PATH": ""})
        log = patched.log()
    assert patched_answers == stock_answers
    for name in SERVING:  # applied, and their fast paths served these requests
        assert f"{name}: applied" in log
        entry = report["patches"][name]
        assert entry["state"] == "applied" and sum(entry["stats"]["hits"].values()) > 0, (name, entry)
    assert report["patches"]["compiled_kda_decode"]["stats"]["hits"]["call"] > 0
    processes = json.loads(cli.stdout)["processes"]
    assert [p["patches"]["compiled_kda_decode"]["state"] for p in processes if p["pid"] == patched.process.pid] == ["applied"]


def _status_text(state_dir):
    """`glm53-patches status` run from a shell that sets nothing but the state folder."""
    return subprocess.run([sys.executable, "-m", "glm53_patches.cli", "status"], capture_output=True, text=True,
                          env={"GLM53_PATCHES_STATE_DIR": str(state_dir), "PATH": ""}, check=True).stdout


def test_bad_values_log_one_line_and_the_server_still_serves(server_factory, tiny_fp32_dir, tmp_path):
    for env, variable in (({"GLM53_PATCHES": "bogus"}, "GLM53_PATCHES"),
                          ({"GLM53_PATCH_COMPILED_KDA_DECODE": "maybe"}, "GLM53_PATCH_COMPILED_KDA_DECODE"),
                          ({"GLM53_PATCHES": "all", "GLM53_GATHERED_PREFILL_MAX_ELEMENTS": "0"},
                           "GLM53_GATHERED_PREFILL_MAX_ELEMENTS")):
        with server_factory(tiny_fp32_dir, env=env) as server:
            text, _ = server.chat(PROMPTS[2], max_tokens=8)
            ours = [line for line in server.log().splitlines() if "glm53-patches" in line]
            status = _status_text(tmp_path / "state")
        assert text
        assert len(ours) == 1 and variable in ours[0] and "accepted" in ours[0], ours
        assert "applied (" not in server.log()
        # status names the error itself, and the server's whole command line
        assert f"configuration error: {variable}" in status and "accepted" in status, status
        assert f"--port {server.port}" in status


def test_status_shows_what_each_process_requested(server_factory, tiny_fp32_dir, tmp_path):
    """The shell that runs `status` asks for nothing; the server asked for one patch: each says its own."""
    with server_factory(tiny_fp32_dir, env={"GLM53_PATCHES": "compiled_kda_decode"}) as server:
        server.chat(PROMPTS[2], max_tokens=4)
        status = _status_text(tmp_path / "state")
    shell = status.split("\nprocess ")[0]
    assert [line for line in shell.splitlines() if line.startswith("compiled_kda_decode ")][0].split()[1] == "no"
    served = [line.strip() for line in status.split(f"process {server.process.pid}:")[1].splitlines()]
    assert any(line.startswith("compiled_kda_decode") and " applied; hits" in line for line in served), status
    assert any(line.startswith("hc_decode") and "not requested" in line for line in served)
    assert "bootstrap did not run" not in status


def _forced_prefill_patch(server_factory, model_dir, name):
    """Stock's answers; then ``name`` forced on (the CPU) with a threshold the chat prompts pass:
    its answers, and its counters once every request is in."""
    with server_factory(model_dir) as stock:
        expected = _answers(stock)
    knob = f"GLM53_{name.upper()}"
    env = {"GLM53_PATCHES": name, f"{knob}_FAST_PATH": "1", f"{knob}_MIN_TOKENS": "9"}
    with server_factory(model_dir, env=env) as patched:
        answers = _answers(patched)
        report = patched.published((name,), until=settled(name))
    return expected, answers, report["patches"][name]["stats"]


def test_dequantized_experts_serves_prefill_exactly_like_stock(server_factory, tiny_q4_dir):
    """fp32 activations over 4-bit experts: the same answers as stock, its path served the prefills
    and decode stayed stock's."""
    expected, answers, stats = _forced_prefill_patch(server_factory, tiny_q4_dir, "dequantized_experts")
    assert answers == expected
    assert stats["hits"].get("dequantized", 0) > 0 and stats["fallbacks"].get("not a prefill chunk", 0) > 0


def test_dequantized_linear_serves_prefill_exactly_like_stock(server_factory, tiny_q4_dir):
    """fp32 activations over 4-bit projections: the same answers as stock, and its path served them."""
    expected, answers, stats = _forced_prefill_patch(server_factory, tiny_q4_dir, "dequantized_linear")
    assert answers == expected
    assert stats["hits"].get("dequantized", 0) > 0
    assert "dtype" not in stats["fallbacks"]  # the server's activations are fp32, the dtype it takes here


def test_batched_experts_serves_like_stock_on_the_cpu(server_factory, tiny_q4_dir):
    """batched_experts (numerics-changing, but bit-identical on the CPU, PATCH.md): the server's
    answers are stock's, the prefill blocks were batched and decode stayed stock's."""
    with server_factory(tiny_q4_dir) as stock:
        stock_answers = _answers(stock)
    with server_factory(tiny_q4_dir, env={"GLM53_PATCH_BATCHED_EXPERTS": "1"}) as patched:
        patched_answers = _answers(patched)
        report = patched.published(("batched_experts",))
    assert patched_answers == stock_answers
    stats = report["patches"]["batched_experts"]["stats"]
    assert stats["hits"].get("batched", 0) > 0 and stats["fallbacks"].get("not a prefill chunk", 0) > 0

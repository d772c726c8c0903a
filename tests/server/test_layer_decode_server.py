"""layer_decode through the stock mlx_vlm.server: the same answers as stock, served by its compiled layers."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import settled

NAME = "layer_decode"
PROMPTS = [
    "Tell me a story about a lighthouse keeper who counts ships.",
    "List three prime numbers and explain why each is prime.",
    "Write a haiku about cache lines.",
]
KDA_LAYERS, DSA_LAYERS = 5, 3  # the tiny model's (glm53_patches.tiny_model.tiny_config)


def _answers(server):
    plain = [server.chat(p, max_tokens=32)[0] for p in PROMPTS]
    streamed = server.chat(PROMPTS[0], max_tokens=32, stream=True)[0]
    with ThreadPoolExecutor(3) as pool:  # continuous batching: rows share decode steps, batch sizes vary
        concurrent = list(pool.map(lambda p: server.chat(p, max_tokens=32)[0], PROMPTS))
    return plain, streamed, concurrent


def test_served_answers_equal_stock_and_its_layers_served_them(server_factory, tiny_q4_dir, tmp_path):
    with server_factory(tiny_q4_dir) as stock:
        expected = _answers(stock)
    assert all(expected[0]) and len(set(expected[0])) == len(PROMPTS)

    for env in ({"GLM53_PATCHES": NAME}, {"GLM53_PATCHES": "all"}):
        with server_factory(tiny_q4_dir, env=env) as patched:
            answers = _answers(patched)
            report = patched.published(until=settled(NAME))
            status = subprocess.run([sys.executable, "-m", "glm53_patches.cli", "status"], capture_output=True,
                                    text=True, env={"GLM53_PATCHES_STATE_DIR": str(tmp_path / "state"), "PATH": ""})
            served = status.stdout.split(f"process {patched.process.pid}:")[1].split("\nprocess ")[0]
        assert answers == expected, env
        entry = report["patches"][NAME]
        assert entry["state"] == "applied", (env, entry)
        hits, fallbacks = entry["stats"]["hits"], entry["stats"]["fallbacks"]
        # Every decode step ran every layer through the compiled path; only prefills stepped aside.
        assert "kda layer" in hits, (env, entry["stats"], entry["reason"])
        steps = hits["kda layer"] // KDA_LAYERS
        assert steps >= 4 * 16 and hits == {**hits, "kda layer": steps * KDA_LAYERS, "dsa layer": steps * DSA_LAYERS}
        assert set(fallbacks) == {"length"}, fallbacks
        # The server's caches are left-padded even at batch 1 (the masked KDA form); three
        # concurrent requests decode at more than one batch size, which traces afresh.
        assert hits["trace"] >= 4 and hits["retrace"] >= 1, hits
        assert "traces" in entry["detail"] and "kda x5" in entry["detail"], entry["detail"]
        line = next(line for line in served.splitlines() if line.strip().startswith(NAME))
        assert "applied; hits" in line, status.stdout

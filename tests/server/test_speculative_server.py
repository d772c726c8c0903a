"""The stock server speculating with the tiny MTP drafter: GLM53_PATCHES=all changes no answer and no
accepted-token count, and its counters show the patches that ran inside the verify blocks."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import settled

from glm53_patches.tiny_drafter import DRAFTER_PROMPTS, write_tiny_drafter

KDA_LAYERS, LAYERS = 5, 8  # the tiny model's (glm53_patches.tiny_model.tiny_config)
OTHER = "Why is the sky blue?"  # not one the drafter learnt: its drafts are rejected


@pytest.fixture(scope="module")
def drafter_dir(tiny_q4_dir, tmp_path_factory):
    return write_tiny_drafter(tiny_q4_dir, tmp_path_factory.mktemp("tiny-drafter"))


def _answers(server):
    """Plain answers with their draft counts, one streamed answer, and the same prompts concurrently."""
    plain = []
    for prompt in [*DRAFTER_PROMPTS, OTHER]:
        text, reply = server.chat(prompt, max_tokens=40)
        timings = reply["timings"]
        plain.append((text, timings["draft_kind"], timings["draft_rounds"], timings["draft_n"],
                      timings["draft_n_accepted"]))
    streamed = server.chat(DRAFTER_PROMPTS[0], max_tokens=40, stream=True)[0]
    with ThreadPoolExecutor(3) as pool:  # batched speculation: rows accept different numbers of drafts
        concurrent = list(pool.map(lambda p: server.chat(p, max_tokens=40)[0], DRAFTER_PROMPTS))
    return plain, streamed, concurrent


def test_speculative_answers_and_acceptance_equal_stock(server_factory, tiny_q4_dir, drafter_dir):
    speculate = ("--draft-model", str(drafter_dir), "--draft-kind", "mtp")
    with server_factory(tiny_q4_dir, server_args=speculate) as stock:
        expected = _answers(stock)
    plain = expected[0]
    assert all(kind == "mtp" for _, kind, *_ in plain), plain
    learnt = plain[: len(DRAFTER_PROMPTS)]
    # The learnt prompts accept drafts and reject some (rollback after an accepted token runs); the
    # other prompt rejects nearly all of them.
    assert all(accepted > 0 for *_, accepted in learnt), learnt
    assert sum(drafted - accepted for *_, drafted, accepted in learnt) > 0, learnt
    assert plain[-1][-1] < plain[-1][-2] // 4, plain[-1]

    with server_factory(tiny_q4_dir, env={"GLM53_PATCHES": "all"}, server_args=speculate) as patched:
        answers = _answers(patched)
        report = patched.published(until=settled("layer_decode"))
    assert answers == expected
    rounds = sum(rounds for _, _, rounds, _, _ in plain)
    # Every verify block ran as layer_decode's compiled layers (on the CPU `all` includes it), every
    # layer of it, the KDA layers recording their history for the rollback. Every round drafted, so
    # the plain requests' rounds alone, at batch 1, are `rounds` blocks of 2 tokens or more; streamed
    # and concurrent requests add more.
    assert all(drafted >= rounds for _, _, rounds, drafted, _ in plain), plain
    layers = report["patches"]["layer_decode"]
    assert layers["state"] == "applied", layers
    hits = layers["stats"]["hits"]
    assert hits["kda block"] >= rounds * KDA_LAYERS, (hits, rounds)
    assert hits["kda block"] // KDA_LAYERS * (LAYERS - KDA_LAYERS) == hits["dsa block"], hits
    assert not any("block" in reason for reason in layers["stats"]["fallbacks"]), layers["stats"]
    # The patches inside its traces: compiled_kda_decode recorded the history there, and dsa_decode
    # attends the drafter's own short blocks (its replays of accepted tokens).
    kda = report["patches"]["compiled_kda_decode"]["stats"]
    assert kda["hits"]["verify"] > 0 and "speculating" not in kda["fallbacks"], kda
    dsa = report["patches"]["dsa_decode"]["stats"]
    assert dsa["hits"]["block"] > 0, dsa

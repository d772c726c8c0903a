"""vault_cache through the stock mlx_vlm.server: exact, persistent, tamper-evident prefix reuse.

Every server here is the unmodified ``python -m mlx_vlm.server`` with mlx-vlm's
own APC switched on (``APC_ENABLED=1``, ``APC_DISK_PATH``) and the patch
requested by environment. References are always answers the same stock
server computed cold (no cached tokens), never values copied from the patch.
"""

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from glm53_patches.tiny_model import write_tiny_model

NAME = "vault_cache"
TOKENS = 12
PROMPTS = [
    "Tell me a story about a lighthouse keeper who counts ships at night.",
    "Tell me a story about a lighthouse keeper who counts the stars instead.",
    "Write a haiku about cache lines.",
]


def vault_env(vault):
    return {"GLM53_PATCHES": NAME, "APC_ENABLED": "1", "APC_DISK_PATH": str(vault)}


def cached(reply):
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_tokens(reply):
    return reply["usage"]["prompt_tokens"]


def status(server, until=lambda stats: True, wait_s=30):
    """The vault's published counters for one server process (waits for `until`)."""
    report = server.published(until=lambda r: until(r["patches"][NAME]["stats"]), timeout=wait_s)
    return report["patches"][NAME]["stats"]


def namespace(vault):
    (folder,) = [p for p in Path(vault).iterdir() if p.is_dir()]
    return folder


def entries(vault):
    return sorted(namespace(vault).glob("exact_*.safetensors"))


def read_header(path):
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]), data[8 + size:]


def write_resealed(path, edit):
    """Rewrite an entry's metadata with `edit` and a digest computed as PATCH.md specifies."""
    header, body = read_header(path)
    edit(header["__metadata__"])
    header["__metadata__"]["vault_digest"] = "0" * 64
    raw = json.dumps(header, separators=(",", ":")).encode()
    blob = len(raw).to_bytes(8, "little") + raw + body
    digest = hashlib.sha256(blob).hexdigest()
    path.write_bytes(blob.replace(b'"vault_digest":"' + b"0" * 64 + b'"', f'"vault_digest":"{digest}"'.encode()))


def test_warm_and_restarted_answers_are_the_cold_answers(server_factory, tiny_q4_dir, tmp_path):
    vault = tmp_path / "vault"
    with server_factory(tiny_q4_dir, env=vault_env(vault)) as first:
        cold = [first.chat(p, max_tokens=TOKENS) for p in PROMPTS]
        warm = [first.chat(p, max_tokens=TOKENS) for p in PROMPTS]
        stats_first = status(first, lambda s: s["hits"].get("write", 0) >= len(PROMPTS))
    with server_factory(tiny_q4_dir, env=vault_env(vault)) as second:
        restarted = [second.chat(p, max_tokens=TOKENS) for p in PROMPTS]
        stats_second = status(second, lambda s: s["hits"].get("disk", 0) >= len(PROMPTS))
        log = second.log()
        cli = subprocess.run([sys.executable, "-m", "glm53_patches.cli", "status", "--json"], capture_output=True,
                             text=True, env={**os.environ, "GLM53_PATCHES_STATE_DIR": str(tmp_path / "state")})
        (published,) = [p for p in json.loads(cli.stdout)["processes"] if p["pid"] == second.process.pid]

    assert all(text for text, _ in cold) and len({text for text, _ in cold}) == len(PROMPTS)
    assert [cached(reply) for _, reply in cold] == [0] * len(PROMPTS)
    for (cold_text, cold_reply), (text, reply) in zip(cold, warm):
        assert text == cold_text
        assert cached(reply) == prompt_tokens(reply) - 1  # APC's final checkpoint keeps one guard token
    for (cold_text, _), (text, reply) in zip(cold, restarted):
        assert text == cold_text
        assert cached(reply) == prompt_tokens(reply) - 1

    assert stats_first["hits"]["write"] >= len(PROMPTS) and stats_first["fallbacks"]["miss"] == len(PROMPTS)
    assert stats_second["hits"]["disk"] == len(PROMPTS)
    assert not [r for r in stats_second["fallbacks"] if r.startswith("refused")]
    assert stats_second["bytes"]["read"] > 0
    # The restart found every weight file's digest in its cache: nothing rehashed.
    assert stats_second["hits"]["weights_cached"] >= 1 and "weights_hashed" not in stats_second["hits"]
    assert "vault_cache: hit" in log and "from disk (verified" in log
    assert published["patches"][NAME]["state"] == "applied"
    assert published["patches"][NAME]["stats"]["hits"]["disk"] == len(PROMPTS)
    assert published["patches"][NAME]["detail"].startswith(f"hits disk {len(PROMPTS)}, memory 0; misses 0;")
    assert published["patches"][NAME]["stats"]["bytes"]["on_disk"] >= stats_second["bytes"]["read"]

    assert stat.S_IMODE(vault.stat().st_mode) == 0o700  # APC's root, created by stock APC with the umask's mode
    assert stat.S_IMODE(namespace(vault).stat().st_mode) == 0o700
    assert stat.S_IMODE((namespace(vault) / ".vault-tmp").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries(vault))


def test_weights_replaced_in_place_are_never_served_stale(server_factory, tmp_path):
    model = write_tiny_model(tmp_path / "model", quantize_bits=4, seed=0)
    replacement = write_tiny_model(tmp_path / "replacement", quantize_bits=4, seed=1)
    vault = tmp_path / "vault"
    with server_factory(model, env=vault_env(vault)) as before:
        old_text, _ = before.chat(PROMPTS[0], max_tokens=TOKENS)
        _, old_warm = before.chat(PROMPTS[0], max_tokens=TOKENS)
        status(before, lambda s: s["hits"].get("write", 0) >= 1)
    assert cached(old_warm) > 0

    weights = model / "model.safetensors"
    before_stat = weights.stat()
    assert (replacement / "model.safetensors").stat().st_size == before_stat.st_size
    shutil.copyfile(replacement / "model.safetensors", weights)  # same path, same size, new content
    os.utime(weights, ns=(before_stat.st_atime_ns, before_stat.st_mtime_ns))  # and the old mtime

    with server_factory(model, env=vault_env(vault)) as after:
        new_text, new_cold = after.chat(PROMPTS[0], max_tokens=TOKENS)
        again_text, new_warm = after.chat(PROMPTS[0], max_tokens=TOKENS)
        stats = status(after, lambda s: s["hits"].get("memory", 0) + s["hits"].get("disk", 0) >= 1)
    with server_factory(replacement) as reference:  # the new weights, no cache at all
        reference_text, _ = reference.chat(PROMPTS[0], max_tokens=TOKENS)

    assert cached(new_cold) == 0 and stats["fallbacks"]["miss"] >= 1
    assert stats["hits"].get("weights_hashed", 0) >= 1  # the rewritten file was hashed again
    assert new_text == reference_text != old_text
    assert again_text == new_text and cached(new_warm) > 0
    assert not [r for r in stats["fallbacks"] if r.startswith("refused")]


def test_weights_replaced_after_loading_keep_that_server_off_the_vault(server_factory, tmp_path):
    """Issue 21, item 1: a server whose files change after it loaded them must not seal
    the state it computes (from the old weights) under the new files' fingerprint."""
    model = write_tiny_model(tmp_path / "model", quantize_bits=4, seed=0)  # weights A
    replacement = write_tiny_model(tmp_path / "replacement", quantize_bits=4, seed=1)  # weights B
    vault = tmp_path / "vault"
    with server_factory(model, env=vault_env(vault)) as loaded_a:  # A is in memory now
        staged = model / ".incoming.safetensors"
        shutil.copyfile(replacement / "model.safetensors", staged)
        os.replace(staged, model / "model.safetensors")  # how an update lands: B, atomically
        first, again = [], []
        for prompt in PROMPTS:  # twice in a row: APC's memory tier keeps only a few entries
            first.append(loaded_a.chat(prompt, max_tokens=TOKENS))
            again.append(loaded_a.chat(prompt, max_tokens=TOKENS))
        # Counters are published in batches: wait for the last request's as well.
        stats_a = status(loaded_a, lambda s: s["fallbacks"].get("skipped:memory-only", 0) >= len(PROMPTS)
                         and s["hits"].get("memory", 0) >= len(PROMPTS))
        detail = json.loads((tmp_path / "state" / f"{loaded_a.process.pid}.json").read_text())[
            "patches"][NAME]["detail"]
        log_a = loaded_a.log()
    with server_factory(model, env=vault_env(vault)) as loaded_b:  # B, from the same directory
        on_b = [loaded_b.chat(p, max_tokens=TOKENS) for p in PROMPTS]
        stats_b = status(loaded_b, lambda s: s["hits"].get("write", 0) >= len(PROMPTS))
    with server_factory(replacement) as stock_b:  # B, no cache at all
        reference = [stock_b.chat(p, max_tokens=TOKENS)[0] for p in PROMPTS]

    # Nothing of A was sealed: the server on B answers exactly as stock B, cold first.
    assert [text for text, _ in on_b] == reference
    assert [cached(reply) for _, reply in on_b] == [0] * len(PROMPTS)
    assert stats_b["hits"]["write"] >= len(PROMPTS) and not stats_b["hits"].get("disk")
    # The first server kept serving A, from its memory tier only, and said why, once.
    assert [text for text, _ in first] != reference  # it really was answering from A
    assert [cached(reply) for _, reply in first] == [0] * len(PROMPTS)
    assert [text for text, _ in again] == [text for text, _ in first]
    assert all(cached(reply) > 0 for _, reply in again)
    assert stats_a["hits"]["memory"] == len(PROMPTS) and "write" not in stats_a["hits"]
    assert stats_a["fallbacks"]["memory-only:weights-changed"] == 1
    assert "disk tier off" in detail and "changed since this process loaded them" in detail
    assert len([line for line in log_a.splitlines() if "changed since this process loaded them" in line]) == 1


def test_corrupted_truncated_swapped_and_foreign_entries_are_refused(server_factory, tiny_q4_dir, tmp_path):
    vault = tmp_path / "vault"
    # Two prompts of equal length give two entries with the same tensor layout (to swap).
    prompts = ["Please count from 1 to 5 and then tell me a story about a village by a river.",
               "Please count from 2 to 6 and then tell me a story about a village by a river.",
               "Write a haiku about cache lines and the light of the moon over the quiet harbour.",
               "List three prime numbers and explain why each of them is prime.",
               "What is the capital of France? Paris is the capital of France."]
    with server_factory(tiny_q4_dir, env=vault_env(vault)) as first:
        cold = [first.chat(p, max_tokens=TOKENS) for p in prompts]
        status(first, lambda s: s["hits"].get("write", 0) >= len(prompts))
    by_length = {}
    for path in entries(vault):
        by_length.setdefault(len(read_header(path)[0]["__metadata__"]["token_ids"].split(",")), []).append(path)
    lengths = [prompt_tokens(reply) - 1 for _, reply in cold]  # each prompt's final checkpoint
    assert lengths[0] == lengths[1] and len(set(lengths[1:])) == len(prompts) - 1
    files = by_length[lengths[0]] + [path for n in lengths[2:] for path in by_length[n]]
    assert len(files) == len(prompts)

    swap_a, swap_b, flipped, truncated, foreign = files
    body_a, body_b = read_header(swap_a)[1], read_header(swap_b)[1]
    assert len(body_a) == len(body_b) and body_a != body_b
    swap_a.write_bytes(swap_a.read_bytes()[:-len(body_a)] + body_b)
    swap_b.write_bytes(swap_b.read_bytes()[:-len(body_b)] + body_a)
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    with open(truncated, "r+b") as handle:
        handle.truncate(truncated.stat().st_size - 1000)
    write_resealed(foreign, lambda metadata: metadata.update(c0_size="3"))  # sealed, but not make_cache()'s layout

    with server_factory(tiny_q4_dir, env=vault_env(vault)) as second:
        after = [second.chat(p, max_tokens=TOKENS) for p in prompts]
        again = [second.chat(p, max_tokens=TOKENS) for p in prompts]
        stats = status(second, lambda s: s["hits"].get("write", 0) >= len(prompts))
        log = second.log()

    for (cold_text, _), (text, reply), (warm_text, warm) in zip(cold, after, again):
        assert text == cold_text and cached(reply) == 0
        assert warm_text == cold_text and cached(warm) > 0
    assert {r: n for r, n in stats["fallbacks"].items() if r.startswith("refused")} == {
        "refused:checksum": 3, "refused:truncated": 1, "refused:layout": 1}
    assert stats["bytes"]["refused"] > 0
    refusals = [line for line in log.splitlines() if "vault_cache: refused" in line]
    assert sorted(line.split("refused ")[1].split(" ")[0] for line in refusals) == sorted(p.name for p in files)
    assert all("removed it" in line and "the request runs cold" in line for line in refusals)
    # Refused files were removed; what is there now was written again, sealed.
    for path in files:
        assert path.exists()
        assert read_header(path)[0]["__metadata__"]["vault_format"] == "glm53-vault-1"


# Runs the stock server module with os.fsync made to stop forever once the vault
# syncs a temporary entry: the test then kills the process at that very point.
FREEZE_IN_FSYNC = """
import os, runpy, sys, time
_fsync = os.fsync
def fsync(fd):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if "/.vault-tmp/" in target:
        with open(os.environ["VAULT_TEST_MARKER"], "w") as marker:
            marker.write(target)
        while True:
            time.sleep(60)
    return _fsync(fd)
os.fsync = fsync
sys.argv = [sys.argv[0], *sys.argv[3:]]  # drop "-m mlx_vlm.server"
runpy.run_module("mlx_vlm.server", run_name="__main__", alter_sys=True)
"""


def test_kill_9_during_a_write_leaves_no_entry_that_is_served(server_factory, tiny_q4_dir, tmp_path):
    vault, marker = tmp_path / "vault", tmp_path / "writing"
    env = {**vault_env(vault), "VAULT_TEST_MARKER": str(marker)}
    with server_factory(tiny_q4_dir, env=env, args=("-c", FREEZE_IN_FSYNC)) as doomed:
        cold_text, cold = doomed.chat(PROMPTS[0], max_tokens=TOKENS)
        deadline = time.time() + 60
        while not marker.exists() and time.time() < deadline:  # the writer is inside fsync
            time.sleep(0.1)
        assert marker.exists(), doomed.log()[-2000:]
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait()
    assert cached(cold) == 0
    leftovers = list((namespace(vault) / ".vault-tmp").iterdir())
    assert leftovers and entries(vault) == []  # written, never published
    # A kill earlier in the write would leave a shorter temporary: make one too.
    torn = leftovers[0].with_name(leftovers[0].name.replace(".safetensors", "0.safetensors"))
    torn.write_bytes(leftovers[0].read_bytes()[: leftovers[0].stat().st_size // 2])

    with server_factory(tiny_q4_dir, env=vault_env(vault)) as restarted:
        text, reply = restarted.chat(PROMPTS[0], max_tokens=TOKENS)
        warm_text, warm = restarted.chat(PROMPTS[0], max_tokens=TOKENS)
        stats = status(restarted, lambda s: s["hits"].get("write", 0) >= 1)
        log = restarted.log()
    assert text == cold_text and cached(reply) == 0
    assert warm_text == cold_text and cached(warm) > 0
    assert not [r for r in stats["fallbacks"] if r.startswith("refused")]
    assert not any(p.name in {leftovers[0].name, torn.name} for p in (namespace(vault) / ".vault-tmp").iterdir())
    assert "removed 2 unfinished writes" in log


def test_two_servers_on_one_vault_answer_every_request_like_a_solo_request(server_factory, tiny_q4_dir, tmp_path):
    prompts = PROMPTS + [
        "Tell me a story about a lighthouse keeper who counts ships at night, and then the gulls.",
        "Please write a short poem about the sea, the wind and the light of the moon.",
        "How many days are there in a week?",
    ]
    # Longer than every other prompt, so its entry is recognised by its length.
    only_a = ("What is the capital of France? Answer with one word, then explain why, and name "
              "three rivers, two bridges and one old market of that city, in that order.")
    with server_factory(tiny_q4_dir) as stock:  # no cache, one request at a time
        solo = {p: stock.chat(p, max_tokens=TOKENS)[0] for p in prompts + [only_a]}
    assert len(set(solo.values())) == len(solo)

    vault = tmp_path / "vault"
    with server_factory(tiny_q4_dir, env=vault_env(vault)) as a, \
            server_factory(tiny_q4_dir, env=vault_env(vault)) as b:
        answers = []
        with ThreadPoolExecutor(8) as pool:
            for _ in range(2):
                jobs = [(server, p) for p in prompts for server in (a, b)]
                answers += list(pool.map(lambda job: (job[1], job[0].chat(job[1], max_tokens=TOKENS)), jobs))
        # An entry only server a computed is served by server b from the shared vault.
        a_text, a_reply = a.chat(only_a, max_tokens=TOKENS)
        _wait_for_entry(vault, prompt_tokens(a_reply) - 1)  # APC writes in the background
        b_text, b_reply = b.chat(only_a, max_tokens=TOKENS)
        # Counters are published by a background flusher: wait for b's disk hit to appear.
        stats = [status(a), status(b, lambda s: s["hits"].get("disk", 0) >= 1)]

    for prompt, (text, _) in answers:
        assert text == solo[prompt], prompt
    assert a_text == b_text == solo[only_a]
    assert cached(a_reply) == 0 and cached(b_reply) == prompt_tokens(b_reply) - 1
    assert stats[1]["hits"]["disk"] >= 1
    for counters in stats:
        assert not [r for r in counters["fallbacks"] if r.startswith(("refused", "error"))]


def _wait_for_entry(vault, length, wait_s=60):
    deadline = time.time() + wait_s
    while time.time() < deadline:
        for path in entries(vault):
            try:
                if len(read_header(path)[0]["__metadata__"]["token_ids"].split(",")) == length:
                    return path
            except (OSError, ValueError, KeyError):
                continue
        time.sleep(0.1)
    raise AssertionError(f"no entry of {length} tokens was published in {vault}")

"""vault_cache, in process: a warm start is bit-identical to the cold prefill it replaces.

The cold reference of a prompt is the same generation with APC on and an
empty vault (so prefill is chunked at the same checkpoint boundaries); the
warm run restores from the SSD tier through a fresh APCManager (what a server
restart sees) or from memory. Logits are compared on their raw bits.
"""

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from glm53_patches import registry
from glm53_patches.hookspecs import hookimpl
from glm53_patches.patch import Patch
from glm53_patches.patches.vault_cache import PATCH, keying
from glm53_patches.tiny_model import write_tiny_model

NAME = "vault_cache"
INTERVAL = 32  # APC_CHECKPOINT_INTERVAL_TOKENS for these tests
TOKENS = 6


def token_ids(seed, n):
    """Random ordinary tokens (the first 18 ids are control tokens)."""
    return [int(t) for t in np.random.default_rng(seed).integers(20, 500, n)]


def load_observed(directory):
    """`mlx_vlm.load` with the vault applied, so that it sees what the load reads."""
    from mlx_vlm import load

    was_applied = NAME in registry.applied()
    registry.apply([NAME], strict=True)
    try:
        return load(str(directory))
    finally:
        if not was_applied:
            registry.revert([NAME])


@pytest.fixture(scope="module")
def loaded(tiny_fp32_dir, tiny_q4_dir):
    return {"fp32": load_observed(tiny_fp32_dir), "q4": load_observed(tiny_q4_dir)}


@pytest.fixture
def vault():
    PATCH.stats.reset()
    registry.apply([NAME], strict=True)
    managers = []

    def manager(directory, namespace=None, **overrides):
        from mlx_vlm import apc

        settings = {"enabled": True, "disk_path": str(directory), "checkpoint_entries": 4,
                    "checkpoint_interval_tokens": INTERVAL, **overrides}
        managers.append(apc.from_env(model_namespace=namespace, overrides=settings))
        return managers[-1]

    yield manager
    for manager_ in managers:
        manager_.close()
    registry.revert([NAME])


class Run:
    def __init__(self, tokens, logits, cached):
        self.tokens, self.logits, self.cached = tokens, logits, cached


def generate(model, processor, ids, manager, max_tokens=TOKENS):
    from mlx_vlm import stream_generate

    logits = []

    def record(tokens, step_logits):
        logits.append(np.array(step_logits.astype(mx.float32)))
        return step_logits

    tokens, cached = [], None
    for result in stream_generate(model, processor, "", input_ids=mx.array([ids]), max_tokens=max_tokens,
                                  apc_manager=manager, logits_processors=[record], temperature=0.0):
        if result.token is not None:
            tokens.append(int(result.token))
        cached = result.cached_tokens
    manager.disk.flush()  # APC writes entries in the background
    return Run(tokens, logits, cached)


def assert_bitwise(cold, warm, what):
    assert warm.tokens == cold.tokens, what
    assert len(warm.logits) == len(cold.logits) >= TOKENS, what
    for step, (a, b) in enumerate(zip(cold.logits, warm.logits)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{what}: step {step}"


@pytest.mark.parametrize("kind", ["fp32", "q4"])
def test_warm_logits_and_tokens_are_bit_identical_to_cold(loaded, vault, tmp_path, kind):
    model, processor = loaded[kind]
    long = token_ids(1, 130)
    prompts = {
        "short": token_ids(2, 20),
        "medium": token_ids(3, 75),
        "long": long,
        "shares 70 tokens": long[:70] + token_ids(4, 45),  # only part of a stored prefix
        "shares 100 tokens": long[:100] + token_ids(5, 12),
        "extends by 24 tokens": long + token_ids(6, 24),  # a conversation's next turn
        "extends by 5 tokens": long + token_ids(7, 5),
    }
    shared = tmp_path / "vault"
    for name in ("short", "medium", "long"):  # fill the vault, cold
        assert generate(model, processor, prompts[name], vault(shared)).cached == 0

    for i, (name, ids) in enumerate(prompts.items()):
        cold = generate(model, processor, ids, vault(tmp_path / f"empty-{i}"))
        restarted = vault(shared)  # a new manager: empty memory tier, the vault on disk
        warm = generate(model, processor, ids, restarted)
        again = generate(model, processor, ids, restarted)  # now from the memory tier
        assert cold.cached == 0
        if name in ("short", "medium", "long"):
            assert warm.cached == len(ids) - 1, name  # the prompt's own final checkpoint
        elif name.startswith("shares"):
            assert warm.cached == (int(name.split()[1]) // INTERVAL) * INTERVAL, name  # an interval checkpoint
        elif name == "extends by 24 tokens":
            assert warm.cached == len(long) - 1, name  # the stored prompt's final checkpoint
        else:  # resuming at the stored final would prefill 5 tokens through the decode path
            assert 0 < warm.cached < len(long) - 1, name
        assert again.cached == len(ids) - 1, name  # the warm run stored its own final checkpoint
        assert_bitwise(cold, warm, f"{kind} {name} from disk")
        assert_bitwise(cold, again, f"{kind} {name} from memory")
    snapshot = PATCH.stats.snapshot()
    assert snapshot["hits"]["disk"] == len(prompts) and snapshot["hits"]["memory"] == len(prompts)
    assert snapshot["fallbacks"]["skipped:chunking"] >= 1  # the 5-token extension
    assert not [r for r in snapshot["fallbacks"] if r.startswith(("refused", "error"))]


def _batch(model, processor, prompts, manager, max_tokens=TOKENS):
    """Prefill `prompts` together the way mlx_vlm.server's continuous batching does."""
    from mlx_vlm import apc
    from mlx_vlm.generate.ar import BatchGenerator

    generator = BatchGenerator(model.language_model, processor, apc_manager=manager, stop_tokens=set(),
                               greedy_sampling=True, max_tokens=max_tokens)
    salt = apc.semantic_extra_hash(model=model.language_model, processor=processor,
                                   media={"audio": None, "video": None})  # as the server computes it
    kwargs = []
    for ids in prompts:
        embedded = model.get_input_embeddings(mx.array([ids]), None).to_dict()
        kwargs.append({**{k: v for k, v in embedded.items() if v is not None}, "_apc_semantic_hash": salt})
    uids = generator.insert(prompts, max_tokens=max_tokens, prompt_kwargs=kwargs)
    out, done = {uid: [] for uid in uids}, set()
    while len(done) < len(uids):
        for response in generator.next()[1]:
            out[response.uid].append(int(response.token))
            if response.finish_reason is not None:
                done.add(response.uid)
    generator.close()
    manager.disk.flush()
    return [out[uid] for uid in uids]


def _recorded_batches(directory):
    from mlx_vlm.apc import _read_safetensors_metadata

    return [json.loads(_read_safetensors_metadata(p)["vault_batch"]) for p in directory.rglob("exact_*.safetensors")]


def test_padded_batches_are_not_harvested_and_equal_batches_restore_exactly(loaded, vault, tmp_path):
    model, processor = loaded["fp32"]
    padded = [token_ids(10, 40), token_ids(11, 70)]  # left-padded to a common length
    equal = [token_ids(12, 50), token_ids(13, 50)]
    shared = tmp_path / "vault"

    _batch(model, processor, padded, vault(shared))
    snapshot = PATCH.stats.snapshot()
    assert snapshot["fallbacks"]["skipped:batched-harvest"] >= 2 and "write" not in snapshot["hits"]
    assert _recorded_batches(shared) == []

    _batch(model, processor, equal, vault(shared))
    recorded = _recorded_batches(shared)
    assert recorded and all(b["rows"] == 2 and b["equal_suffix"] and not any(b["left_padding"]) for b in recorded)

    for i, ids in enumerate(padded + equal):
        cold = generate(model, processor, ids, vault(tmp_path / f"empty-{i}"))
        warm = generate(model, processor, ids, vault(shared))
        assert warm.cached == (0 if i < len(padded) else len(ids) - 1)
        assert_bitwise(cold, warm, f"prompt {i}")
    assert all(b["rows"] == 1 for b in _recorded_batches(shared) if b not in recorded)


class _Plugin:
    def __init__(self, patch):
        self.patch = patch

    @hookimpl
    def glm53_patches(self):
        return [self.patch]


def test_a_numerics_changing_patch_is_part_of_the_key(loaded, vault, tmp_path, monkeypatch):
    changing = Patch(name="vault_test_changing", summary="declares changed numerics", targets={},
                     numerics="changing")
    monkeypatch.setattr(registry, "_extra_plugins", [*registry._extra_plugins, _Plugin(changing)])
    monkeypatch.setattr(registry, "_plugins", None)
    model, processor = loaded["fp32"]
    ids, shared = token_ids(20, 40), tmp_path / "vault"
    assert generate(model, processor, ids, vault(shared)).cached == 0
    written = len(list(shared.rglob("exact_*.safetensors")))

    registry.apply([changing.name], strict=True)
    try:
        assert generate(model, processor, ids, vault(shared)).cached == 0  # written without it: not reused
        assert generate(model, processor, ids, vault(shared)).cached == len(ids) - 1  # its own entry
    finally:
        registry.revert([changing.name])
    assert generate(model, processor, ids, vault(shared)).cached == len(ids) - 1
    assert len(list(shared.rglob("exact_*.safetensors"))) == 2 * written  # one set per key


def test_weights_fingerprint_follows_content_not_path(tiny_q4_dir, tmp_path):
    PATCH.stats.reset()
    copy = shutil.copytree(tiny_q4_dir, tmp_path / "copy")
    original, _ = keying.weights_fingerprint(tiny_q4_dir, PATCH.stats)
    copied, first = keying.weights_fingerprint(copy, PATCH.stats)
    _, second = keying.weights_fingerprint(copy, PATCH.stats)
    assert copied == original
    assert first["hashed_files"] == first["files"] >= 2 and second["hashed_files"] == 0  # remembered

    weights = copy / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # same path, size and mtime
    changed, third = keying.weights_fingerprint(copy, PATCH.stats)
    assert changed != original and third["hashed_files"] == 1


def test_nothing_is_unpickled(loaded, vault, tmp_path, monkeypatch):
    model, processor = loaded["fp32"]
    ids, shared = token_ids(30, 40), tmp_path / "vault"
    cold = generate(model, processor, ids, vault(shared))

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    warm = generate(model, processor, ids, vault(shared))
    assert warm.cached == len(ids) - 1
    assert_bitwise(cold, warm, "restored without pickle")


def test_disk_budget_evicts_the_least_recently_used_entries(loaded, vault, tmp_path):
    from mlx_vlm.apc import _read_safetensors_metadata

    model, processor = loaded["fp32"]
    prompts = [token_ids(40 + i, 24) for i in range(4)]  # one entry each, all the same size
    shared = tmp_path / "vault"
    generate(model, processor, prompts[0], vault(shared))
    size = next(shared.rglob("exact_*.safetensors")).stat().st_size
    budget = {"disk_max_gb": 3.5 * size / (1 << 30)}  # APC_DISK_MAX_GB: room for three entries
    for ids in prompts[1:3]:
        assert generate(model, processor, ids, vault(shared, **budget)).cached == 0
    assert generate(model, processor, prompts[0], vault(shared, **budget)).cached == len(prompts[0]) - 1
    generate(model, processor, prompts[3], vault(shared, **budget))  # a fourth entry: over budget

    files = list(shared.rglob("exact_*.safetensors"))
    assert sum(p.stat().st_size for p in files) <= 3.5 * size
    kept = {_read_safetensors_metadata(p)["token_ids"] for p in files}
    # prompts[1] was the least recently used: written before prompts[2], and prompts[0] was read since.
    assert kept == {",".join(map(str, prompts[i][:-1])) for i in (0, 2, 3)}


def test_other_models_get_stock_keys(vault):
    from mlx_vlm import apc

    class Other:
        def apc_key_dependencies(self):
            return ["some-revision"]

    patched = apc.semantic_extra_hash(model=Other(), image_hash=7)
    registry.revert([NAME])
    try:
        assert apc.semantic_extra_hash(model=Other(), image_hash=7) == patched
    finally:
        registry.apply([NAME], strict=True)


# -- weights pinned to what was loaded (issue 21, item 1) -------------------------------------


def replace_weights(directory, source):
    """Put `source`'s weights in `directory` the way an update lands: a new file, renamed over."""
    staged = directory / ".incoming.safetensors"
    shutil.copyfile(source / "model.safetensors", staged)
    os.replace(staged, directory / "model.safetensors")


def sealed_by_model(folder):
    """{model directory an entry records: [entry paths]} of every entry under `folder`."""
    from mlx_vlm.apc import _read_safetensors_metadata

    found = {}
    for path in sorted(folder.rglob("exact_*.safetensors")):
        found.setdefault(json.loads(_read_safetensors_metadata(path)["vault_origin"])["model"], []).append(path)
    return found


def sealed_origins(folder):
    return sorted(model for model, paths in sealed_by_model(folder).items() for _ in paths)


@pytest.mark.parametrize("how", ["unchanged", "replaced after loading", "replaced while loading",
                                 "replaced while hashed", "lazy", "loaded before the patch"])
def test_only_weights_pinned_since_their_load_reach_the_disk(vault, tmp_path, monkeypatch, how):
    from mlx_vlm import load, utils

    model_dir = write_tiny_model(tmp_path / "model", seed=0)
    replacement = write_tiny_model(tmp_path / "replacement", seed=1)
    control, _ = load(str(write_tiny_model(tmp_path / "control", seed=2)))  # another model, untouched
    if how == "replaced while loading":  # after mx.load opened the file, before a tensor is read
        read = utils._load_safetensors

        def read_then_replace(path):
            weights = read(path)
            replace_weights(model_dir, replacement)
            return weights

        monkeypatch.setattr(utils, "_load_safetensors", read_then_replace)
    if how == "loaded before the patch":
        registry.revert([NAME])
        model, processor = load(str(model_dir))
        registry.apply([NAME], strict=True)
    else:
        model, processor = load(str(model_dir), lazy=how == "lazy")
    monkeypatch.undo()
    if how == "replaced after loading":
        replace_weights(model_dir, replacement)
    if how == "replaced while hashed":  # at the first request, between the two stat checks
        hash_file = keying._hash_file

        def hash_then_replace(path):
            digest = hash_file(path)
            if Path(path).parent == model_dir.resolve() and Path(path).suffix == ".safetensors":
                replace_weights(model_dir, replacement)
            return digest

        monkeypatch.setattr(keying, "_hash_file", hash_then_replace)

    ids, shared = token_ids(50, 40), tmp_path / "vault"
    manager = vault(shared)
    cold = generate(model, processor, ids, manager)
    warm = generate(model, processor, ids, manager)  # the memory tier still serves
    assert generate(control, processor, ids, vault(shared)).cached == 0

    assert cold.cached == 0 and warm.cached == len(ids) - 1
    assert_bitwise(cold, warm, how)
    snapshot = PATCH.stats.snapshot()
    off = {k: v for k, v in snapshot["fallbacks"].items() if k.startswith("memory-only:")}
    expected = {"unchanged": [], "lazy": ["lazy-load"], "loaded before the patch": ["load-not-seen"]}.get(
        how, ["weights-changed"])
    assert off == {f"memory-only:{key}": 1 for key in expected}
    assert sealed_origins(shared) == sorted(str(d.resolve()) for d in [tmp_path / "control"] + (
        [model_dir] if how == "unchanged" else []))
    if how.startswith("replaced"):
        when = "while" if how == "replaced while loading" else "since"
        assert snapshot["notes"][str(model_dir)].startswith(f"its weight files changed {when} this process loaded")
    named = {"unchanged": set(), "loaded before the patch": {"a model"}}.get(how, {str(model_dir)})
    assert set(snapshot["notes"]) == named  # the control model is not among them
    assert ("disk tier off for" in PATCH.report()) == bool(named)


# -- what is on disk: stale entries, a vault-wide bound, list and prune (issue 21, item 7) ----------


def test_entries_of_earlier_weights_of_the_same_directory_are_removed(vault, tmp_path):
    from mlx_vlm import load

    model_dir = write_tiny_model(tmp_path / "model", seed=0)
    replacement = write_tiny_model(tmp_path / "replacement", seed=1)
    other_dir = write_tiny_model(tmp_path / "other", seed=2)
    shared, ids = tmp_path / "vault", token_ids(60, 40)
    before, processor = load(str(model_dir))
    other, _ = load(str(other_dir))
    generate(before, processor, ids, vault(shared))
    generate(other, processor, ids, vault(shared))  # same ("default") namespace, another directory
    (old,) = sealed_by_model(shared)[str(model_dir.resolve())]
    old_size = old.stat().st_size

    replace_weights(model_dir, replacement)
    after, _ = load(str(model_dir))  # a new process would load the new weights like this
    PATCH.stats.reset()
    run = generate(after, processor, ids, vault(shared))

    assert run.cached == 0 and not old.exists()
    assert sealed_origins(shared) == sorted(str(d.resolve()) for d in (model_dir, other_dir))
    snapshot = PATCH.stats.snapshot()
    assert snapshot["hits"]["pruned"] == 1 and snapshot["bytes"]["pruned"] == old_size
    assert generate(other, processor, ids, vault(shared)).cached == len(ids) - 1  # the other model's entry stayed


def test_the_vault_is_bounded_across_namespaces_least_recently_used_first(loaded, vault, tmp_path, monkeypatch):
    model, processor = loaded["fp32"]
    prompts = [token_ids(70 + i, 24) for i in range(3)]  # one entry each, all the same size
    shared = tmp_path / "vault"
    generate(model, processor, prompts[0], vault(shared, namespace="first"))
    (entry,) = shared.rglob("exact_*.safetensors")
    size = entry.stat().st_size
    generate(model, processor, prompts[1], vault(shared, namespace="first"))
    (second,) = set(shared.rglob("exact_*.safetensors")) - {entry}
    second_size = second.stat().st_size
    assert generate(model, processor, prompts[0], vault(shared, namespace="first")).cached == len(prompts[0]) - 1
    # Room for two and a half entries in all; APC's own cap (per namespace) is far away.
    monkeypatch.setenv("GLM53_VAULT_CACHE_MAX_GB", str(2.5 * size / (1 << 30)))
    PATCH.stats.reset()
    generate(model, processor, prompts[2], vault(shared, namespace="second"))

    # prompts[1] was the least recently used: written after prompts[0], which was read since.
    assert entry.exists() and not second.exists()
    assert sorted(p.parent.name for p in shared.rglob("exact_*.safetensors")) == ["first", "second"]
    snapshot = PATCH.stats.snapshot()
    assert snapshot["hits"]["evicted"] == 1 and snapshot["bytes"]["evicted"] == second_size


def test_the_apc_root_is_made_private_unless_it_holds_other_files(loaded, vault, tmp_path):
    model, processor = loaded["fp32"]
    ids = token_ids(80, 24)
    for name, other_file in (("apc", False), ("shared", True)):
        root = tmp_path / name
        root.mkdir(mode=0o755)
        os.chmod(root, 0o755)
        if other_file:
            (root / "notes.txt").write_text("someone else's folder")
        generate(model, processor, ids, vault(root))
        assert stat.S_IMODE(root.stat().st_mode) == (0o755 if other_file else 0o700), name
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in root.iterdir() if p.is_dir())


def vault_cli(*args):
    done = subprocess.run([sys.executable, "-m", "glm53_patches.cli", "vault", *map(str, args)],
                          capture_output=True, text=True)
    return done.returncode, done.stdout, done.stderr


def test_vault_list_and_prune(vault, tmp_path):
    from mlx_vlm import load

    model_dir = write_tiny_model(tmp_path / "model", seed=0)
    replacement = write_tiny_model(tmp_path / "replacement", seed=1)
    other_dir = write_tiny_model(tmp_path / "other", seed=2)
    (model, processor), (other, _) = load(str(model_dir)), load(str(other_dir))
    shared, prompts = tmp_path / "vault", [token_ids(90 + i, 30) for i in range(3)]
    generate(model, processor, prompts[0], vault(shared))
    for ids in prompts[:2]:
        generate(other, processor, ids, vault(shared, namespace="other"))
    made = sealed_by_model(shared)
    (stale,), (unused, used) = made[str(model_dir.resolve())], made[str(other_dir.resolve())]  # in name order
    replace_weights(model_dir, replacement)  # its entry can never hit again

    rc, out, _ = vault_cli("list", "--apc-dir", shared, "--json")
    rows = {row["path"]: row for row in json.loads(out)["entries"]}
    assert rc == 0 and set(rows) == {str(stale), str(unused), str(used)}
    assert [rows[str(p)]["weights"] for p in (stale, unused, used)] == ["not hashed", "current", "current"]  # list never hashes
    assert rows[str(stale)]["tokens"] == len(prompts[0]) - 1 and rows[str(unused)]["bytes"] == unused.stat().st_size
    rc, out, _ = vault_cli("list", "--apc-dir", shared)
    assert rc == 0 and out.startswith(f"{shared}: 3 sealed entries") and all(p.name in out for p in (stale, unused, used))

    # A bad argument: one line that says what is accepted, and nothing removed.
    for args in (["--older-than", "7x"], ["--max-gb", "-1"], [], ["--stale", "--apc-dir", tmp_path / "absent"]):
        rc, out, err = vault_cli("prune", *(["--apc-dir", shared] if "--apc-dir" not in args else []), *args)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("glm53-patches vault: "), args
    assert all(p.exists() for p in (stale, unused, used))

    rc, out, _ = vault_cli("prune", "--apc-dir", shared, "--stale", "--dry-run")
    assert rc == 0 and [line.split(" (")[0] for line in out.splitlines()[:-1]] == [f"would remove default/{stale.name}"]
    assert stale.exists()
    rc, out, _ = vault_cli("prune", "--apc-dir", shared, "--stale")
    assert rc == 0 and "removed 1 entries" in out and not stale.exists() and unused.exists() and used.exists()

    long_ago = time.time() - 3 * 86400
    os.utime(unused, (long_ago, long_ago))
    rc, out, _ = vault_cli("prune", "--apc-dir", shared, "--older-than", "2d")
    assert rc == 0 and "removed 1 entries" in out and not unused.exists() and used.exists()

    generate(other, processor, prompts[2], vault(shared, namespace="other"))
    (latest,) = set(shared.rglob("exact_*.safetensors")) - {used}
    rc, out, _ = vault_cli("prune", "--apc-dir", shared, "--max-gb", 1.5 * used.stat().st_size / (1 << 30))
    assert rc == 0 and not used.exists() and latest.exists()  # the least recently used one went

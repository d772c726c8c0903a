"""Sealed exact-cache entries in DiskBlockStore (MLX_VLM_APC_SEALED_DISK).

With the switch on, an exact-cache entry is written with a SHA-256 digest of
the whole file in its metadata (fsync'd, through a private temporary folder,
published with an atomic rename) and read back as one verified buffer; a
corrupted, truncated or unsealed entry is refused, removed, and the lookup is
a miss. A snapshot holding a cache kind the sealed reader does not decode is
written and read by the stock code. With the switch off nothing changes.
These tests turn the switch on per test.
"""

import os

import mlx.core as mx
import pytest

from mlx_vlm import apc, apc_sealed
from mlx_vlm.models.cache import ArraysCache, KVCache, RotatingKVCache

TOKENS = (5, 17, 33, 101, 7, 250, 3, 12, 90, 61)


@pytest.fixture
def store(tmp_path):
    disk = apc.DiskBlockStore(tmp_path, namespace="sealed-test")
    yield disk
    disk.close()


@pytest.fixture
def sealed_on(monkeypatch):
    monkeypatch.setattr(apc_sealed, "ENABLED", True)


def kv_and_arrays():
    mx.random.seed(0)
    kv = KVCache()
    kv.update_and_fetch(mx.random.normal((1, 2, len(TOKENS), 8)), mx.random.normal((1, 2, len(TOKENS), 8)))
    arrays = ArraysCache(size=2)
    arrays[0] = mx.random.normal((1, 3, 16))
    arrays[1] = mx.random.normal((1, 2, 8, 8))
    return [kv, arrays]


def write(store, prompt_cache, cache_hash=123):
    path = store.dir / f"{store._exact_id_for(cache_hash)}{store.SUFFIX}"
    snapshot = apc._DiskExactCacheSnapshot(cache_hash=cache_hash, token_ids=TOKENS, extra_hash=7,
                                           prompt_cache=prompt_cache)
    assert store._write_exact_cache_snapshot(path, snapshot) == [cache_hash]
    return path


def load(store, path):
    return store._load_exact_cache_file(path, min_capacity_tokens=None)


def bits_equal(a, b):
    view = {4: mx.uint32, 2: mx.uint16, 1: mx.uint8}[a.dtype.size]
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a.view(view), b.view(view)).item()


def metadata(path):
    return apc._read_safetensors_metadata(path) or {}


def test_off_by_default():
    assert apc_sealed.ENABLED is (os.environ.get("MLX_VLM_APC_SEALED_DISK", "0") == "1")


def test_sealed_round_trip_is_bit_exact(store, sealed_on):
    original = kv_and_arrays()
    path = write(store, original)
    meta = metadata(path)
    assert meta["sealed_format"] == apc_sealed.FORMAT and meta["sealed_digest_alg"] == "sha256"
    assert len(meta["sealed_digest"]) == 64 and meta["sealed_digest"] != "0" * 64
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert not list(store.dir.glob(f"*.{os.getpid()}-*"))  # nothing left beside the entry
    token_ids, extra_hash, restored = load(store, path)
    assert token_ids == TOKENS and extra_hash == 7
    kv, arrays = restored
    assert type(kv) is KVCache and kv.offset == len(TOKENS)
    assert bits_equal(kv.keys[..., : kv.offset, :], original[0].keys[..., : len(TOKENS), :])
    assert bits_equal(kv.values[..., : kv.offset, :], original[0].values[..., : len(TOKENS), :])
    assert all(bits_equal(a, b) for a, b in zip(arrays.cache, original[1].cache))


@pytest.mark.parametrize("damage", ["flip a tensor byte", "flip a metadata byte", "truncate", "empty"])
def test_a_damaged_entry_is_refused_and_removed(store, sealed_on, damage):
    path = write(store, kv_and_arrays())
    data = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    if damage == "flip a tensor byte":
        data[-5] ^= 0x01
    elif damage == "flip a metadata byte":
        where = data.index(b'"extra_hash":"7"', 8, header_end)
        data[where + len('"extra_hash":"')] = ord("8")
    elif damage == "truncate":
        data = data[: len(data) - 64]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert load(store, path) is None
    assert not path.exists()
    with store._index_lock:
        assert path not in store._exact_index.values()


def test_an_unsealed_entry_is_refused(store, sealed_on, monkeypatch):
    monkeypatch.setattr(apc_sealed, "ENABLED", False)
    path = write(store, kv_and_arrays())  # the stock writer
    assert "sealed_digest" not in metadata(path)
    monkeypatch.setattr(apc_sealed, "ENABLED", True)
    assert load(store, path) is None
    assert not path.exists()


def test_another_file_in_place_is_refused(store, sealed_on):
    path = write(store, kv_and_arrays(), cache_hash=1)
    other = write(store, kv_and_arrays(), cache_hash=2)
    os.replace(other, path)  # a sealed entry under another entry's name
    assert load(store, path) is None and not path.exists()


def test_kinds_the_sealed_reader_does_not_decode_stay_stock(store, sealed_on):
    rotating = RotatingKVCache(max_size=32)
    rotating.update_and_fetch(mx.random.normal((1, 2, len(TOKENS), 8)), mx.random.normal((1, 2, len(TOKENS), 8)))
    path = write(store, [rotating])
    assert "sealed_digest" not in metadata(path)  # written by the stock code
    token_ids, _, restored = load(store, path)  # and read by it
    assert token_ids == TOKENS and type(restored[0]) is RotatingKVCache
    assert path.exists()


def test_switch_off_is_stock(store, monkeypatch):
    assert not apc_sealed.ENABLED

    def fail(*args, **kwargs):
        raise AssertionError("the sealed path ran with the switch off")

    monkeypatch.setattr(apc_sealed, "write_exact_cache_snapshot", fail)
    monkeypatch.setattr(apc_sealed, "load_exact_cache_file", fail)
    path = write(store, kv_and_arrays())
    assert not [k for k in metadata(path) if k.startswith("sealed_")]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # stock APC has no digest: a damaged tensor is read as it is
    path.write_bytes(bytes(data))
    token_ids, _, _ = load(store, path)
    assert token_ids == TOKENS and path.exists()

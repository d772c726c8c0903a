"""The on-disk form of a sealed entry: APC's exact-cache safetensors file, sealed.

An entry is the file APC itself writes (``exact_<id>.safetensors``, layout
``exact_cache_v1``: tensors plus string metadata) with these metadata fields
added:

``vault_format``       ``glm53-vault-1``
``vault_fingerprint``  optional: the key fingerprint it was written under
``vault_batch``        optional, JSON: the batch shape the state was harvested in
``vault_origin``       optional, JSON: what produced it (the model directory and the
                       digest of its weights), so that stale entries can be found
``vault_digest_alg``   ``sha256``
``vault_digest``       SHA-256 of the whole file's bytes, taken while this
                       field held 64 ``0`` characters

Writing: ``mx.save_safetensors`` into ``<namespace>/.vault-tmp/`` (a private
folder APC's startup cleanup does not look into), digest written in place,
``fsync``, ``os.replace`` into the namespace, ``fsync`` of the folder. A kill
at any point leaves either no entry or a complete one.

Reading: one ``open``, the whole file read into one buffer, the digest
checked, then every tensor decoded from that buffer. The path is never opened
twice, so a concurrent ``os.replace`` by another process cannot mix two files.
Nothing is unpickled: the header is JSON, tensors are raw bytes.

``write_exact_cache_snapshot`` and ``load_exact_cache_file`` are what
``DiskBlockStore`` does with an exact-cache entry, sealed. The reader decodes
the cache kinds ``kv``, ``arrays``, ``pooling`` and ``cache_list``; a
snapshot holding another kind is not sealed (``write_exact_cache_snapshot``
returns None), and an unsealed entry of such a kind is left to the stock
loader when no ``layout`` is required (``load_exact_cache_file`` returns
``STOCK``). A refused entry is removed, if it is still the file that was read.
"""

import hashlib
import io
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

FORMAT = "glm53-vault-1"
DIGEST_ALG = "sha256"
_DIGEST_KEY = "vault_digest"
_PLACEHOLDER = "0" * 64
TMP_DIR = ".vault-tmp"
_MAX_HEADER = 64 << 20
SEALABLE = ("kv", "arrays", "pooling", "cache_list")
STOCK = object()  # load_exact_cache_file: not a sealed entry of a kind this reader decodes

log = logging.getLogger(__name__)


class Refused(Exception):
    """The entry must not be served; `reason` names why."""

    def __init__(self, reason, identity=None, size=0):
        super().__init__(reason)
        self.reason, self.identity, self.size = reason, identity, size


class Gone(Exception):
    """The file vanished (evicted or replaced by another process): a plain miss."""


class Unsealed(Exception):
    """An unsealed entry holding a cache kind this reader does not decode."""


@dataclass
class Opened:
    token_ids: tuple
    extra_hash: int
    prompt_cache: list
    size: int


# -- writing ---------------------------------------------------------------------


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _marker(digest: str) -> bytes:
    return f'"{_DIGEST_KEY}":"{digest}"'.encode()


def write(store, path: Path, snapshot, *, fingerprint=None, harvest=None, origin=None):
    """Serialize `snapshot` like APC does, seal it, publish it atomically; return its size.

    None, and nothing written, if the snapshot holds a cache kind the reader does not decode.
    """
    from mlx_vlm import apc

    metadata = {
        "layout": "exact_cache_v1",
        "cache_hash": str(int(snapshot.cache_hash)),
        "extra_hash": str(int(snapshot.extra_hash)),
        "token_ids": ",".join(str(int(t)) for t in snapshot.token_ids),
        "num_entries": str(len(snapshot.prompt_cache)),
        "prefix_trimmable": str(int(apc._dense_checkpoint_trimmable(snapshot.prompt_cache, len(snapshot.token_ids)))),
        "store_id": store._exact_id_for(snapshot.cache_hash),
    }
    arrays = {}
    for i, entry in enumerate(snapshot.prompt_cache):
        if not store._snapshot_exact_cache_entry(entry, f"c{i}", arrays, metadata):
            raise ValueError(f"unsupported exact-cache entry at index {i}")
    if not all(_sealable(metadata_layout(metadata, f"c{i}")) for i in range(len(snapshot.prompt_cache))):
        return None
    empty = apc._extract_empty_tensor_specs(arrays)
    if empty:
        metadata[apc._EMPTY_TENSORS_METADATA] = json.dumps(empty, separators=(",", ":"), sort_keys=True)
    metadata["vault_format"] = FORMAT
    if fingerprint is not None:
        metadata["vault_fingerprint"] = fingerprint
    if harvest is not None:
        metadata["vault_batch"] = json.dumps(harvest, separators=(",", ":"), sort_keys=True)
    if origin is not None:
        metadata["vault_origin"] = json.dumps(origin, separators=(",", ":"), sort_keys=True)
    metadata.update({"vault_digest_alg": DIGEST_ALG, _DIGEST_KEY: _PLACEHOLDER})
    folder = private_dir(Path(store.dir) / TMP_DIR)
    temporary = folder / f"{path.stem}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.safetensors"
    try:
        mx.save_safetensors(str(temporary), arrays, metadata=metadata)
        fd = os.open(temporary, os.O_RDWR)
        try:
            os.fchmod(fd, 0o600)
            data = _read_all(fd)
            header_end = 8 + int.from_bytes(data[:8], "little")
            where = data.find(_marker(_PLACEHOLDER), 8, header_end)
            if where < 0 or data.find(_marker(_PLACEHOLDER), where + 1, header_end) >= 0:
                raise ValueError("digest placeholder not found exactly once in the header")
            digest = hashlib.sha256(data).hexdigest()
            offset = where + len(_marker(_PLACEHOLDER)) - len(_PLACEHOLDER) - 1
            if os.pwrite(fd, digest.encode(), offset) != len(digest):
                raise OSError("short write of the digest")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        _fsync_dir(path.parent)
    finally:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
    return len(data)


def _read_all(fd) -> bytearray:
    """The whole file behind `fd`, read through that one descriptor, from its start."""
    size = os.fstat(fd).st_size
    data = bytearray(size)
    done = 0
    with io.FileIO(fd, "rb", closefd=False) as handle, memoryview(data) as view:
        handle.seek(0)
        while done < size:
            got = handle.readinto(view[done:])
            if not got:
                break
            done += got
    if done != size:
        del data[done:]
    return data


# -- reading -----------------------------------------------------------------------


def metadata_layout(metadata, prefix):
    kind = metadata.get(f"{prefix}_kind")
    try:
        if kind == "kv":
            return ("kv",)
        if kind == "arrays":
            return ("arrays", int(metadata[f"{prefix}_size"]))
        if kind == "pooling":
            return ("pooling", int(metadata[f"{prefix}_ratio"]))
        if kind == "cache_list":
            size = int(metadata[f"{prefix}_size"])
            return ("cache_list", tuple(metadata_layout(metadata, f"{prefix}_e{j}") for j in range(size)))
    except (KeyError, TypeError, ValueError):
        pass
    return ("other", str(kind))


def _sealable(layout) -> bool:
    if layout[0] == "cache_list":
        return all(_sealable(child) for child in layout[1])
    return layout[0] in SEALABLE


def read(store, path: Path, *, fingerprint=None, layout=None, prefix_len=None, min_capacity_tokens=None):
    """Open, verify and decode one entry; raise Refused or Gone; None if unusable here.

    ``fingerprint`` and ``layout`` (of the model's caches), when given, must match
    the entry's. Without a ``layout``, an unsealed entry of a kind this reader does
    not decode raises Unsealed.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise Gone() from None
    except OSError:
        raise Refused("unreadable") from None
    try:
        stat = os.fstat(fd)
        identity = (stat.st_dev, stat.st_ino)
        try:
            data = _read_all(fd)
        except OSError:
            raise Refused("unreadable", identity, stat.st_size) from None
    finally:
        os.close(fd)
    size = len(data)

    def refuse(reason):
        return Refused(reason, identity, size)

    if size < 8:
        raise refuse("truncated")
    header_len = int.from_bytes(data[:8], "little")
    if header_len <= 0 or header_len > _MAX_HEADER:
        raise refuse("unreadable")
    if 8 + header_len > size:
        raise refuse("truncated")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(header, dict) or not isinstance(metadata, dict):
            raise ValueError("not a safetensors header")
    except ValueError:
        raise refuse("unreadable") from None
    base = 8 + header_len
    try:
        data_end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        data_end = 0  # a mangled header: the digest below refuses it
    if base + data_end > size:
        raise refuse("truncated")
    digest = metadata.get(_DIGEST_KEY)
    if layout is None and metadata.get("vault_format") is None and not all(
        _sealable(metadata_layout(metadata, f"c{i}")) for i in range(_count(metadata))
    ):
        raise Unsealed()
    if (metadata.get("vault_format") != FORMAT or metadata.get("vault_digest_alg") != DIGEST_ALG
            or not isinstance(digest, str) or len(digest) != 64):
        raise refuse("unsigned")
    where = data.find(_marker(digest), 8, base)
    if where < 0 or data.find(_marker(digest), where + 1, base) >= 0:
        raise refuse("checksum")
    start = where + len(_marker(digest)) - len(digest) - 1
    data[start:start + len(digest)] = _PLACEHOLDER.encode()
    if hashlib.sha256(data).hexdigest() != digest:
        raise refuse("checksum")
    try:
        cache_hash = int(metadata["cache_hash"])
        token_ids = tuple(int(x) for x in metadata.get("token_ids", "").split(",") if x)
        extra_hash = int(metadata.get("extra_hash", "0"))
        entries = int(metadata.get("num_entries", "0"))
    except (KeyError, TypeError, ValueError):
        raise refuse("layout") from None
    if store._exact_id_for(cache_hash) != path.stem:
        raise refuse("misplaced")
    if fingerprint is not None and metadata.get("vault_fingerprint") != fingerprint:
        raise refuse("fingerprint")
    found = tuple(metadata_layout(metadata, f"c{i}") for i in range(entries))
    if metadata.get("layout") != "exact_cache_v1" or not all(map(_sealable, found)) or (
        layout is not None and found != tuple(layout)
    ):
        raise refuse("layout")
    if prefix_len is not None and prefix_len != len(token_ids):
        return None  # glm5_next's recurrent state cannot be cut back to a shorter prefix
    try:
        prompt_cache = _decode(data, base, header, metadata, entries, min_capacity_tokens)
    except _Bad:
        raise refuse("layout") from None
    return Opened(token_ids, extra_hash, prompt_cache, size)


def _count(metadata) -> int:
    try:
        return int(metadata.get("num_entries", "0"))
    except (TypeError, ValueError):
        return 0


class _Bad(Exception):
    pass


def _decode(data, base, header, metadata, entries, min_capacity_tokens):
    """Build glm5_next's cache objects from the verified buffer, as APC's loader does."""
    from mlx_vlm import apc
    from mlx_vlm.models import cache as lm_cache

    tensors = apc._restore_empty_tensor_entries(header, metadata)
    if tensors is None:
        raise _Bad()
    view = memoryview(data)
    loaded = []

    def array(name):
        entry = tensors.get(name)
        if entry is None:
            raise _Bad()
        if entry.get(apc._EMPTY_TENSOR_MARKER) is True:
            value = mx.zeros(tuple(entry["shape"]), dtype=entry["mlx_dtype"])
        else:
            bounds = apc._safetensors_tensor_bounds(entry)
            if bounds is None:
                raise _Bad()
            start, end, _ = bounds
            value = apc._mlx_array_from_safetensors_bytes(view[base + start:base + end], entry)
            if value is None:
                raise _Bad()
        if value.ndim == 0 or value.shape[0] != 1:  # one row, as APC stores it
            raise _Bad()
        loaded.append(value)
        return value

    def integer(key, default=None):
        value = metadata.get(key, default)
        if value is None:
            raise _Bad()
        try:
            return int(value)
        except (TypeError, ValueError):
            raise _Bad() from None

    def entry(prefix):
        kind = metadata.get(f"{prefix}_kind")
        if kind == "kv":
            c = lm_cache.KVCache()
            if metadata.get(f"{prefix}_empty", "0") == "1":
                c.offset = integer(f"{prefix}_offset", "0")
                return c
            keys, values = array(f"{prefix}_k"), array(f"{prefix}_v")
            if keys.ndim != 4 or values.ndim != 4:
                raise _Bad()
            offset = integer(f"{prefix}_offset", str(keys.shape[2]))
            step = integer(f"{prefix}_step", "256")
            if not 0 < offset <= min(keys.shape[2], values.shape[2]):
                raise _Bad()
            keys, values = apc._pad_kv_for_capacity(
                keys, values, offset=offset, min_capacity_tokens=min_capacity_tokens, step=step
            )
            loaded.extend([keys, values])
            c.keys, c.values, c.offset, c.step = keys, values, offset, step
            return c
        if kind == "arrays":
            c = lm_cache.ArraysCache(size=integer(f"{prefix}_size"))
            c.cache = [
                None if metadata.get(f"{prefix}_s{j}_none", "0") == "1" else array(f"{prefix}_s{j}")
                for j in range(len(c.cache))
            ]
            if f"{prefix}_left_padding" in tensors:
                c.left_padding = array(f"{prefix}_left_padding")
            if f"{prefix}_lengths" in tensors:
                c.lengths = array(f"{prefix}_lengths")
            return c
        if kind == "pooling":
            c = lm_cache.PoolingCache(integer(f"{prefix}_ratio"))
            c.remainder = integer(f"{prefix}_remainder", "0")
            for attr in ("pooled", "buf_kv", "buf_gate"):
                if f"{prefix}_{attr}" in tensors:
                    setattr(c, attr, array(f"{prefix}_{attr}"))
            return c
        if kind == "cache_list":
            return lm_cache.CacheList(*(entry(f"{prefix}_e{j}") for j in range(integer(f"{prefix}_size"))))
        raise _Bad()

    try:
        prompt_cache = [entry(f"c{i}") for i in range(entries)]
    except (KeyError, TypeError, ValueError):
        raise _Bad() from None
    if loaded:
        mx.eval(loaded)
    return prompt_cache


def remove(path: Path, identity) -> bool:
    """Delete `path` if it is still the very file that was read (not a newer one)."""
    try:
        stat = os.stat(path)
        if identity is not None and (stat.st_dev, stat.st_ino) != tuple(identity):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        return False


# -- DiskBlockStore ------------------------------------------------------------------


def log_event(event, path: Path, size: int, refusal=None, removed=False):
    """The default ``report``: a warning for each refused entry."""
    if event == "refused":
        log.warning(f"refused exact-cache entry {path.name} ({refusal.reason}); "
                    + ("removed it" if removed else "could not remove it") + "; the request runs cold")


def write_exact_cache_snapshot(store, path: Path, snapshot, *, fingerprint=None, harvest=None, origin=None,
                               report=log_event):
    """``DiskBlockStore._write_exact_cache_snapshot``, sealed: [cache_hash], or None
    (nothing written) for a snapshot this module does not seal."""
    if not store._ensure_dir():
        raise OSError(f"APC disk cache directory unavailable: {store.dir}")
    path = Path(path)
    size = write(store, path, snapshot, fingerprint=fingerprint, harvest=harvest, origin=origin)
    if size is None:
        return None
    store._disk_bytes += size
    with store._index_lock:
        store._exact_index[int(snapshot.cache_hash)] = path
    report("written", path, size)
    store._maybe_evict()
    return [int(snapshot.cache_hash)]


def load_exact_cache_file(store, path: Path, *, min_capacity_tokens, prefix_len=None, fingerprint=None,
                          layout=None, report=log_event):
    """``DiskBlockStore._load_exact_cache_file``, verified: (token_ids, extra_hash,
    prompt_cache), None (a miss; a refused entry is removed), or ``STOCK``."""
    path = Path(path)
    try:
        opened = read(store, path, fingerprint=fingerprint, layout=layout, prefix_len=prefix_len,
                      min_capacity_tokens=min_capacity_tokens)
    except Unsealed:
        return STOCK
    except Gone:
        store._drop_index_for_path(path)
        return None
    except Refused as refusal:
        removed = remove(path, refusal.identity)
        store._drop_index_for_path(path)
        if removed:
            store._disk_bytes = max(0, store._disk_bytes - refusal.size)
        report("refused", path, refusal.size, refusal, removed)
        return None
    if opened is None:
        return None
    try:
        os.utime(path, None)  # APC's disk LRU clock
    except OSError:
        pass
    report("read", path, opened.size)
    return opened.token_ids, opened.extra_hash, opened.prompt_cache

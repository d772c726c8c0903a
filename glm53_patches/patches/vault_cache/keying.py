"""What a vault entry is keyed by: the fingerprint of the code and data that produced it.

fingerprint = SHA-256 over
  * the content of the model directory's weight files (``*.safetensors``,
    ``model.safetensors.index.json``) and ``config.json``, hashed once and
    remembered by (real path, size, mtime_ns, ctime_ns, inode), so a restart
    or a second server does not rehash;
  * the in-memory text config of the loaded model;
  * mlx and mlx-vlm versions, the default device type;
  * the names of the numerics-changing patches applied at the time.

The fingerprint must describe the weights this process holds, not whatever
the files hold at the first request. So the load itself is observed
(``observe_load``, from glm5_next's ``LanguageModel.sanitize``, which
``mlx_vlm.utils.load_model`` reaches after ``mx.load`` has opened the weight
files and before any tensor is read): it records the model directory and the
stat of its files. At the first request the files must still have that stat,
before and after they are hashed; a stat unchanged since the load pins the
content, so the digests may be taken then (and remembered). A model whose files
changed (after or during its load, or while they were hashed), whose load was
lazy, offloaded or not seen gets a per-process nonce instead: its entries live in memory only, nothing is read
from or written to disk, and the reason is logged once and shown by `status`.
"""

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from glm53_patches import config, registry

log = logging.getLogger("glm53_patches.vault_cache")

FORMAT = 1  # bump when the meaning of the fingerprint or of the entries changes
LANGUAGE = "mlx_vlm.models.glm5_next.language"
_CHUNK = 8 << 20
_PROCESS_NONCE = secrets.token_hex(16)
_lock = threading.RLock()


def glm5_language_model(model):
    """glm5_next's LanguageModel behind `model` (a Model or a LanguageModel), else None."""
    if model is None:
        return None
    module = sys.modules.get(LANGUAGE)
    if module is None:
        return None
    language_model = getattr(model, "language_model", model)
    return language_model if isinstance(language_model, module.LanguageModel) else None


# -- weight files ---------------------------------------------------------------


def hash_cache_path() -> Path:
    return config.state_dir() / "vault_cache-weights.json"


def _stat_key(stat):
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def _weight_files(directory: Path):
    names = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    for extra in ("model.safetensors.index.json", "config.json"):
        if (directory / extra).is_file():
            names.append(extra)
    return [directory / name for name in names]


def weights_fingerprint(directory: Path, stats=None, hash_missing=True) -> Tuple[Optional[str], Optional[Dict]]:
    """(hex digest, summary) of the weight files of a model directory.

    File digests are cached in the state folder keyed by real path and
    (size, mtime_ns, ctime_ns, inode, device): a file replaced or rewritten in
    place gets a new ctime, so it is hashed again. Without `hash_missing`,
    (None, None) where a file would have to be hashed.
    """
    files = _weight_files(directory)
    if not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    with _lock:
        try:
            remembered = json.loads(hash_cache_path().read_text())
            if not isinstance(remembered, dict):
                remembered = {}
        except (OSError, ValueError):
            remembered = {}
        keyed = []
        for path in files:
            real = os.path.realpath(path)
            stat = os.stat(real)
            entry = remembered.get(real)
            if not (isinstance(entry, dict) and entry.get("stat") == _stat_key(stat) and "sha256" in entry):
                entry = None
            keyed.append((path, real, stat, entry))
        todo = [(path, real) for path, real, _, entry in keyed if entry is None]
        if todo and not hash_missing:
            return None, None
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(todo), os.cpu_count() or 1))) as pool:
            fresh = dict(zip((real for _, real in todo), pool.map(_hash_file, (real for _, real in todo))))
        digest = hashlib.sha256()
        total = hashed = 0
        for path, real, stat, entry in keyed:
            if entry is None:
                entry = {"stat": _stat_key(stat), "sha256": fresh[real]}
                remembered[real] = entry
                hashed += stat.st_size
            total += stat.st_size
            digest.update(f"{path.name}\0{stat.st_size}\0{entry['sha256']}\n".encode())
            if stats is not None:
                stats.hit("weights_hashed" if real in fresh else "weights_cached")
        if todo:
            _remember(remembered)
    summary = {"files": len(files), "bytes": total, "hashed_bytes": hashed, "hashed_files": len(todo)}
    return digest.hexdigest(), summary


def _remember(remembered):
    path = hash_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}")
        temporary.write_text(json.dumps(remembered, sort_keys=True))
        os.replace(temporary, path)
    except OSError as exc:  # a read-only state folder only costs a rehash next time
        log.debug(f"vault_cache: could not remember weight digests: {exc!r}")


# -- what a load read ------------------------------------------------------------------


@dataclass
class Load:
    """One glm5_next load: its directory, its files' stat as the load began reading them,
    and why its weights cannot be pinned, if they cannot: (counter key, sentence)."""

    directory: Path
    files: Dict[str, list]
    problem: Optional[Tuple[str, str]] = None

    def changed(self) -> list:
        """Names of the files whose stat differs from the load's (or that came or went)."""
        now = _file_stats(self.directory, self.files)
        return sorted(Path(p).name for p in set(now) | set(self.files) if now.get(p) != self.files.get(p))


_loads: Dict[int, Tuple[weakref.ref, Load]] = {}  # kept across revert: they describe loads, not the patch


def _file_stats(directory: Path, extra=()) -> Dict[str, Optional[list]]:
    """{real path: stat key or None} of the files the key hashes, plus `extra` paths."""
    paths = {os.path.realpath(p) for p in _weight_files(directory)} | {os.path.realpath(p) for p in extra}
    stats = {}
    for real in paths:
        try:
            stats[real] = _stat_key(os.stat(real))
        except OSError:
            stats[real] = None
    return stats


def _loader_frame():
    """The frame of the `mlx_vlm.utils.load_model` call this code runs under, if any."""
    frame = sys._getframe(2)
    for _ in range(24):
        if frame is None:
            return None
        if frame.f_code.co_name == "load_model" and frame.f_globals.get("__name__") == "mlx_vlm.utils":
            return frame
        frame = frame.f_back
    return None


def _replaced_while_loading(paths) -> list:
    """Names of weight files that mlx-vlm holds open (``mx.load`` reads lazily, through the
    descriptor it opened) while the path now names another file: replaced after opening.
    Linux only (/proc/self/fd); elsewhere nothing is seen and the stat check alone applies."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    wanted = {os.path.realpath(p) for p in paths}
    held: Dict[str, set] = {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            name = target[:-len(" (deleted)")] if target.endswith(" (deleted)") else target
            if name in wanted:
                stat = os.stat(f"/proc/self/fd/{fd}")  # the open file, not the path
                held.setdefault(name, set()).add((stat.st_dev, stat.st_ino))
        except OSError:
            continue
    replaced = []
    for real, inodes in held.items():
        try:
            stat = os.stat(real)
            now = (stat.st_dev, stat.st_ino)
        except OSError:
            now = None
        if now not in inodes:
            replaced.append(Path(real).name)
    return sorted(replaced)


def observe_load(language_model):
    """Record what the `load_model` call now sanitizing `language_model`'s weights reads."""
    frame = _loader_frame()
    if frame is None:
        return None  # not loaded by mlx_vlm.utils.load_model: nothing is known of it
    found = frame.f_locals
    del frame
    if found.get("model_path") is None:
        return None
    directory = Path(found["model_path"])
    loaded = [Path(p) for p in found.get("weight_files") or ()]
    problem = None
    replaced = _replaced_while_loading(loaded)
    if replaced:
        problem = ("weights-changed", f"its weight files changed while this process loaded them "
                   f"({', '.join(replaced)} replaced)")
    elif found.get("lazy"):
        problem = ("lazy-load", "it was loaded lazily, so its weights are read after any check")
    elif (directory / "offload_index.json").exists():
        problem = ("offload", "its experts are read from disk while it runs (offload_index.json)")
    load = Load(directory, _file_stats(directory, loaded), problem)
    with _lock:
        for key in [key for key, (ref, _) in _loads.items() if ref() is None]:
            del _loads[key]  # models since freed (load_model also sanitizes with a throwaway one)
        _loads[id(language_model)] = (weakref.ref(language_model), load)
    return load


def known_load(language_model) -> Optional[Load]:
    with _lock:
        known = _loads.get(id(language_model))
        return known[1] if known is not None and known[0]() is language_model else None


def _unpinned(load: Optional[Load]) -> Optional[Tuple[str, str]]:
    """Why the weights `load` read are not (or no longer) what its files hold; None if they are."""
    if load is None:
        return ("load-not-seen", "its load was not seen (vault_cache was applied after the model was loaded)")
    if load.problem is not None:
        return load.problem
    changed = load.changed()
    if changed:
        return ("weights-changed", f"its weight files changed since this process loaded them ({', '.join(changed)})")
    return None


# -- layout -------------------------------------------------------------------------


def cache_layout(entry):
    """The shape of a cache tree, comparable with `sealed.metadata_layout`."""
    from mlx_vlm.models import cache as lm_cache

    if type(entry) is lm_cache.KVCache:
        return ("kv",)
    if type(entry) is lm_cache.ArraysCache:
        return ("arrays", len(entry.cache))
    if type(entry) is lm_cache.PoolingCache:
        return ("pooling", int(entry.ratio))
    if type(entry) is lm_cache.CacheList:
        return ("cache_list", tuple(cache_layout(child) for child in entry.caches))
    return ("other", f"{type(entry).__module__}:{type(entry).__qualname__}")


# -- the context of one loaded model ----------------------------------------------------


@dataclass
class VaultContext:
    static: str  # digest of everything but the numerics-changing patches
    directory: Optional[str]  # real path of the model directory, when persistent
    persistent: bool  # False: weights not pinned to files, entries stay in memory
    layout: tuple  # of make_cache(), what every entry must match
    weights: Optional[str] = None  # digest of the weight files, when persistent

    def origin(self):
        """What a sealed entry records of where it came from (for pruning stale entries)."""
        return {"model": self.directory, "weights": self.weights} if self.persistent else None

    def fingerprint(self) -> str:
        patches = registry.available()
        changing = sorted(name for name in registry.applied()
                          if getattr(patches.get(name), "numerics", "exact") != "exact")
        text = json.dumps({"static": self.static, "numerics_changing": changing}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def salt(self, fingerprint: Optional[str] = None) -> int:
        """The fingerprint as one of APC's integer key dependencies."""
        return int((fingerprint or self.fingerprint())[:16], 16) - (1 << 63)


_contexts: Dict[int, Tuple[weakref.ref, VaultContext]] = {}


def _config_text(language_model) -> str:
    cfg = getattr(language_model, "config", None)
    try:
        data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg))
    except Exception:
        data = repr(cfg)
    return json.dumps(data, sort_keys=True, default=repr)


def _versions():
    import mlx.core as mx

    try:
        from importlib.metadata import version

        mlx_vlm = version("mlx-vlm")
    except Exception:
        mlx_vlm = getattr(sys.modules.get("mlx_vlm"), "__version__", "unknown")
    return {"mlx": mx.__version__, "mlx_vlm": mlx_vlm, "device": str(mx.default_device().type)}


def context_for(language_model, stats=None) -> VaultContext:
    """The (cached) vault context of a loaded glm5_next language model."""
    with _lock:
        known = _contexts.get(id(language_model))
        if known is not None and known[0]() is language_model:
            return known[1]
        load = known_load(language_model)
        weights = summary = None
        problem = _unpinned(load)
        if problem is None:
            try:
                weights, summary = weights_fingerprint(load.directory, stats)
            except OSError as exc:
                problem = ("unreadable", f"its weight files cannot be fingerprinted ({exc!r})")
            else:
                problem = _unpinned(load)  # files changed while they were hashed
        if problem is not None:
            weights = summary = None
            where = load.directory if load is not None else "a model"
            log.warning(f"vault_cache: no disk vault for {where}: {problem[1]}; its prefix cache stays "
                        "in this process's memory (nothing read from or written to disk)")
            if stats is not None:
                stats.fallback(f"memory-only:{problem[0]}")
                stats.note(where, problem[1])
        static = json.dumps({
            "format": FORMAT,
            "weights": weights or f"process-{_PROCESS_NONCE}",
            "config": _config_text(language_model),
            **_versions(),
        }, sort_keys=True)
        context = VaultContext(
            static=hashlib.sha256(static.encode()).hexdigest(),
            directory=os.path.realpath(load.directory) if weights else None,
            persistent=weights is not None,
            layout=tuple(cache_layout(c) for c in language_model.make_cache()),
            weights=weights,
        )
        _contexts[id(language_model)] = (weakref.ref(language_model), context)
        if summary is not None:
            log.info(f"vault_cache: weights fingerprint {weights[:12]} for {load.directory} "
                     f"({summary['files']} files, {summary['bytes'] / 1e6:.1f} MB; hashed "
                     f"{summary['hashed_files']} files, {summary['hashed_bytes'] / 1e6:.1f} MB)")
        return context


def known_context(language_model) -> Optional[VaultContext]:
    with _lock:
        known = _contexts.get(id(language_model))
        return known[1] if known is not None and known[0]() is language_model else None


def forget():
    with _lock:
        _contexts.clear()

"""What a vault entry is keyed by: the fingerprint of the code and data that produced it.

fingerprint = SHA-256 over
  * the content of the model directory's weight files (``*.safetensors``,
    ``model.safetensors.index.json``) and ``config.json``, hashed once and
    remembered by (real path, size, mtime_ns, ctime_ns, inode), so a restart
    or a second server does not rehash;
  * the in-memory text config of the loaded model;
  * mlx and mlx-vlm versions, the default device type;
  * the names of the numerics-changing patches applied at the time.

The model directory is where the processor's tokenizer was loaded from
(``processor.tokenizer.name_or_path``; mlx-vlm loads both from the same
directory). Where no directory can be found the fingerprint is a per-process
nonce: entries then live in memory only and are never written to disk.
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


def weights_fingerprint(directory: Path, stats=None) -> Tuple[str, Dict]:
    """(hex digest, summary) of the weight files of a model directory.

    File digests are cached in the state folder keyed by real path and
    (size, mtime_ns, ctime_ns, inode, device): a file replaced or rewritten in
    place gets a new ctime, so it is hashed again.
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


def model_directory(processor) -> Optional[Path]:
    """The directory the model was loaded from, as recorded by its tokenizer."""
    for owner in (getattr(processor, "tokenizer", None), processor):
        name = getattr(owner, "name_or_path", None)
        if isinstance(name, (str, os.PathLike)) and name:
            directory = Path(name).expanduser()
            if (directory / "config.json").is_file():
                return directory
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
    directory: Optional[str]
    persistent: bool  # False: no weights directory, entries stay in memory
    layout: tuple  # of make_cache(), what every entry must match

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


def context_for(language_model, processor=None, stats=None) -> VaultContext:
    """The (cached) vault context of a loaded glm5_next language model."""
    with _lock:
        known = _contexts.get(id(language_model))
        if known is not None and known[0]() is language_model:
            return known[1]
        directory = model_directory(processor)
        weights, summary = None, None
        if directory is not None:
            try:
                weights, summary = weights_fingerprint(directory, stats)
            except OSError as exc:
                log.warning(f"vault_cache: cannot fingerprint the weights in {directory} ({exc!r}); "
                            "entries stay in memory")
                directory = None
        else:
            log.warning("vault_cache: the model directory is unknown (no tokenizer path); "
                        "entries stay in memory")
        static = json.dumps({
            "format": FORMAT,
            "weights": weights or f"process-{_PROCESS_NONCE}",
            "config": _config_text(language_model),
            **_versions(),
        }, sort_keys=True)
        context = VaultContext(
            static=hashlib.sha256(static.encode()).hexdigest(),
            directory=str(directory) if directory else None,
            persistent=weights is not None,
            layout=tuple(cache_layout(c) for c in language_model.make_cache()),
        )
        _contexts[id(language_model)] = (weakref.ref(language_model), context)
        if summary is not None:
            log.info(f"vault_cache: weights fingerprint {weights[:12]} for {directory} "
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

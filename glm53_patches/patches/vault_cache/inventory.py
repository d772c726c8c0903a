"""The vault's entries on disk: listed, kept under a budget, pruned.

APC's root (``APC_DISK_PATH``) holds one folder per namespace (mlx-vlm's server
names it after the model path and KV settings); the vault's entries are APC's
``exact_<id>.safetensors`` files there, sealed (``sealed.py``). Their file
mtime is APC's LRU clock: both loaders touch it on every read.

What stock APC already does, and the vault keeps: each ``DiskBlockStore``
evicts its own namespace by LRU under ``APC_DISK_MAX_GB``. What it misses, and
this module adds:

* entries of weights a model directory no longer holds can never hit again,
  yet they stay until that namespace fills up (``stale_entries``, used once
  per process and model by the hooks, and by ``prune --stale``);
* a namespace no server uses any more (a model moved, a new snapshot folder of
  a download, other KV settings) is never evicted at all, so the vault as a
  whole grows without bound (``evict_lru`` across all namespaces, after every
  sealed write, under ``GLM53_VAULT_CACHE_MAX_GB``);
* nothing lists or removes entries (``glm53-patches vault list|prune``).

Standard library only at import: the CLI builds its parsers on every call.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PREFIX, SUFFIX = "exact_", ".safetensors"  # DiskBlockStore.EXACT_PREFIX and SUFFIX
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass
class Entry:
    path: Path
    size: int
    last_used: float  # mtime, APC's LRU clock
    identity: tuple  # (st_dev, st_ino): only this very file is ever removed
    _metadata: Optional[dict] = field(default=None, repr=False)

    @property
    def metadata(self) -> dict:
        if self._metadata is None:
            from mlx_vlm import apc

            self._metadata = apc._read_safetensors_metadata(self.path) or {}
        return self._metadata

    @property
    def sealed(self) -> bool:
        from .sealed import FORMAT

        return self.metadata.get("vault_format") == FORMAT

    @property
    def origin(self) -> dict:
        """{"model": real path, "weights": digest} the entry was sealed with; {} if unrecorded."""
        try:
            origin = json.loads(self.metadata.get("vault_origin") or "{}")
        except ValueError:
            return {}
        return origin if isinstance(origin, dict) else {}

    @property
    def tokens(self) -> int:
        ids = self.metadata.get("token_ids") or ""
        return ids.count(",") + 1 if ids else 0


def scan(folders) -> list:
    """The exact-cache entries in `folders` (namespace folders), oldest use first."""
    found = []
    for folder in folders:
        for path in Path(folder).glob(f"{PREFIX}*{SUFFIX}"):
            try:
                stat = path.stat()
            except OSError:
                continue
            found.append(Entry(path, stat.st_size, stat.st_mtime, (stat.st_dev, stat.st_ino)))
    return sorted(found, key=lambda e: (e.last_used, str(e.path)))


def vault_folders(root: Path) -> list:
    """The namespace folders under `root` that the vault has written to (they hold its temporary folder)."""
    from .sealed import TMP_DIR

    try:
        return sorted(p for p in Path(root).iterdir() if (p / TMP_DIR).is_dir())
    except OSError:
        return []


def stale_entries(folder: Path, directory: str, weights: str) -> list:
    """Sealed entries in one namespace that were made from `directory` under other weights."""
    return [e for e in scan([folder]) if e.sealed and e.origin.get("model") == directory
            and e.origin.get("weights") not in (None, weights)]


def lru_excess(entries, budget: int, target: int, keep=()) -> list:
    """Sealed entries to remove, least recently used first, once `entries` total over `budget`
    bytes, until they total at most `target` (entries in `keep` stay)."""
    total = sum(e.size for e in entries)
    if total <= budget:
        return []
    chosen = []
    for entry in entries:  # oldest use first
        if total <= target:
            break
        if entry.path in keep or not entry.sealed:
            continue
        chosen.append(entry)
        total -= entry.size
    return chosen


def evict_lru(root: Path, budget: int, keep=(), low_watermark: float = 1.0) -> list:
    """Bound every namespace the vault writes to under `root`, together; returns what was removed."""
    entries = scan(vault_folders(root))
    return remove(lru_excess(entries, budget, int(budget * low_watermark), keep))


def remove(entries) -> list:
    """Delete each entry if its path still names the file that was scanned; the removed ones."""
    from .sealed import remove as remove_file

    return [e for e in entries if remove_file(e.path, e.identity)]


# -- glm53-patches vault list | prune ---------------------------------------------------


def add_parser(commands):
    vault = commands.add_parser("vault", help="list or prune vault_cache's entries on disk")
    actions = vault.add_subparsers(dest="vault_command", required=True)
    listing = actions.add_parser("list", help="every sealed entry: last use, size, tokens, whether its weights are current")
    prune = actions.add_parser("prune", help="remove stale, unused or least recently used entries")
    for parser in (listing, prune):
        parser.add_argument("--apc-dir", metavar="DIR", help="APC's root folder (default: APC_DISK_PATH, "
                            "else mlx-vlm's default, ~/.cache/mlx-vlm/apc)")
        parser.set_defaults(run=run)
    listing.add_argument("--json", action="store_true")
    prune.add_argument("--stale", action="store_true", help="entries whose model directory is gone or now holds "
                       "other weights (hashes weight files whose digests are not remembered)")
    prune.add_argument("--older-than", metavar="AGE", help="entries not used for AGE: 90s, 45m, 12h, 7d")
    prune.add_argument("--max-gb", metavar="GB", help="then the least recently used ones, until at most GB GiB remain")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


class _Bad(Exception):
    pass


def _age(value) -> float:
    text = value.strip().lower()
    try:
        seconds = float(text[:-1]) * _UNITS[text[-1]]
    except (KeyError, ValueError, IndexError):
        raise _Bad(f"--older-than {value!r} is not an age; accepted: a number and s, m, h or d (90s, 45m, 12h, 7d)")
    if not seconds >= 0:
        raise _Bad(f"--older-than {value!r} is negative; accepted: an age >= 0")
    return seconds


def parse_gib(value) -> float:
    """A size in GiB, >= 0: what GLM53_VAULT_CACHE_MAX_GB accepts (--max-gb too)."""
    from . import PATCH

    return PATCH.knobs["max_gb"].parse(str(value))


def _gb(value) -> int:
    try:
        return int(parse_gib(value) * (1 << 30))
    except ValueError:
        from . import PATCH

        raise _Bad(f"--max-gb {value!r} is not valid; accepted: {PATCH.knobs['max_gb'].accepted}") from None


def _root(args) -> Path:
    if args.apc_dir:
        root = Path(args.apc_dir).expanduser()
    elif os.environ.get("APC_DISK_PATH"):
        root = Path(os.environ["APC_DISK_PATH"]).expanduser()
    else:
        from mlx_vlm.apc import default_disk_path

        root = default_disk_path()
    if not root.is_dir():
        raise _Bad(f"no APC folder at {root} (give --apc-dir DIR or set APC_DISK_PATH)")
    return root


class _Weights:
    """Whether an entry's weights are still the ones in its model directory (one digest per directory)."""

    def __init__(self, hash_missing):
        self.hash_missing, self.digests = hash_missing, {}

    def state(self, entry) -> str:
        from . import keying

        model, weights = entry.origin.get("model"), entry.origin.get("weights")
        if not model or not weights:
            return "unrecorded"
        if model not in self.digests:
            try:
                self.digests[model] = keying.weights_fingerprint(Path(model), hash_missing=self.hash_missing)[0]
            except (OSError, FileNotFoundError):
                self.digests[model] = "gone"
        digest = self.digests[model]
        if digest == "gone":
            return "model gone"
        if digest is None:
            return "not hashed"
        return "current" if digest == weights else "stale"


def _when(seconds) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))


def run(args):
    try:
        root = _root(args)
        if args.vault_command == "list":
            return _list(root, args)
        older = _age(args.older_than) if args.older_than is not None else None
        budget = _gb(args.max_gb) if args.max_gb is not None else None
        if not (args.stale or older is not None or budget is not None):
            raise _Bad("prune needs at least one of --stale, --older-than AGE, --max-gb GB")
    except _Bad as exc:
        print(f"glm53-patches vault: {exc}", file=sys.stderr)
        return 2
    return _prune(root, args.stale, older, budget, args.dry_run)


def _entries(root):
    everything = scan(vault_folders(root))
    return [e for e in everything if e.sealed], len(everything)


def _list(root, args):
    entries, files = _entries(root)
    weights = _Weights(hash_missing=False)
    rows = [{"entry": f"{e.path.parent.name}/{e.path.name}", "path": str(e.path), "bytes": e.size,
             "last_used": e.last_used, "tokens": e.tokens, "model": e.origin.get("model"),
             "weights": weights.state(e)} for e in reversed(entries)]
    if args.json:
        print(json.dumps({"root": str(root), "entries": rows, "other_files": files - len(entries)}, indent=1))
        return 0
    total = sum(e.size for e in entries)
    print(f"{root}: {len(entries)} sealed entries, {total / 1e6:.1f} MB"
          + (f" ({files - len(entries)} other exact-cache files left out)" if files > len(entries) else ""))
    if rows:
        print(f"{'last used':16}  {'MB':>9}  {'tokens':>7}  {'weights':10}  entry (model)")
    for row in rows:
        print(f"{_when(row['last_used']):16}  {row['bytes'] / 1e6:9.1f}  {row['tokens']:7}  {row['weights']:10}  "
              f"{row['entry']} ({row['model'] or 'unrecorded'})")
    return 0


def _prune(root, stale, older, budget, dry_run):
    entries, _ = _entries(root)
    weights, now, why = _Weights(hash_missing=True), time.time(), {}
    for entry in entries:
        if stale and weights.state(entry) in ("stale", "model gone"):
            why[entry.path] = f"stale: {weights.state(entry)}"
        elif older is not None and now - entry.last_used > older:
            why[entry.path] = f"not used since {_when(entry.last_used)}"
    if budget is not None:
        left = [e for e in entries if e.path not in why]
        for entry in lru_excess(left, budget, budget):
            why[entry.path] = f"least recently used (last {_when(entry.last_used)})"
    chosen = [e for e in entries if e.path in why]
    removed = chosen if dry_run else remove(chosen)
    verb = "would remove" if dry_run else "removed"
    for entry in removed:
        print(f"{verb} {entry.path.parent.name}/{entry.path.name} ({entry.size / 1e6:.1f} MB; {why[entry.path]})")
    gone = {e.path for e in removed}
    kept = [e for e in entries if e.path not in gone]
    print(f"{verb} {len(removed)} entries ({sum(e.size for e in removed) / 1e6:.1f} MB); "
          f"kept {len(kept)} ({sum(e.size for e in kept) / 1e6:.1f} MB) in {root}")
    return 0

"""The replacements installed on mlx-vlm's APC, one factory per declared target.

Every replacement first asks whether the call belongs to a glm5_next model the
vault has keyed; if not it calls the object it wraps unchanged (stock APC for
every other model, and composable with other patches).

Prefill chunking: glm5_next runs chunks of at most ``DECODE_BLOCK_SIZE`` (8)
tokens through its decode path, whose bits differ from the prefill path; longer
chunks give the same bits wherever the prompt is split (measured; `verify`
checks a backend). ``APCCoordinator.checkpoint_lengths`` therefore drops
checkpoints that would create such short chunks, and a restore is accepted
only where the warm run's short chunks are exactly the cold run's.

Weights: ``LanguageModel.sanitize`` records each glm5_next load (``keying.observe_load``);
the fingerprint is taken at the first request only if the files are still the ones
that load read.

Scope of one request: ``APCCoordinator.lookup`` binds the model's vault
context to the calling thread; the SSD-tier reads beneath it
(``DiskBlockStore.find_exact_prefix`` / ``_load_exact_cache_file``) see it
there and verify. ``APCCoordinator.store_checkpoint`` applies the harvest
policy and leaves the entry's fingerprint and batch shape for the disk writer
(``_write_exact_cache_snapshot``), which may run on APC's writer thread.
"""

import functools
import json
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from pathlib import Path

from glm53_patches import config
from glm53_patches.log import once

from . import keying

log = logging.getLogger("glm53_patches.vault_cache")

NAME = "vault_cache"
DEFAULT_POLICY = "equal"
_STALE_TMP_S = 24 * 3600

_local = threading.local()
_lock = threading.RLock()
_pending: "OrderedDict[int, tuple]" = OrderedDict()  # entry key -> (fingerprint, persistent, harvest, origin)
_PENDING_MAX = 4096
_stores: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # DiskBlockStore -> state


def _stats():
    from . import PATCH

    return PATCH.stats


def _once(key, level, message):
    once(level, message, key=(NAME, key), logger=log)


def forget():
    """On revert: drop contexts, pending writes and per-store state."""
    keying.forget()
    with _lock:
        _pending.clear()
        _impure.clear()
        _stores.clear()




def harvest_policy():
    from . import PATCH

    return config.knob_value(NAME, "harvest", PATCH.knobs["harvest"], DEFAULT_POLICY)


def vault_budget(store):
    """GLM53_VAULT_CACHE_MAX_GB in bytes (default: APC_DISK_MAX_GB, the store's own cap); None: unbounded."""
    from . import PATCH

    default = store.max_bytes / (1 << 30) if store.max_bytes else 0.0
    return int(config.knob_value(NAME, "max_gb", PATCH.knobs["max_gb"], default) * (1 << 30)) or None


# -- the load ------------------------------------------------------------------------


def sanitize(original):
    @functools.wraps(original)
    def sanitize(self, weights):
        try:
            keying.observe_load(self)
        except Exception as exc:  # never break a load: an unrecorded load only loses the disk tier
            _once(("observe", repr(exc)), logging.ERROR, f"vault_cache: could not record this load ({exc!r})")
        return original(self, weights)

    return sanitize


def _context_of(model):
    language_model = keying.glm5_language_model(model)
    return keying.known_context(language_model) if language_model is not None else None


# -- key ---------------------------------------------------------------------------


def model_key_dependencies(original):
    if not _apc_enabled():
        _once("idle", logging.INFO, "vault_cache: APC_ENABLED is not set; the vault is idle until "
              "mlx-vlm's APC is enabled (APC_ENABLED=1, optional APC_DISK_PATH)")

    @functools.wraps(original)
    def model_key_dependencies(model=None, processor=None):
        deps = original(model, processor)
        language_model = keying.glm5_language_model(model)
        if language_model is None:
            return deps
        try:
            context = keying.context_for(language_model, _stats())
            salt = context.salt()
        except Exception as exc:  # fail closed: a key nobody else can produce
            _stats().fallback("error:fingerprint")
            _once(("fingerprint", repr(exc)), logging.ERROR,
                  f"vault_cache: cannot fingerprint the model ({exc!r}); prefix entries will not be shared")
            salt = int(keying._PROCESS_NONCE[:16], 16) - (1 << 63)
        return (*tuple(deps), salt)

    return model_key_dependencies


def _apc_enabled():
    return os.environ.get("APC_ENABLED", "0").strip().lower() in ("1", "true", "yes")


# -- prefill chunking ---------------------------------------------------------------------


def _short():
    from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

    return int(DECODE_BLOCK_SIZE)


def _step(coordinator):
    chunk = getattr(getattr(coordinator.manager, "memory_plan", None), "chunk_size", None)
    if chunk:
        return int(chunk)
    from mlx_vlm.generate.common import DEFAULT_PREFILL_STEP_SIZE

    return int(DEFAULT_PREFILL_STEP_SIZE)


def prefill_chunks(start, stops, end, step):
    """The [a, b) chunks mlx-vlm prefills from `start` to `end` (prompt length - 1),
    stopping at each of `stops` (generate_step and PromptProcessingBatch.prompt_step)."""
    chunks, at = [], start
    for stop in sorted({s for s in stops if start < s < end} | {end}):
        while at < stop:
            upto = min(at + step, stop) if step and step > 0 else stop
            chunks.append((at, upto))
            at = upto
    return chunks


def short_chunks(chunks, short):
    return {chunk for chunk in chunks if chunk[1] - chunk[0] <= short}


def keep_long_chunks(lengths, short, step):
    """Checkpoints without the ones that would cut a chunk of <= `short` tokens (the final stays)."""
    def bad(gap):
        return gap <= short or (step > 0 and gap > step and 0 < gap % step <= short)

    final, kept = max(lengths), []
    for length in sorted(set(lengths)):
        if length == final:
            while kept and bad(length - kept[-1]):
                kept.pop()
            kept.append(length)
        elif not bad(length - (kept[-1] if kept else 0)):
            kept.append(length)
    return kept


def _prefix_key(token_ids):
    import hashlib

    import numpy as np

    return len(token_ids), hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


_impure: "OrderedDict[tuple, None]" = OrderedDict()  # prefixes whose cold prefill has a short chunk


def checkpoint_lengths(original):
    @functools.wraps(original)
    def checkpoint_lengths(self, token_ids, media_token_ids):
        lengths = original(self, token_ids, media_token_ids)
        if not lengths or _context_of(self.model) is None:
            return lengths
        short, step = _short(), _step(self)
        kept = keep_long_chunks(lengths, short, step)
        cold = short_chunks(prefill_chunks(0, kept, len(token_ids) - 1, step), short)
        if cold:  # unavoidable (a remainder of the prefill step): never harvest past it
            first = min(b for _, b in cold)
            with _lock:
                for length in [*kept, len(token_ids)]:
                    if length >= first:
                        _impure[_prefix_key(list(token_ids[:length]))] = None
                while len(_impure) > _PENDING_MAX:
                    _impure.popitem(last=False)
        return kept

    return checkpoint_lengths


# -- lookup -----------------------------------------------------------------------------


class _Scope:
    """One lookup: the vault context, and which restored lengths keep warm == cold."""

    def __init__(self, coordinator, context, token_ids, kwargs):
        from mlx_vlm.apc import multimodal_token_ids_from_config

        self.context = context
        self.fingerprint = context.fingerprint()
        self.disk_bytes = None
        language_model = keying.glm5_language_model(coordinator.model)
        media = multimodal_token_ids_from_config(getattr(language_model, "config", None))
        has_media = kwargs.get("prefix_has_media")
        # The caller knows media tokens this model's text config does not name:
        # its checkpoints may differ from ours, so nothing is restored.
        self.unsure = bool(callable(has_media) and has_media(len(token_ids)) and not media)
        self.short, self.step = _short(), _step(coordinator)
        self.stops = coordinator.checkpoint_lengths(list(token_ids), media)
        self.end = len(token_ids) - 1
        self.cold = short_chunks(prefill_chunks(0, self.stops, self.end, self.step), self.short)

    def acceptable(self, prefix_len):
        """Does restoring `prefix_len` tokens leave exactly the cold run's short chunks?"""
        if self.unsure:
            return False
        warm = short_chunks(prefill_chunks(int(prefix_len), self.stops, self.end, self.step), self.short)
        return warm == self.cold and all(start >= prefix_len for start, _ in self.cold)


def lookup(original):
    @functools.wraps(original)
    def lookup(self, token_ids, *args, **kwargs):
        context = _context_of(self.model) if self.enabled else None
        if context is None:
            return original(self, token_ids, *args, **kwargs)
        scope, previous = _Scope(self, context, token_ids, kwargs), getattr(_local, "scope", None)
        _local.scope = scope
        try:
            hit = original(self, token_ids, *args, **kwargs)
        finally:
            _local.scope = previous
        stats = _stats()
        if hit is not None and not scope.acceptable(hit["prefix_len"]):  # a memory-tier entry
            self.release_hit(hit)
            stats.fallback("skipped:chunking")
            log.info(f"vault_cache: not restoring {hit['prefix_len']}/{len(token_ids)} tokens: the warm "
                     "prefill would be chunked unlike the cold one")
            hit = None
        if hit is None:
            stats.fallback("miss")
            log.info(f"vault_cache: miss ({len(token_ids)} prompt tokens)")
        elif scope.disk_bytes is not None:
            stats.hit("disk")
            log.info(f"vault_cache: hit {hit['prefix_len']}/{len(token_ids)} tokens from disk "
                     f"(verified, {scope.disk_bytes / 1e3:.0f} kB)")
        else:
            stats.hit("memory")
            log.info(f"vault_cache: hit {hit['prefix_len']}/{len(token_ids)} tokens from memory")
        return hit

    return lookup


# -- harvest ----------------------------------------------------------------------------


def _rows(state):
    if isinstance(state, (list, tuple)):
        for item in state:
            rows = _rows(item)
            if rows is not None:
                return rows
        return None
    shape = getattr(state, "shape", None)
    return int(shape[0]) if shape else None


def _leaves(entry):
    children = getattr(entry, "caches", None)
    if children is None:
        yield entry
    else:
        for child in children:
            yield from _leaves(child)


def _as_list(value):
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else None


def batch_shape(prompt_cache, batch_idx, tokens):
    """How the state being harvested was computed: rows, padding, equal suffixes."""
    rows = None
    for entry in prompt_cache:
        try:
            rows = _rows(entry.state)
        except Exception:
            rows = None
        if rows is not None:
            break
    shape = {"rows": rows or 1, "row": int(batch_idx or 0), "tokens": int(tokens)}
    if shape["rows"] == 1:
        shape["equal_suffix"] = True
        return shape
    paddings, offsets = [], []
    for entry in prompt_cache:
        for leaf in _leaves(entry):
            if not type(leaf).__name__.startswith("Batch"):
                continue
            padding = _as_list(getattr(leaf, "left_padding", None))
            offset = _as_list(getattr(leaf, "offset", None))
            if padding is not None:
                paddings.append(padding)
            if offset is not None:
                offsets.append(offset)
    shape["left_padding"] = paddings[0] if paddings else None
    shape["equal_suffix"] = bool(paddings) and all(not any(p) for p in paddings) and all(
        len(set(o)) == 1 for o in offsets
    )
    return shape


def _allowed(policy, shape):
    if policy == "any":
        return True
    if policy == "solo":
        return shape["rows"] == 1
    return shape["rows"] == 1 or shape["equal_suffix"]


def store_checkpoint(original):
    @functools.wraps(original)
    def store_checkpoint(self, token_ids, prompt_cache, *, extra_hash=0, batch_idx=None):
        context = _context_of(self.model) if self.enabled and self.is_checkpoint else None
        if context is None:
            return original(self, token_ids, prompt_cache, extra_hash=extra_hash, batch_idx=batch_idx)
        with _lock:
            impure = _prefix_key(list(token_ids)) in _impure
        if impure:
            _stats().fallback("skipped:short-chunk")
            return False
        shape = batch_shape(prompt_cache, batch_idx, len(token_ids))
        policy = harvest_policy()
        if not _allowed(policy, shape):
            _stats().fallback("skipped:batched-harvest")
            log.info(f"vault_cache: not harvesting {len(token_ids)} tokens from a batched prefill "
                     f"(rows {shape['rows']}, left padding {shape.get('left_padding')}; "
                     f"GLM53_VAULT_CACHE_HARVEST={policy})")
            return False
        if self.manager.disk is not None:
            from mlx_vlm import apc

            key = apc._sequence_hash(tuple(int(t) for t in token_ids), extra_hash, self.manager.block_size)
            with _lock:
                _pending[int(key)] = (context.fingerprint(), context.persistent, shape, context.origin())
                _pending.move_to_end(int(key))
                while len(_pending) > _PENDING_MAX:
                    _pending.popitem(last=False)
        return original(self, token_ids, prompt_cache, extra_hash=extra_hash, batch_idx=batch_idx)

    return store_checkpoint


# -- the SSD tier -------------------------------------------------------------------------


def _prepare(store):
    """Once per store: private folders, leftovers of killed writers, one summary line."""
    with _lock:
        state = _stores.get(store)
        if state is not None:
            return state
        state = _stores[store] = {"seen": None}
    from . import sealed

    directory = Path(store.dir)
    try:
        _private_root(directory.parent)
        sealed.private_dir(directory)
        temporary = sealed.private_dir(directory / sealed.TMP_DIR)
        removed = _remove_stale_temporaries(temporary)
    except OSError as exc:
        log.warning(f"vault_cache: cannot prepare {directory} ({exc!r})")
        return state
    entries = list(directory.glob(f"{store.EXACT_PREFIX}*{store.SUFFIX}"))
    size = sum(_size(p) for p in entries)
    cap = f"{store.max_bytes / (1 << 30):.3g} GiB (APC_DISK_MAX_GB)" if store.max_bytes else "uncapped"
    budget = vault_budget(store)
    cap += f", all namespaces {budget / (1 << 30):.3g} GiB (GLM53_VAULT_CACHE_MAX_GB)" if budget else ""
    log.info(f"vault_cache: vault at {directory} ({len(entries)} entries, {size / 1e6:.1f} MB, budget {cap}"
             + (f"; removed {removed} unfinished writes" if removed else "") + ")")
    return state


def _private_root(root: Path):
    """APC's root folder (APC_DISK_PATH), made 0o700 like the namespaces: stock APC creates it
    with the umask's mode before the vault runs. Left alone unless it is ours and holds only
    folders (APC's layout), so that a folder someone pointed APC_DISK_PATH at keeps its mode."""
    from . import sealed

    stat = root.stat()
    if stat.st_mode & 0o077 and stat.st_uid == os.getuid() and all(p.is_dir() for p in root.iterdir()):
        sealed.private_dir(root)
        log.info(f"vault_cache: made {root} private (0o700)")


def _size(path):
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remove_stale_temporaries(folder: Path) -> int:
    removed = 0
    for path in folder.iterdir():
        pid_part = path.name.split(".")[1] if path.name.count(".") >= 2 else ""
        try:
            pid = int(pid_part.split("-")[0])
        except ValueError:
            pid = None
        try:
            alive = pid is not None and (pid == os.getpid() or _alive(pid))
            if not alive or time.time() - path.stat().st_mtime > _STALE_TMP_S:
                path.unlink()
                removed += 1
        except OSError:
            continue
    return removed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refresh(store, state):
    """Index entries other processes published since we last looked; forget removed ones."""
    try:
        stat = os.stat(store.dir)
    except OSError:
        return
    seen = (stat.st_mtime_ns, stat.st_ino)
    if state.get("seen") == seen:
        return
    from mlx_vlm import apc

    files = [p for p in Path(store.dir).glob(f"*{store.SUFFIX}") if store._is_canonical_store_file(p)]
    with store._index_lock:
        indexed = set(store._exact_index.values())
        for path in files:
            if path in indexed or not store._is_canonical_exact(path):
                continue
            metadata = apc._read_safetensors_metadata(path)
            try:
                store._exact_index[int(metadata["cache_hash"])] = path
            except (TypeError, KeyError, ValueError):
                continue
        present = set(files)
        for cache_hash, path in list(store._exact_index.items()):
            if path not in present:
                del store._exact_index[cache_hash]
    store._disk_bytes = sum(_size(p) for p in files)
    _stats().set_bytes("on_disk", store._disk_bytes)
    state["seen"] = seen


def find_exact_prefix(original):
    @functools.wraps(original)
    def find_exact_prefix(self, token_ids, *args, **kwargs):
        scope = getattr(_local, "scope", None)
        if scope is None:
            return original(self, token_ids, *args, **kwargs)
        state = _prepare(self)
        _drop_stale(self, state, scope.context)
        _refresh(self, state)
        while True:  # the longest stored prefix whose restore keeps warm == cold
            found = original(self, token_ids, *args, **kwargs)
            if found is None or scope.acceptable(found[1]):
                return found
            _stats().fallback("skipped:chunking")
            if found[1] <= 1:
                return None
            kwargs["max_prefix_tokens"] = found[1] - 1

    return find_exact_prefix


def _account(store, removed, counter):
    """After entries were deleted: the store's index and byte count, the counters; their bytes."""
    stats = _stats()
    for entry in removed:
        if entry.path.parent == Path(store.dir):
            store._drop_index_for_path(entry.path)
            store._disk_bytes = max(0, store._disk_bytes - entry.size)
        stats.hit(counter)
        stats.add_bytes(counter, entry.size)
    return sum(entry.size for entry in removed)


def _drop_stale(store, state, context):
    """Once per store and weights: delete this namespace's entries of the same model directory
    sealed under other weights. They can never hit again: this process pinned the files there
    now, and the key of those entries named other content."""
    if not context.persistent:
        return
    done = state.setdefault("stale_checked", set())
    if (context.directory, context.weights) in done:
        return
    done.add((context.directory, context.weights))
    from . import inventory

    removed = inventory.remove(inventory.stale_entries(Path(store.dir), context.directory, context.weights))
    if removed:
        size = _account(store, removed, "pruned")
        log.info(f"vault_cache: removed {len(removed)} entries of earlier weights in {context.directory} "
                 f"({size / 1e6:.1f} MB)")


def _keep_budget(store, written):
    """After a write: LRU eviction across every namespace of the APC root (APC's own cap
    covers one namespace, so namespaces no server uses any more were never evicted)."""
    from . import inventory

    budget = vault_budget(store)
    if budget is None:
        return
    removed = inventory.evict_lru(Path(store.dir).parent, budget, keep={Path(written)},
                                  low_watermark=store._EVICT_LOW_WATERMARK)
    if removed:
        size = _account(store, removed, "evicted")
        log.info(f"vault_cache: evicted {len(removed)} least recently used entries ({size / 1e6:.1f} MB) "
                 f"to keep the vault under {budget / (1 << 30):.3g} GiB (GLM53_VAULT_CACHE_MAX_GB)")


def _take_pending(cache_hash):
    with _lock:
        return _pending.pop(int(cache_hash), None)


def write_exact_cache_snapshot(original):
    @functools.wraps(original)
    def _write_exact_cache_snapshot(self, path, snapshot):
        pending = _take_pending(snapshot.cache_hash)
        if pending is None:
            return original(self, path, snapshot)
        from . import sealed

        fingerprint, persistent, shape, origin = pending
        stats = _stats()
        if not persistent:
            stats.fallback("skipped:memory-only")
            return []
        _prepare(self)
        if not self._ensure_dir():
            raise OSError(f"APC disk cache directory unavailable: {self.dir}")

        def report(event, path, size, refusal=None, removed=False):
            stats.hit("write")
            stats.add_bytes("written", size)
            log.info(f"vault_cache: sealed {len(snapshot.token_ids)} tokens into {path.name} "
                     f"({size / 1e3:.0f} kB, batch {json.dumps(shape, sort_keys=True)})")

        try:
            written = sealed.write_exact_cache_snapshot(self, Path(path), snapshot, fingerprint=fingerprint,
                                                        harvest=shape, origin=origin, report=report)
        except Exception:
            stats.fallback("error:write")
            raise
        if written is None:  # not a glm5_next cache after all
            return original(self, path, snapshot)
        try:
            _keep_budget(self, path)
        except OSError as exc:  # the entry is written; the bound is kept at the next write
            _once(("budget", repr(exc)), logging.WARNING, f"vault_cache: could not keep the vault's bound ({exc!r})")
        stats.set_bytes("on_disk", self._disk_bytes)
        return written

    return _write_exact_cache_snapshot


def load_exact_cache_file(original):
    @functools.wraps(original)
    def _load_exact_cache_file(self, path, *, min_capacity_tokens, prefix_len=None):
        scope = getattr(_local, "scope", None)
        if scope is None:
            return original(self, path, min_capacity_tokens=min_capacity_tokens, prefix_len=prefix_len)
        from . import sealed

        _prepare(self)

        def report(event, path, size, refusal=None, removed=False):
            if event == "read":
                scope.disk_bytes = size
                _stats().add_bytes("read", size)
            elif event == "refused":
                _refused(self, path, refusal, removed)

        return sealed.load_exact_cache_file(self, Path(path), min_capacity_tokens=min_capacity_tokens,
                                            prefix_len=prefix_len, fingerprint=scope.fingerprint,
                                            layout=scope.context.layout, report=report)

    return _load_exact_cache_file


def _refused(store, path, refusal, removed):
    stats = _stats()
    stats.fallback(f"refused:{refusal.reason}")
    stats.add_bytes("refused", refusal.size)
    if removed:
        stats.set_bytes("on_disk", store._disk_bytes)
    _once(("refused", str(path), refusal.reason, refusal.identity), logging.WARNING,
          f"vault_cache: refused {path.name} ({refusal.reason}); "
          + ("removed it" if removed else "could not remove it") + "; the request runs cold")

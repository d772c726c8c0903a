"""Discovery of patches, and the journal that applies and reverts them.

Several patches may replace the same attribute. Each target keeps a chain:
the raw upstream object plus the factories of the patches applied to it, in
order. Applying or reverting any patch rebuilds the chain from the raw
object, so patches compose in any order and a full revert leaves exactly the
original object behind (`owner.__dict__[attr] is original`).
"""

import importlib
import importlib.metadata
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pluggy
import wrapt

from . import config, drift, hookspecs
from .log import forget as forget_said, log, once
from .patch import Patch

class PatchError(RuntimeError):
    """Raised in strict mode instead of logging and leaving stock code."""


_lock = threading.RLock()
_plugins: Optional[Dict[str, Patch]] = None
_load_errors: List[str] = []
_extra_plugins: List[object] = []
_chains: Dict[str, "_Chain"] = {}
_applied: Dict[str, Patch] = {}  # in apply order
_outcomes: Dict[str, Dict] = {}
_hook_errors: List[str] = []
_requested: set = set()  # what this process asked for: GLM53_* at start-up, or enable()
_config_errors: List[str] = []  # why GLM53_* applied nothing here


# -- discovery -------------------------------------------------------------


def register_plugin(plugin) -> None:
    """Add an in-process plugin (an object or module with a `glm53_patches` hookimpl)."""
    global _plugins
    with _lock:
        _extra_plugins.append(plugin)
        _plugins = None


def available() -> Dict[str, Patch]:
    """Every patch the installed plugins provide, by name (cached)."""
    global _plugins
    with _lock:
        if _plugins is not None:
            return _plugins
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        _load_errors.clear()
        for entry in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            try:
                manager.register(entry.load(), name=f"entry-point:{entry.name}")
            except Exception as exc:  # a broken plugin must not break the others
                _load_errors.append(f"plugin {entry.name!r} failed to load: {exc!r}")
                log.warning(_load_errors[-1])
        for plugin in _extra_plugins:
            if manager.is_registered(plugin) is False:
                manager.register(plugin)
        found: Dict[str, Patch] = {}
        for patches in manager.hook.glm53_patches():
            for patch in patches:
                if patch.name in found and found[patch.name] is not patch:
                    _load_errors.append(f"two plugins provide a patch named {patch.name!r}; kept the first")
                    log.warning(_load_errors[-1])
                    continue
                found[patch.name] = patch
        _plugins = dict(sorted(found.items()))
        return _plugins


# -- apply / revert ----------------------------------------------------------


@dataclass
class _Chain:
    owner: object
    attr: str
    original: object  # the raw upstream object, from __dict__ along the MRO
    owned: bool  # did the owner itself define attr (else it came from a base)
    layers: List = field(default_factory=list)  # [(patch name, factory)], in apply order

    def install(self):
        if not self.layers:
            if self.owned:
                setattr(self.owner, self.attr, self.original)
            elif self.attr in vars(self.owner):
                delattr(self.owner, self.attr)
            return
        current = self.original
        for _, factory in _inside_out(self.layers):
            current = factory(current)
        setattr(self.owner, self.attr, current)


def _inside_out(layers):
    """The layers innermost first: a patch that declares it `runs_before` another wraps it,
    whatever order they were applied in; otherwise the later applied is outside."""
    names = [name for name, _ in layers]
    depth = {}

    def depth_of(name):
        if name not in depth:
            depth[name] = 0  # a cycle (a declaration error) ends here instead of recursing forever
            inner = [d for d in _patch_of(name).runs_before if d in names and d != name]
            depth[name] = 1 + max(map(depth_of, inner)) if inner else 0
        return depth[name]

    return sorted(layers, key=lambda layer: (depth_of(layer[0]), names.index(layer[0])))


def _patch_of(name):
    return _applied.get(name) or available()[name]


def _chain(target: str) -> _Chain:
    if target not in _chains:
        module, qualname = drift.split_target(target)
        importlib.import_module(module)
        owner, attr, _ = wrapt.resolve_path(module, qualname)
        if isinstance(owner, type):
            holder = next(k for k in owner.__mro__ if attr in vars(k))
            original = vars(holder)[attr]
        else:
            original = vars(owner)[attr]
        _chains[target] = _Chain(owner, attr, original, attr in vars(owner))
    return _chains[target]


def upstream(target: str):
    """The unpatched upstream object at ``target``, whatever patches are applied now."""
    with _lock:
        return _chain(target).original


def _record(name: str, state: str, reason: str = "", **extra):
    _outcomes[name] = {"state": state, "reason": reason, **extra}
    _publish()


def _refuse(name: str, state: str, reason: str, strict: bool, **extra):
    _record(name, state, reason, **extra)
    message = f"{name}: {state}, stock code left running ({reason})"
    if strict:
        raise PatchError(message)
    log.warning(message)


def apply(names, *, force=(), strict: bool = False) -> Dict[str, Dict]:
    """Apply the named patches (idempotent, all-or-nothing per patch)."""
    with _lock:
        patches = available()
        _requested.update(names)
        for name in names:
            if name in _applied:
                continue
            patch = patches.get(name)
            if patch is None:
                _refuse(name, "unknown", "no installed plugin provides it", strict)
                continue
            problems = drift.check_patch(patch)
            if problems and name not in force:
                _refuse(name, "drift", drift.summary(problems), strict, drift=problems)
                continue
            done = []
            try:
                for target, factory in patch.targets.items():
                    chain = _chain(target)
                    chain.layers.append((name, factory))
                    done.append(chain)
                    chain.install()
            except Exception as exc:
                for chain in done:
                    chain.layers = [layer for layer in chain.layers if layer[0] != name]
                    chain.install()
                _refuse(name, "error", f"could not install: {exc!r}", strict)
                continue
            _applied[name] = patch
            forced = bool(problems)
            _record(name, "applied", "forced despite drift" if forced else "", forced=forced)
            log.info(f"{name}: applied ({', '.join(patch.targets)})" + (" [forced despite drift]" if forced else ""))
        return status()["patches"]


def revert(names=None) -> None:
    """Revert the named patches (default: all), restoring the very same objects."""
    with _lock:
        names = list(_applied) if names is None else [n for n in names if n in _applied]
        for name in reversed(names):
            patch = _applied.pop(name)
            for target in patch.targets:
                chain = _chains[target]
                chain.layers = [layer for layer in chain.layers if layer[0] != name]
                chain.install()
                if not chain.layers:
                    del _chains[target]
            if patch.on_revert is not None:
                patch.on_revert()
            _record(name, "reverted")
            log.info(f"{name}: reverted")
        forget_said()  # a patch applied again says its one-time lines again


def applied() -> List[str]:
    with _lock:
        return list(_applied)


# -- environment --------------------------------------------------------------


def covered_by_all(patch: Patch) -> bool:
    """GLM53_PATCHES=all turns on exact patches whose kernels were verified here."""
    if patch.numerics != "exact" or not patch.in_all:
        return False
    here = backend()
    if here not in patch.needs_verify_on:
        return True
    from . import verify_records

    return verify_records.passed(patch.name, here)


def from_environment(environ=None) -> Dict[str, Dict]:
    """Apply what the GLM53_* variables ask for. Bad values apply nothing."""
    with _lock:
        settings = config.read(environ)
        patches = available()
        knob_errors, warnings = config.knob_problems(patches, environ)
        problem = config.state_dir_problem(environ)
        for warning in warnings + ([problem] if problem else []):
            once(logging.WARNING, warning)
        errors = settings.errors + config.unknown_name_errors(settings, patches) + knob_errors
        if errors:
            message = "; ".join(errors)
            if settings.strict:
                raise PatchError(message)
            log.error(message + " -- no patch applied, stock code running")
            _config_errors[:] = errors
            for name in patches:
                _outcomes.setdefault(name, {"state": "not applied", "reason": "configuration error"})
            _publish()
            return status()["patches"]
        wanted = [n for n, p in patches.items() if settings.wants(n, covered_by_all(p))]
        for name, patch in patches.items():
            if name not in wanted and name not in _applied:
                _outcomes.setdefault(name, {"state": "not requested", "reason": _why_not(settings, patch)})
        return apply(wanted, force=settings.force, strict=settings.strict)


def _why_not(settings, patch):
    if settings.overrides.get(patch.name) is False:
        return f"{patch.env_var}=0"
    if settings.requested == "all" and not covered_by_all(patch):
        if not patch.in_all:
            return "a trade-off, not part of 'all': enable it by name"
        if patch.numerics != "exact":
            return "numerics-changing: not part of 'all'; enable it by name"
        return f"kernels not verified on {backend()} here: run `glm53-patches verify {patch.name}` or enable it by name"
    return f"not named in {config.PATCHES}"


def note_hook_error(message: str) -> None:
    with _lock:
        _hook_errors.append(message)
        _publish()


# -- status -----------------------------------------------------------------


def backend() -> str:
    from .backend import current

    return current()


def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def status() -> Dict:
    """This process's view: versions, and per patch its state and counters."""
    with _lock:
        patches = available()
        report = {}
        for name, patch in patches.items():
            entry = {
                "requested": name in _requested,
                "applied": name in _applied,
                "state": "not requested",
                "reason": "",
                "numerics": patch.numerics,
                "targets": list(patch.targets),
                "stats": patch.stats.snapshot(),
            }
            if patch.report is not None and name in _applied:  # a report describes what runs
                entry["detail"] = patch.report()
            entry.update(_outcomes.get(name, {}))
            report[name] = entry
        return {
            "pid": os.getpid(),
            "argv": sys.argv,
            "mlx": _version("mlx"),
            "mlx_vlm": _version("mlx-vlm"),
            "backend": backend() if "mlx.core" in sys.modules else None,
            "plugin_errors": list(_load_errors),
            "hook_errors": list(_hook_errors),
            "configuration_errors": list(_config_errors),
            "patches": report,
        }


_flusher: Optional[threading.Thread] = None


def _publish():
    """Write this process's status where `glm53-patches status` reads it."""
    global _flusher
    try:
        folder = config.ensure_state_dir()
        path = folder / f"{os.getpid()}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(status(), default=str))
        os.replace(temporary, path)
    except OSError as exc:
        log.debug(f"could not publish status: {exc!r}")
        return
    if _flusher is None:  # keep the published hit counters fresh
        _flusher = threading.Thread(target=_flush_forever, name="glm53-status", daemon=True)
        _flusher.start()


def _flush_forever(period: float = 1.0):
    last = None
    while True:
        time.sleep(period)
        with _lock:
            current = {n: p.stats.snapshot() for n, p in (_plugins or {}).items()}
            if current != last:
                last = current
                _publish()

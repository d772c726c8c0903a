"""Every GLM53_* environment variable, parsed in one place.

A bad value never raises here: it becomes an error message that names the
variable, the value and what is accepted. The registry decides whether to
raise (strict mode) or log one line and leave the stock code running.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Mapping, Optional, Union

PREFIX = "GLM53_"
PATCHES = "GLM53_PATCHES"
STRICT = "GLM53_PATCHES_STRICT"
FORCE = "GLM53_PATCHES_FORCE"
STATE_DIR = "GLM53_PATCHES_STATE_DIR"
PER_PATCH = "GLM53_PATCH_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_ACCEPTED = "1 or 0 (also true/false, yes/no, on/off)"


def parse_bool(name: str, value: str):
    """Return (bool, None) or (None, error message)."""
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True, None
    if lowered in _FALSE:
        return False, None
    return None, f"{name}={value!r} is not valid; accepted: {BOOL_ACCEPTED}"


def _names(value: str) -> List[str]:
    return [part.strip().lower() for part in value.split(",") if part.strip()]


@dataclass
class Settings:
    requested: Union[str, FrozenSet[str]] = "none"  # "all", "none" or a set of names
    overrides: Dict[str, bool] = field(default_factory=dict)  # GLM53_PATCH_<NAME>
    strict: bool = False
    force: FrozenSet[str] = frozenset()
    errors: List[str] = field(default_factory=list)

    def named(self) -> FrozenSet[str]:
        """Every patch name the user wrote anywhere (to check they exist)."""
        names = set(self.overrides) | set(self.force)
        if isinstance(self.requested, frozenset):
            names |= self.requested
        return frozenset(names)

    def wants(self, name: str, in_all: bool) -> bool:
        """Is `name` requested? `in_all`: whether GLM53_PATCHES=all covers it."""
        if name in self.overrides:
            return self.overrides[name]
        if self.requested == "all":
            return in_all or name in self.force
        if self.requested == "none":
            return False
        return name in self.requested


def any_set(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return any(key.startswith(PREFIX) for key in environ)


def read(environ: Optional[Mapping[str, str]] = None) -> Settings:
    environ = os.environ if environ is None else environ
    settings = Settings()
    raw = environ.get(PATCHES)
    if raw is not None:
        lowered = raw.strip().lower()
        if lowered in ("all", "none", ""):
            settings.requested = lowered or "none"
        else:
            settings.requested = frozenset(_names(raw))
    if STRICT in environ:
        strict, error = parse_bool(STRICT, environ[STRICT])
        settings.strict = bool(strict)
        if error:
            settings.errors.append(error)
    if FORCE in environ:
        settings.force = frozenset(_names(environ[FORCE]))
    for key, value in environ.items():
        if key.startswith(PER_PATCH):
            name = key[len(PER_PATCH):].lower()
            enabled, error = parse_bool(key, value)
            if error:
                settings.errors.append(error)
            else:
                settings.overrides[name] = enabled
    return settings


def unknown_name_errors(settings: Settings, known) -> List[str]:
    """Errors for every patch name the user wrote that no plugin provides."""
    accepted = ", ".join(sorted(known)) or "(no patches installed)"
    errors = []
    if isinstance(settings.requested, frozenset):
        for name in sorted(settings.requested - set(known)):
            errors.append(
                f"{PATCHES}: unknown patch {name!r}; accepted: all, none, or a "
                f"comma-separated list of: {accepted}"
            )
    for name in sorted(set(settings.overrides) - set(known)):
        errors.append(
            f"{PER_PATCH}{name.upper()}: no patch named {name!r}; patches: {accepted}"
        )
    for name in sorted(settings.force - set(known)):
        errors.append(f"{FORCE}: unknown patch {name!r}; accepted: {accepted}")
    return errors


def knob(patch: str, knob_name: str, parse, default, environ=None):
    """A patch-specific knob GLM53_<PATCH>_<KNOB>; returns (value, error)."""
    environ = os.environ if environ is None else environ
    name = f"{PREFIX}{patch.upper()}_{knob_name.upper()}"
    if name not in environ:
        return default, None
    try:
        return parse(environ[name]), None
    except ValueError as exc:
        return default, f"{name}={environ[name]!r} is not valid: {exc}"


def state_dir(environ=None) -> Path:
    """Where running processes publish what they applied (read by `status`)."""
    environ = os.environ if environ is None else environ
    if environ.get(STATE_DIR):
        return Path(environ[STATE_DIR])
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "glm53-patches"

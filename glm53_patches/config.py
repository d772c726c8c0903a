"""Every GLM53_* environment variable, parsed in one place, with one vocabulary.

A bad value never raises here: it becomes an error message that names the
variable, the value and what is accepted. The registry decides whether to
raise (strict mode) or log one line and leave the stock code running.

Every on/off setting accepts the same words (``BOOL_ACCEPTED``); a setting
that can also defer to ``verify`` accepts ``auto`` besides. Patch-specific
settings are declared by their patch (``Patch.knobs``: name -> ``Knob``), so
a bad value is caught at start-up, before anything is applied.
"""

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

PREFIX = "GLM53_"
PATCHES = "GLM53_PATCHES"
STRICT = "GLM53_PATCHES_STRICT"
FORCE = "GLM53_PATCHES_FORCE"
STATE_DIR = "GLM53_PATCHES_STATE_DIR"
PER_PATCH = "GLM53_PATCH_"
GLOBAL = (PATCHES, STRICT, FORCE, STATE_DIR)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_ACCEPTED = "1 or 0 (also true/false, yes/no, on/off)"
SWITCH_ACCEPTED = "auto (where `glm53-patches verify` passed), or 1 or 0 (also true/false, yes/no, on/off)"


# -- patch-specific settings ------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    """One setting of a patch: GLM53_<PATCH>_<NAME>. ``parse`` raises ValueError on a bad value."""

    parse: Callable[[str], Any]
    accepted: str  # what an error message lists
    doc: str = ""  # what it does and its default, for `list`, README and entry_points.toml
    brief: str = ""  # the accepted values in a few words, for README's table (default: ``accepted``)

    def read(self, variable: str, text: str):
        """(value, None) or (None, an error naming the variable, the value and what is accepted)."""
        try:
            return self.parse(text), None
        except ValueError:
            return None, f"{variable}={text!r} is not valid; accepted: {self.accepted}"


def flag(doc: str = "") -> Knob:
    """On or off, in the one vocabulary."""

    def parse(text):
        lowered = text.strip().lower()
        if lowered not in _TRUE + _FALSE:
            raise ValueError(text)
        return lowered in _TRUE

    return Knob(parse, BOOL_ACCEPTED, doc, "`1` / `0`")


def switch(doc: str = "") -> Knob:
    """``auto`` (None: where `verify` passed), or on (True) / off (False)."""
    on_off = flag()

    def parse(text):
        return None if text.strip().lower() == "auto" else on_off.parse(text)

    return Knob(parse, SWITCH_ACCEPTED, doc, "`auto`, `1` / `0`")


def integer(minimum: int = 1, maximum: Optional[int] = None, what: str = "", doc: str = "") -> Knob:
    """A whole number in [minimum, maximum]."""

    def parse(text):
        text = text.strip()
        if not text.isdigit() or int(text) < minimum or (maximum is not None and int(text) > maximum):
            raise ValueError(text)
        return int(text)

    bound = f"from {minimum} to {maximum}" if maximum is not None else f"{minimum} or more"
    return Knob(parse, f"a whole number{' of ' + what if what else ''}, {bound}", doc)


def number(minimum: float = 0.0, what: str = "", doc: str = "") -> Knob:
    """A finite number >= minimum."""

    def parse(text):
        value = float(text)  # ValueError for a non-number
        if not minimum <= value < float("inf"):
            raise ValueError(text)
        return value

    return Knob(parse, f"a number{' of ' + what if what else ''}, {minimum:g} or more", doc)


def choice(*values, doc: str = "") -> Knob:
    """One of ``values`` (strings compare lowercased; integers by value)."""

    def parse(text):
        lowered = text.strip().lower()
        for value in values:
            if lowered == str(value).lower():
                return value
        raise ValueError(text)

    return Knob(parse, "one of " + ", ".join(map(str, values)), doc, ", ".join(f"`{v}`" for v in values))


def knob_variable(patch: str, name: str) -> str:
    return f"{PREFIX}{patch.upper()}_{name.upper()}"


FLAG = flag()


def parse_bool(name: str, value: str):
    """Return (bool, None) or (None, error message)."""
    return FLAG.read(name, value)


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


def knob(patch: str, name: str, spec: Knob, default, environ=None):
    """(value, error) of GLM53_<PATCH>_<NAME>: the default when it is unset or bad."""
    environ = os.environ if environ is None else environ
    variable = knob_variable(patch, name)
    if variable not in environ:
        return default, None
    value, error = spec.read(variable, environ[variable])
    return (default, error) if error else (value, None)


def knob_value(patch: str, name: str, spec: Knob, default):
    """The knob's value; a bad one is logged once, naming it, and the default used.

    Start-up refuses bad values before anything is applied (``knob_problems``);
    this covers a script's ``enable()`` and a variable changed later.
    """
    value, error = knob(patch, name, spec, default)
    if error:
        from .log import once

        once(logging.ERROR, f"{patch}: {error}; using {default}")
    return value


class CachedKnob:
    """A patch's knob read on first use and kept: ``knob()`` is its value; ``clear()`` reads it again
    next time; setting ``value`` overrides it (checks and benchmarks that force a threshold)."""

    def __init__(self, patch, name: str, default):
        self.patch, self.name, self.default = patch, name, default
        self.value = None

    def __call__(self):
        if self.value is None:
            self.value = knob_value(self.patch.name, self.name, self.patch.knobs[self.name], self.default)
        return self.value

    def clear(self):
        self.value = None


def knob_problems(patches, environ=None) -> Tuple[List[str], List[str]]:
    """(errors, warnings) for every GLM53_* variable: bad values of declared knobs, unknown names.

    ``patches``: name -> Patch (its ``knobs``). A variable that is neither a
    global one, a GLM53_PATCH_<NAME> switch nor a declared knob is a warning
    (a typo would otherwise be ignored in silence).
    """
    environ = os.environ if environ is None else environ
    errors, known = [], set(GLOBAL)
    for name, patch in sorted(patches.items()):
        for knob_name, spec in sorted(getattr(patch, "knobs", {}).items()):
            variable = knob_variable(name, knob_name)
            known.add(variable)
            if variable in environ:
                error = spec.read(variable, environ[variable])[1]
                if error:
                    errors.append(error)
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known and not k.startswith(PER_PATCH))
    warnings = [f"{k} is not a variable of any installed patch; ignored (`glm53-patches list` shows each "
                "patch's variables)" for k in unknown]
    return errors, warnings


def state_dir(environ=None) -> Path:
    """Where running processes publish what they applied (read by `status`)."""
    environ = os.environ if environ is None else environ
    if environ.get(STATE_DIR):
        return Path(environ[STATE_DIR]).expanduser()
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "glm53-patches"


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) for this user only (0700); tighten it if it is ours and looser.

    Raises OSError (e.g. NotADirectoryError) when it cannot be a folder.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(str(path))
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        path.chmod(0o700)
    return path


def ensure_state_dir(environ=None) -> Path:
    return private_dir(state_dir(environ))


def state_dir_problem(environ=None) -> Optional[str]:
    """None, or one line saying why the state folder cannot be used (and what that costs)."""
    folder = state_dir(environ)
    try:
        private_dir(folder)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return (f"{STATE_DIR}: the state folder {str(folder)!r} is not a writable folder ({exc.strerror or exc}); "
                "processes do not show in `glm53-patches status` and verify records cannot be read, so "
                "GLM53_PATCHES=all leaves out every patch that needs one; accepted: a writable folder")
    return None

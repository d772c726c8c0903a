"""The Patch type: everything about one patch is declared data."""

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from .config import Knob
from .stats import Stats

GLM5_NEXT = "mlx_vlm.models.glm5_next.language"


def lazy(module: str, name: str, *, only_if_loaded: bool = False):
    """A function that imports `module` on first call and calls its `name`.

    Patch plugins declare their factories, checks and revert hooks this way, so
    that discovering a plugin imports neither mlx nor mlx-vlm. With
    `only_if_loaded`, the call does nothing when the module was never imported
    (nothing to drop on revert).
    """

    def call(*args, **kwargs):
        if only_if_loaded and module not in sys.modules:
            return None
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"lazy:{module}.{name}"
    return call


@dataclass(eq=False)
class Patch:
    """One opt-in change to upstream objects.

    ``targets`` maps ``"module:Owner.attr"`` to a factory that receives the
    object currently installed there (the upstream original, or another
    patch's wrapper) and returns its replacement. Factories must call the
    object they were given when they step aside, so that patches compose.
    ``relies_on`` names upstream objects the patch does not replace but whose
    behaviour it assumes; the drift guard fingerprints both.
    """

    name: str
    summary: str
    targets: Dict[str, Callable[[object], object]]
    relies_on: Tuple[str, ...] = ()
    numerics: str = "exact"  # "exact" or "changing"
    # Backends where GLM53_PATCHES=all includes it only once `glm53-patches verify` passed on this
    # machine: where its own kernels run, or where a compile or library may round differently.
    needs_verify_on: Tuple[str, ...] = ()
    kernels_on: Tuple[str, ...] = ()  # backends with hand-written kernels (mx.fast.cuda_kernel / metal_kernel)
    upstream: str = "not yet proposed"
    in_all: bool = True  # False: a trade-off that GLM53_PATCHES=all must not make for the user
    # On a target it shares with these patches, this one is called first (it wraps theirs and hands
    # them what it does not take), whatever the order in which they were applied.
    runs_before: Tuple[str, ...] = ()
    # True: its targets change only calls of more than one token (prefill) and hand a decode step's
    # single token on untouched, so a patch that traces whole decode steps (layer_decode) may run
    # around it. Any other patch on the code a step runs makes layer_decode step aside, unless it is
    # one layer_decode composes by name.
    prefill_only: bool = False
    # Modules (or packages) outside its own folder whose code it runs: with its folder they make the
    # code digest a `verify` record is keyed by, so an edit there voids the record (and nothing else does).
    uses: Tuple[str, ...] = ()
    on_revert: Optional[Callable[[], None]] = None  # drop compiled functions and state
    # Exactness check run by `glm53-patches verify` on this machine's backend:
    # () -> {"exact": bool, "max_abs_diff": float, "cases": int, "detail": str}
    verify: Optional[Callable[[], Dict]] = None
    report: Optional[Callable[[], str]] = None  # extra detail for `status`
    # Its settings, GLM53_<NAME>_<KNOB>: checked at start-up (a bad value applies nothing).
    knobs: Dict[str, Knob] = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    # The module that declares it (default: where ``Patch(...)`` is written), and the file of
    # upstream fingerprints it was verified against (default: fingerprints.json beside that module).
    package: str = ""
    fingerprints_file: Optional[str] = None

    def __post_init__(self):
        if not self.package:  # frames: __post_init__, the dataclass __init__, the declaring module
            self.package = sys._getframe(2).f_globals.get("__name__", "")

    @property
    def env_var(self):
        return f"GLM53_PATCH_{self.name.upper()}"

    def folder(self) -> Path:
        """The folder of the declaring package (or of the declaring module's file)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise LookupError(f"patch {self.name!r}: cannot locate its module {self.package!r}")
        return Path(spec.origin).parent

    def source_files(self):
        """(label, path) of every Python file of its folder and of what it `uses`, sorted by label."""
        files = {}
        roots = [(self.package, self.folder(), True)]
        for module in self.uses:
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise LookupError(f"patch {self.name!r} uses {module!r}, which cannot be found")
            roots.append((module, Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin),
                          bool(spec.submodule_search_locations)))
        for label, root, is_folder in roots:
            for path in sorted(root.rglob("*.py")) if is_folder else [root]:
                if "__pycache__" not in path.parts:
                    relative = path.relative_to(root).as_posix() if is_folder else path.name
                    files[f"{label}:{relative}"] = path
        return sorted(files.items())

    def fingerprints_path(self) -> Path:
        return Path(self.fingerprints_file) if self.fingerprints_file else self.folder() / "fingerprints.json"  # drift.FILE_NAME

    def all_fingerprinted(self):
        return tuple(self.targets) + tuple(self.relies_on)

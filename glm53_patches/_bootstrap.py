"""Run by the glm53_patches .pth line when a GLM53_* variable is set.

Standard library only, and it never raises: a broken install, a bad value or
a broken upstream must not print a traceback into every Python process. It
costs a Python start almost nothing: it puts one finder on ``sys.meta_path``
and imports nothing else (no importlib.metadata, wrapt, pluggy or mlx). The
patches themselves are applied right after mlx-vlm has imported the module
that defines the glm5_next classes.
"""

import sys

TRIGGER = "mlx_vlm.models.glm5_next.language"
COMMAND_BUFFERS = None  # what the command_buffers patch set, for `status`


def _apply_on_import(_module):
    try:
        from glm53_patches import registry
    except Exception as exc:  # pragma: no cover - a broken install
        print(f"glm53-patches ERROR: cannot load the registry ({exc!r}); stock code running", file=sys.stderr)
        return
    try:
        registry.from_environment()
    except registry.PatchError:
        raise  # GLM53_PATCHES_STRICT=1 asked for it
    except Exception as exc:
        registry.log.error(f"applying patches failed ({exc!r}); stock code running")
        registry.note_hook_error(repr(exc))


class _Loader:
    """The trigger module's own loader, with ``_apply_on_import`` run once its code has run."""

    def __init__(self, loader, finder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self._loader  # hide this wrapper from now on
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)  # fire once; a failed import above keeps it for a retry
        _apply_on_import(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._loader, name)


class PostImportFinder:
    """On ``sys.meta_path``: finds nothing itself, but wraps the loader of ``TRIGGER``."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER or self._busy:
            return None
        self._busy = True
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self)
        return spec


def _command_buffers():
    """Set Metal buffer limits now: mlx reads them once, at import."""
    global COMMAND_BUFFERS
    import os

    lists = (os.environ.get("GLM53_PATCHES", "") + "," + os.environ.get("GLM53_PATCHES_FORCE", "")).lower()
    if "command_buffers" not in lists and "GLM53_PATCH_COMMAND_BUFFERS" not in os.environ:
        COMMAND_BUFFERS = "not requested in this process (nothing set)"
        return  # named nowhere (`all` leaves it out): the parser need not even load
    from glm53_patches import config

    settings = config.read()
    if not settings.wants("command_buffers", in_all=False):
        COMMAND_BUFFERS = "not requested in this process (nothing set)"
        return
    from glm53_patches.patches.command_buffers.plan import plan

    if sys.platform == "darwin":  # elsewhere plan() sets nothing: skip the entry-point scan
        from importlib.metadata import entry_points

        known = {entry.name for entry in entry_points(group="glm53_patches")}
        if settings.errors or config.unknown_name_errors(settings, known):
            COMMAND_BUFFERS = "configuration error (see the log): nothing set"
            return  # the registry reports the error and applies nothing

    changes, COMMAND_BUFFERS = plan(os.environ, sys.platform, "mlx.core" in sys.modules)
    os.environ.update(changes)


def install():
    try:
        _command_buffers()
    except Exception as exc:
        print(f"glm53-patches ERROR: command_buffers failed ({exc!r}); nothing set", file=sys.stderr)
    try:
        if TRIGGER in sys.modules:  # imported before the bootstrap: apply now
            _apply_on_import(sys.modules[TRIGGER])
        elif not any(isinstance(f, PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, PostImportFinder())
    except Exception as exc:
        print(f"glm53-patches ERROR: cannot register the import hook ({exc!r}); stock code running", file=sys.stderr)


install()

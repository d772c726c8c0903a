"""Run by the glm53_patches .pth line when a GLM53_* variable is set.

Standard library and wrapt only, and it never raises: a broken install, a bad
value or a broken upstream must not print a traceback into every Python
process. The patches themselves are applied when mlx-vlm imports the module
that defines the glm5_next classes.
"""

TRIGGER = "mlx_vlm.models.glm5_next.language"
COMMAND_BUFFERS = None  # what the command_buffers patch set, for `status`


def _apply_on_import(_module):
    try:
        from glm53_patches import registry
    except Exception as exc:  # pragma: no cover - a broken install
        import sys

        print(f"glm53-patches ERROR: cannot load the registry ({exc!r}); stock code running", file=sys.stderr)
        return
    try:
        registry.from_environment()
    except registry.PatchError:
        raise  # GLM53_PATCHES_STRICT=1 asked for it
    except Exception as exc:
        registry.log.error(f"applying patches failed ({exc!r}); stock code running")
        registry.note_hook_error(repr(exc))


def _command_buffers():
    """Set Metal buffer limits now: mlx reads them once, at import."""
    global COMMAND_BUFFERS
    import os
    import sys
    from importlib.metadata import entry_points

    from glm53_patches import config

    settings = config.read()
    if not settings.wants("command_buffers", in_all=False):
        return
    known = {entry.name for entry in entry_points(group="glm53_patches")}
    if settings.errors or config.unknown_name_errors(settings, known):
        return  # the registry reports the error and applies nothing
    from glm53_patches.patches.command_buffers.plan import plan

    changes, COMMAND_BUFFERS = plan(os.environ, sys.platform, "mlx.core" in sys.modules)
    os.environ.update(changes)


def install():
    try:
        _command_buffers()
    except Exception as exc:
        import sys

        print(f"glm53-patches ERROR: command_buffers failed ({exc!r}); nothing set", file=sys.stderr)
    try:
        import wrapt

        wrapt.register_post_import_hook(_apply_on_import, TRIGGER)
    except Exception as exc:
        import sys

        print(f"glm53-patches ERROR: cannot register the import hook ({exc!r}); stock code running", file=sys.stderr)


install()

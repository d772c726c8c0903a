"""Run by the glm53_patches .pth line when a GLM53_* variable is set.

Standard library and wrapt only, and it never raises: a broken install, a bad
value or a broken upstream must not print a traceback into every Python
process. The patches themselves are applied when mlx-vlm imports the module
that defines the glm5_next classes.
"""

TRIGGER = "mlx_vlm.models.glm5_next.language"


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


def install():
    try:
        import wrapt

        wrapt.register_post_import_hook(_apply_on_import, TRIGGER)
    except Exception as exc:
        import sys

        print(f"glm53-patches ERROR: cannot register the import hook ({exc!r}); stock code running", file=sys.stderr)


install()

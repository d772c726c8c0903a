"""glm53-patches: opt-in, reversible, drift-guarded speedups for mlx-vlm's glm5_next.

Most users never import this: a .pth line applies the patches named in
GLM53_PATCHES when mlx-vlm loads glm5_next. Scripts can call `enable()`.
"""

__version__ = "0.1.0"


def enable(names=None, *, force=(), strict=False):
    """Apply patches now: the named ones, or what the GLM53_* variables ask for.

    Imports mlx-vlm's glm5_next module. Returns the per-patch status.
    """
    from . import registry

    if names is None:
        return registry.from_environment()
    if isinstance(names, str):
        names = [names]
    return registry.apply(list(names), force=force, strict=strict)


def disable(names=None):
    """Revert patches (default: all), restoring the original upstream objects."""
    from . import registry

    registry.revert(names)


def status():
    from . import registry

    return registry.status()

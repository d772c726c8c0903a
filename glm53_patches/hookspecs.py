"""pluggy hook specifications: how a package contributes patches."""

import pluggy

PROJECT = "glm53_patches"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def glm53_patches():
    """Return a list of :class:`glm53_patches.registry.Patch` this plugin provides."""

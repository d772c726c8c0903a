"""The installed mlx-vlm is a pinned one, and the drift guard tells pinned from unpinned releases."""

import os
from importlib.metadata import version

import pytest

from glm53_patches import drift, pins, registry


def test_the_installed_mlx_vlm_is_pinned():
    expected = os.environ.get("GLM53_TEST_PIN")  # set by the nox session
    installed = version("mlx-vlm")
    assert installed in pins.mlx_vlm_versions()
    if expected:
        assert installed == expected


def test_every_patch_applies_on_this_pin():
    for name, patch in registry.available().items():
        assert drift.check_patch(patch) == {}, name


@pytest.fixture(scope="session")
def release_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("releases")


def test_a_release_with_the_old_design_is_refused(release_cache):
    """mlx-vlm 0.7.0 has the pre-rewrite glm5_next: every patch must see drift there."""
    root = drift.unpack_release("0.7.0", release_cache)
    for name, patch in registry.available().items():
        if not patch.targets:
            continue  # replaces nothing upstream (command_buffers): version-independent
        problems = drift.check_patch(patch, root=root)
        assert problems, f"{name} would apply to mlx-vlm 0.7.0"


def test_the_shipped_fingerprints_are_what_the_pinned_wheels_give(release_cache):
    targets = sorted({t for p in registry.available().values() for t in p.all_fingerprinted()})
    regenerated = drift.regenerate(targets, pins.mlx_vlm_versions(), release_cache)
    assert set(regenerated) == set(targets)
    for name, patch in registry.available().items():
        assert drift.known_for(patch) == {t: regenerated[t] for t in patch.all_fingerprinted()}, name

"""One declaration per patch: what people read is generated from it, and pip's list agrees with it."""

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from glm53_patches import manifest, registry

ROOT = Path(__file__).resolve().parents[2]


def test_generated_files_match_the_declarations():
    """entry_points.toml and README's settings table are what `glm53-patches manifest --write` renders."""
    stale = manifest.stale(registry.available())
    assert not stale, f"run `glm53-patches manifest --write`: stale {sorted(stale)}"


def test_a_changed_declaration_makes_them_stale(monkeypatch):
    patches = dict(registry.available())
    import dataclasses

    patches["hc_decode"] = dataclasses.replace(patches["hc_decode"], upstream="proposed as #1")
    assert str(manifest.MANIFEST) in manifest.stale(patches)


def test_pyproject_entry_points_are_the_discovered_patches():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["glm53_patches"]
    installed = {e.name: e.value for e in entry_points(group="glm53_patches")}
    assert declared == installed
    assert set(declared) == set(registry.available())
    for name, module in declared.items():  # each entry point's module declares the patch of that name
        assert __import__(module, fromlist=["PATCH"]).PATCH.name == name


def test_every_patch_has_its_patch_md():
    for name, module in manifest.modules().items():
        assert (ROOT / Path(*module.split("."))).joinpath("PATCH.md").is_file(), name

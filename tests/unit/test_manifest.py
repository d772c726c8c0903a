"""entry_points.toml (for people) and pyproject.toml (for pip) never disagree."""

import tomllib
from importlib.metadata import entry_points
from pathlib import Path

from glm53_patches import registry

ROOT = Path(__file__).resolve().parents[2]


def _manifest():
    return tomllib.loads((ROOT / "entry_points.toml").read_text())


def test_pyproject_declares_exactly_the_manifest():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["glm53_patches"]
    assert declared == {name: entry["module"] for name, entry in _manifest().items()}


def test_installed_entry_points_match_the_manifest():
    installed = {e.name: e.value for e in entry_points(group="glm53_patches")}
    assert installed == {name: entry["module"] for name, entry in _manifest().items()}


def test_manifest_describes_the_code():
    patches = registry.available()
    for name, entry in _manifest().items():
        patch = patches[name]
        assert entry["env"] == patch.env_var
        assert entry["numerics"] == patch.numerics
        assert entry["targets"] == list(patch.targets)
        assert (Path(registry.__file__).parent / "patches" / name / "PATCH.md").is_file()

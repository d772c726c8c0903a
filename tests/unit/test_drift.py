"""Drift fingerprints: code changes count, docstrings and formatting do not."""

from glm53_patches import drift, pins, registry

SOURCE = '''
class Layer:
    def __call__(self, x):
        """Doc."""
        return x + 1
'''


def test_docstrings_and_formatting_do_not_count():
    reformatted = SOURCE.replace('"""Doc."""', '"""Another doc."""').replace("x + 1", "(x  +  1)  # why")
    assert drift.fingerprint_source(SOURCE, "Layer.__call__") == drift.fingerprint_source(reformatted, "Layer.__call__")


def test_a_code_change_counts():
    changed = SOURCE.replace("x + 1", "x + 2")
    assert drift.fingerprint_source(SOURCE, "Layer.__call__") != drift.fingerprint_source(changed, "Layer.__call__")


def test_missing_object_has_no_fingerprint():
    assert drift.fingerprint_source(SOURCE, "Layer.forward") is None
    assert drift.fingerprint_source(SOURCE, "Other") is None


def test_each_patch_fingerprints_every_object_it_touches_on_every_pin():
    """Each patch's own file (beside its declaration) covers its targets and relied-on objects, and only them."""
    versions = set(pins.mlx_vlm_versions())
    for patch in registry.available().values():
        known = drift.known_for(patch)
        assert patch.fingerprints_path().parent == patch.folder()
        assert set(known) == set(patch.all_fingerprinted()), patch.name
        for target in patch.all_fingerprinted():
            covered = {v for vs in known.get(target, {}).values() for v in vs}
            assert covered == versions, f"{patch.name} {target}: fingerprinted on {sorted(covered)}, pins {sorted(versions)}"


def test_installed_upstream_matches_a_shipped_fingerprint():
    for patch in registry.available().values():
        assert drift.check_patch(patch) == {}, patch.name


def test_a_patch_is_checked_against_its_own_file_only(tmp_path):
    """Another patch's fingerprints of the same object do not admit a patch whose own file lacks it."""
    import dataclasses

    kda = registry.available()["compiled_kda_decode"]
    (tmp_path / "fingerprints.json").write_text("{}")
    orphan = dataclasses.replace(kda, name="orphan", fingerprints_file=str(tmp_path / "fingerprints.json"))
    problems = drift.check_patch(orphan)
    assert set(problems) == set(kda.all_fingerprinted())
    assert all("never verified" in problem for problem in problems.values())


def test_fields_a_newer_python_adds_empty_do_not_count():
    """Python 3.12 added FunctionDef.type_params ([] when unused); fingerprints must not move."""
    import ast

    node = ast.parse(SOURCE).body[0].body[0]

    newer_class = type("FunctionDef", (ast.FunctionDef,), {"_fields": ast.FunctionDef._fields + ("type_params",)})
    newer = newer_class(**{f: getattr(node, f) for f in ast.FunctionDef._fields}, type_params=[])
    assert ast.dump(newer) != ast.dump(node)
    assert drift._digest(newer) == drift._digest(node)


def test_a_name_bound_by_an_import_is_fingerprinted_by_where_it_comes_from():
    """glm5_next's `linear` is imported from ..linear: its fingerprint is the import (module, level,
    name); a changed source or an alias counts, the other names of the same import do not."""
    here = "from ..linear import DECODE_BLOCK_SIZE, linear, tiled_linear\n"
    found = drift.fingerprint_source(here, "linear")
    assert found is not None
    assert drift.fingerprint_source("from ..linear import linear\n", "linear") == found
    assert drift.fingerprint_source("from ..other import linear\n", "linear") != found
    assert drift.fingerprint_source("from .linear import linear\n", "linear") != found
    assert drift.fingerprint_source("from ..linear import dense as linear\n", "linear") != found
    assert drift.fingerprint_source(here, "tiled_linear") not in (None, found)
    assert drift.fingerprint_source("def f():\n    from ..linear import linear\n", "linear") is None  # module level only
    assert drift.fingerprint_source(here, "linear.attr") is None

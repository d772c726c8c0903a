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


def test_shipped_fingerprints_cover_every_target_on_every_pin():
    known = drift.load_known()
    versions = set(pins.mlx_vlm_versions())
    for patch in registry.available().values():
        for target in patch.all_fingerprinted():
            covered = {v for vs in known.get(target, {}).values() for v in vs}
            assert covered == versions, f"{target}: fingerprinted on {sorted(covered)}, pins {sorted(versions)}"


def test_installed_upstream_matches_a_shipped_fingerprint():
    for patch in registry.available().values():
        assert drift.check(patch.all_fingerprinted()) == {}, patch.name


def test_fields_a_newer_python_adds_empty_do_not_count():
    """Python 3.12 added FunctionDef.type_params ([] when unused); fingerprints must not move."""
    import ast

    node = ast.parse(SOURCE).body[0].body[0]

    newer_class = type("FunctionDef", (ast.FunctionDef,), {"_fields": ast.FunctionDef._fields + ("type_params",)})
    newer = newer_class(**{f: getattr(node, f) for f in ast.FunctionDef._fields}, type_params=[])
    assert ast.dump(newer) != ast.dump(node)
    assert drift._digest(newer) == drift._digest(node)

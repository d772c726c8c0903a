"""Environment parsing: every bad value names the variable, the value and what is accepted."""

from glm53_patches import config


def test_unset_requests_nothing():
    settings = config.read({})
    assert settings.requested == "none" and not settings.errors
    assert not settings.wants("compiled_kda_decode", in_all=True)


def test_all_none_and_lists():
    assert config.read({"GLM53_PATCHES": "ALL"}).wants("x", in_all=True)
    assert not config.read({"GLM53_PATCHES": "all"}).wants("x", in_all=False)
    assert not config.read({"GLM53_PATCHES": "none"}).wants("x", in_all=True)
    listed = config.read({"GLM53_PATCHES": " a , b "})
    assert listed.requested == frozenset({"a", "b"})
    assert listed.wants("a", in_all=False) and not listed.wants("c", in_all=True)


def test_per_patch_override_beats_the_list():
    env = {"GLM53_PATCHES": "all", "GLM53_PATCH_A": "0", "GLM53_PATCH_B": "on"}
    settings = config.read(env)
    assert not settings.wants("a", in_all=True)
    assert settings.wants("b", in_all=False)


def test_bad_boolean_names_variable_value_and_accepted():
    settings = config.read({"GLM53_PATCH_COMPILED_KDA_DECODE": "maybe", "GLM53_PATCHES_STRICT": "sure"})
    assert len(settings.errors) == 2
    for error, var, value in zip(sorted(settings.errors), ["GLM53_PATCHES_STRICT", "GLM53_PATCH_COMPILED_KDA_DECODE"], ["sure", "maybe"]):
        assert var in error and repr(value) in error and "accepted: 1 or 0" in error


def test_unknown_names_are_reported_with_the_known_ones():
    settings = config.read({"GLM53_PATCHES": "bogus", "GLM53_PATCH_NOPE": "1", "GLM53_PATCHES_FORCE": "zzz"})
    errors = config.unknown_name_errors(settings, {"compiled_kda_decode": None})
    assert len(errors) == 3
    assert "GLM53_PATCHES" in errors[0] and "'bogus'" in errors[0] and "compiled_kda_decode" in errors[0]
    assert "GLM53_PATCH_NOPE" in errors[1]
    assert "GLM53_PATCHES_FORCE" in errors[2] and "'zzz'" in errors[2]


def test_force_allows_a_patch_that_all_does_not_cover():
    settings = config.read({"GLM53_PATCHES": "all", "GLM53_PATCHES_FORCE": "k"})
    assert settings.wants("k", in_all=False)


def test_knob_parses_and_reports():
    assert config.knob("p", "min", int, 7, {}) == (7, None)
    assert config.knob("p", "min", int, 7, {"GLM53_P_MIN": "9"}) == (9, None)
    value, error = config.knob("p", "min", int, 7, {"GLM53_P_MIN": "x"})
    assert value == 7 and "GLM53_P_MIN='x'" in error


def test_any_set_only_looks_at_the_prefix():
    assert not config.any_set({"PATH": "/bin", "GLM5_X": "1"})
    assert config.any_set({"GLM53_ANYTHING": ""})

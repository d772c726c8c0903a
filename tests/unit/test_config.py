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
    count = config.integer(1)
    assert config.knob("p", "min", count, 7, {}) == (7, None)
    assert config.knob("p", "min", count, 7, {"GLM53_P_MIN": "9"}) == (9, None)
    value, error = config.knob("p", "min", count, 7, {"GLM53_P_MIN": "x"})
    assert value == 7 and "GLM53_P_MIN='x'" in error and "accepted: a whole number, 1 or more" in error


def test_one_vocabulary_for_every_switch():
    """GLM53_PATCH_*, GLM53_PATCHES_STRICT, flag and switch knobs all take the same on/off words."""
    flag, switch = config.flag(), config.switch()
    for word, meaning in [("1", True), ("yes", True), ("ON", True), ("true", True),
                          ("0", False), ("no", False), ("off", False), ("False", False)]:
        assert config.parse_bool("V", word) == (meaning, None)
        assert flag.read("V", word) == (meaning, None)
        assert switch.read("V", word) == (meaning, None)
        assert config.read({"GLM53_PATCH_X": word}).overrides == {"x": meaning}
    assert switch.read("V", "Auto") == (None, None)
    for bad in ("auto", "force", "2", ""):
        value, error = flag.read("V", bad)
        assert value is None and f"V={bad!r}" in error and config.BOOL_ACCEPTED in error
    value, error = switch.read("GLM53_HC_DECODE_KERNEL", "sometimes")
    assert value is None and "GLM53_HC_DECODE_KERNEL='sometimes'" in error and "auto" in error


def test_integer_and_choice_bounds():
    elements = config.integer(1, 10, what="elements")
    assert elements.read("V", " 10 ") == (10, None)
    for bad in ("0", "11", "-1", "1.5", "ten"):
        assert elements.read("V", bad)[0] is None
    assert "from 1 to 10" in elements.read("V", "11")[1]
    chunk = config.choice(16, 32)
    assert chunk.read("V", "32") == (32, None) and chunk.read("V", "48")[1].endswith("one of 16, 32")
    method = config.choice("auto", "kernel")
    assert method.read("V", "KERNEL") == ("kernel", None)


class _Declared:
    def __init__(self, **knobs):
        self.knobs = knobs


def test_knob_problems_checks_declared_knobs_and_names_unknown_variables():
    patches = {"hc_decode": _Declared(kernel=config.switch()), "gathered_prefill": _Declared(max_elements=config.integer(1))}
    environ = {"GLM53_HC_DECODE_KERNEL": "yes", "GLM53_GATHERED_PREFILL_MAX_ELEMENTS": "0",
               "GLM53_HC_DECODE_KERNL": "1", "GLM53_PATCH_HC_DECODE": "1", "GLM53_PATCHES": "all"}
    errors, warnings = config.knob_problems(patches, environ)
    assert errors == ["GLM53_GATHERED_PREFILL_MAX_ELEMENTS='0' is not valid; accepted: a whole number, 1 or more"]
    assert len(warnings) == 1 and warnings[0].startswith("GLM53_HC_DECODE_KERNL is not a variable")


def test_state_dir_that_is_a_file_is_a_problem_that_names_the_variable(tmp_path):
    a_file = tmp_path / "state"
    a_file.write_text("")
    problem = config.state_dir_problem({"GLM53_PATCHES_STATE_DIR": str(a_file)})
    assert problem.startswith("GLM53_PATCHES_STATE_DIR:") and str(a_file) in problem
    assert config.state_dir_problem({"GLM53_PATCHES_STATE_DIR": str(tmp_path / "new" / "state")}) is None


def test_private_dir_is_0700_and_tightens_our_own(tmp_path):
    made = config.private_dir(tmp_path / "a" / "b")
    assert made.stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    assert config.private_dir(loose).stat().st_mode & 0o777 == 0o700


def test_any_set_only_looks_at_the_prefix():
    assert not config.any_set({"PATH": "/bin", "GLM5_X": "1"})
    assert config.any_set({"GLM53_ANYTHING": ""})

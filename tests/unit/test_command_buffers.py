"""command_buffers: what it would set on a Mac, and that it sets nothing elsewhere."""

import os
import subprocess
import sys

from glm53_patches.patches.command_buffers.plan import DEFAULTS, MB, OPS, plan


def test_on_metal_it_sets_the_measured_defaults():
    changes, note = plan({}, "darwin", mlx_loaded=False)
    assert changes == {OPS: str(DEFAULTS[OPS]), MB: str(DEFAULTS[MB])}
    assert f"{OPS}={DEFAULTS[OPS]} set" in note


def test_a_value_the_user_set_is_kept():
    changes, note = plan({OPS: "64"}, "darwin", mlx_loaded=False)
    assert OPS not in changes and MB in changes
    assert f"{OPS}=64 kept (set by you)" in note


def test_knobs_and_bad_knobs():
    changes, _ = plan({"GLM53_COMMAND_BUFFERS_OPS": "500"}, "darwin", mlx_loaded=False)
    assert changes[OPS] == "500"
    changes, note = plan({"GLM53_COMMAND_BUFFERS_MB": "lots"}, "darwin", mlx_loaded=False)
    assert changes == {} and "GLM53_COMMAND_BUFFERS_MB='lots'" in note and "positive integer" in note


def test_too_late_or_no_metal_sets_nothing():
    assert plan({}, "darwin", mlx_loaded=True)[0] == {}
    changes, note = plan({}, "linux", mlx_loaded=False)
    assert changes == {} and "no Metal" in note


def test_in_a_real_process_status_says_what_happened(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLM53_", "MLX_MAX_"))}
    env.update({"GLM53_PATCHES": "command_buffers", "GLM53_PATCHES_STATE_DIR": str(tmp_path)})
    code = ("import os, mlx_vlm.models.glm5_next.language, glm53_patches; "
            "entry = glm53_patches.status()['patches']['command_buffers']; "
            "print(entry['state'], '|', entry['detail'], '|', os.environ.get('MLX_MAX_OPS_PER_BUFFER'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    state, detail, ops = (part.strip() for part in out.stdout.split("|"))
    assert state == "applied"
    if sys.platform == "darwin":
        assert ops == str(DEFAULTS[OPS]) and "set" in detail
    else:
        assert ops == "None" and "no Metal" in detail


def test_all_leaves_the_trade_off_to_the_user():
    from glm53_patches import registry

    assert not registry.covered_by_all(registry.available()["command_buffers"])

"""Each kernel patch's GLM53_<PATCH>_KERNEL knob (``glm53_patches/kernel_switch.py``), as a user sets it."""

import importlib
import logging

import pytest

SWITCHES = {  # the module that holds the patch's switch and clear(), and its variable
    "router_select": ("glm53_patches.patches.router_select.gate", "GLM53_ROUTER_SELECT_KERNEL"),
    "expert_combine": ("glm53_patches.patches.expert_combine.combine", "GLM53_EXPERT_COMBINE_KERNEL"),
    "dsa_decode": ("glm53_patches.patches.dsa_decode.decode", "GLM53_DSA_DECODE_KERNEL"),
    "fused_kda_kernel": ("glm53_patches.patches.fused_kda_kernel.step", "GLM53_FUSED_KDA_KERNEL_KERNEL"),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_kernel_knob(name, monkeypatch, caplog):
    module_name, variable = SWITCHES[name]
    module = importlib.import_module(module_name)
    module.clear()
    assert module.switch.wanted("cuda") is False  # auto, and no verify record in the test state dir
    for on in ("1", "on"):
        monkeypatch.setenv(variable, on)
        module.clear()
        assert module.switch.wanted("cuda") is True
        assert module.switch.wanted(None) is False  # the CPU has no kernel, whatever the knob says
    monkeypatch.setenv(variable, "sometimes")
    module.clear()
    with caplog.at_level(logging.ERROR, logger="glm53_patches"):
        assert module.switch.wanted("cuda") is False
    assert variable in caplog.text and "accepted" in caplog.text
    module.clear()

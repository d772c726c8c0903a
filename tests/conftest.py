"""Shared fixtures: an isolated state folder, a clean journal, tiny checkpoints."""

import pytest

import glm53_patches


@pytest.fixture(autouse=True, scope="session")
def _session_state(tmp_path_factory):
    """Between tests too (the status flusher thread publishes every second), state stays out of ~/.cache."""
    import os

    previous = os.environ.get("GLM53_PATCHES_STATE_DIR")
    os.environ["GLM53_PATCHES_STATE_DIR"] = str(tmp_path_factory.mktemp("session-state"))
    yield
    if previous is None:
        os.environ.pop("GLM53_PATCHES_STATE_DIR", None)
    else:
        os.environ["GLM53_PATCHES_STATE_DIR"] = previous


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    """Status files and verify records go to a per-test folder, and no GLM53_* leaks in."""
    for key in list(__import__("os").environ):
        if key.startswith("GLM53_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLM53_PATCHES_STATE_DIR", str(tmp_path / "state"))
    yield
    glm53_patches.disable()


@pytest.fixture(scope="session")
def tiny_fp32_dir(tmp_path_factory):
    from glm53_patches.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-fp32"))


@pytest.fixture(scope="session")
def tiny_q4_dir(tmp_path_factory):
    from glm53_patches.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-q4"), quantize_bits=4)

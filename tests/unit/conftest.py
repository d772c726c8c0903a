"""The staging fixtures test_stage.py and test_stage_all.py share: the pinned releases and tiny models, once per session."""

import pytest

from glm53_patches import stage


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stage-cache")


@pytest.fixture(scope="session")
def releases(cache):
    return stage.pinned_trees(cache)


@pytest.fixture(scope="session")
def models(cache):
    return stage.tiny_models(cache)

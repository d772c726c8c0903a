"""One session per line of upstream_pins.txt: install that mlx-vlm and run the suite.

The first (reference) pin runs everything, including ``tests/unit/test_stage.py``,
which stages every patch against every pin. An older pin runs what depends on
the rest of mlx-vlm: the real server with the patches (``tests/server``), the
drift and refusal checks (``tests/pins``) and the bootstrap. It runs a patch's
numerics tests only where that patch's upstream code on the pin differs from
the reference pin's (its ``fingerprints.json``: every target and every object
it relies on). Where the code is the same, the same tests on the same MLX give
the same bits.

Each session runs pytest-xdist workers (``-n auto``), one test file per worker
at a time.
"""

import json
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
from glm53_patches import pins  # noqa: E402  (stdlib-only module)

PINS = pins.read(ROOT / "upstream_pins.txt")
REFERENCE = PINS[0]["mlx-vlm"]
# Numerics files that test patches other than the one in their name, or several at once.
OWNERS = {"moe_kernels": {"router_select", "expert_combine"}, "vault_ttft": {"vault_cache"}}
CROSS_PATCH = ("speculative", "kernel_switches")
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def upstream_changed(version):
    """The patches whose fingerprinted upstream code on ``version`` differs from the reference pin's."""
    changed = set()
    for path in sorted((ROOT / "glm53_patches" / "patches").glob("*/fingerprints.json")):
        for groups in json.loads(path.read_text()).values():
            if not any(REFERENCE in versions and version in versions for versions in groups.values()):
                changed.add(path.parent.name)
    return changed


def numerics_for(version):
    """tests/numerics files an older pin runs: those of its changed patches (all cross-patch ones if any changed)."""
    changed = upstream_changed(version)
    files = []
    for path in sorted((ROOT / "tests" / "numerics").glob("test_*.py")):
        topic = path.stem[len("test_"):]
        if (topic in CROSS_PATCH and changed) or OWNERS.get(topic, {topic}) & changed:
            files.append(str(path.relative_to(ROOT)))
    return files


@nox.session
@nox.parametrize("mlx_vlm", [pin["mlx-vlm"] for pin in PINS])
def tests(session, mlx_vlm):
    mlx = next(pin["mlx"] for pin in PINS if pin["mlx-vlm"] == mlx_vlm)
    session.install(f"mlx[cpu]=={mlx}", f"mlx-vlm=={mlx_vlm}", "-e", ".[test]")
    if mlx_vlm == REFERENCE:
        paths = ["tests"]
    else:
        paths = ["tests/server", "tests/pins", "tests/bootstrap", *numerics_for(mlx_vlm)]
        session.log(f"mlx-vlm {mlx_vlm}: upstream code differs from {REFERENCE} for "
                    f"{', '.join(sorted(upstream_changed(mlx_vlm))) or 'no patch'}")
    session.run("pytest", "-q", "-n", "auto", "--dist", "loadfile", *paths, *session.posargs,
                env={"GLM53_TEST_PIN": mlx_vlm})

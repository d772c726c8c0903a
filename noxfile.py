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
PATCHES = ROOT / "glm53_patches" / "patches"
# Numerics files whose name does not start with the patch they test. A file that maps to
# no patch (test_speculative.py, test_kernel_switches.py) tests several: it runs wherever any changed.
OWNERS = {"moe_kernels": {"router_select", "expert_combine"}, "vault_ttft": {"vault_cache"}}
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


def upstream_changed(version):
    """The patches whose fingerprinted upstream code on ``version`` differs from the reference pin's."""
    changed = set()
    for path in sorted(PATCHES.glob("*/fingerprints.json")):
        for groups in json.loads(path.read_text()).values():
            if not any(REFERENCE in versions and version in versions for versions in groups.values()):
                changed.add(path.parent.name)
    return changed


def owners(topic):
    """The patches tests/numerics/test_<topic>.py tests (OWNERS, else the patch its name starts with)."""
    if topic in OWNERS:
        return OWNERS[topic]
    return {p.parent.name for p in PATCHES.glob("*/__init__.py") if f"{topic}_".startswith(f"{p.parent.name}_")}


def numerics_for(changed):
    """tests/numerics files an older pin runs, given its changed patches (cross-patch files if any changed)."""
    files = []
    for path in sorted((ROOT / "tests" / "numerics").glob("test_*.py")):
        mine = owners(path.stem[len("test_"):])
        if changed and (mine & changed or not mine):
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
        changed = upstream_changed(mlx_vlm)
        paths = ["tests/server", "tests/pins", "tests/bootstrap", *numerics_for(changed)]
        session.log(f"mlx-vlm {mlx_vlm}: upstream code differs from {REFERENCE} for "
                    f"{', '.join(sorted(changed)) or 'no patch'}")
    # --durations: the slowest tests in the log, to keep the matrix inside CI's time
    session.run("pytest", "-q", "-n", "auto", "--dist", "loadfile", "--durations=15", *paths, *session.posargs,
                env={"GLM53_TEST_PIN": mlx_vlm})

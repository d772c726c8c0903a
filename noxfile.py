"""One session per line of upstream_pins.txt: install that mlx-vlm and run the suite.

The first (reference) pin runs everything; older pins run the tests that touch
upstream behaviour (numerics, server, pins, bootstrap).
"""

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from glm53_patches import pins  # noqa: E402  (stdlib-only module)

PINS = pins.read(Path(__file__).parent / "upstream_pins.txt")
REFERENCE = PINS[0]["mlx-vlm"]
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
@nox.parametrize("mlx_vlm", [pin["mlx-vlm"] for pin in PINS])
def tests(session, mlx_vlm):
    mlx = next(pin["mlx"] for pin in PINS if pin["mlx-vlm"] == mlx_vlm)
    session.install(f"mlx[cpu]=={mlx}", f"mlx-vlm=={mlx_vlm}", "-e", ".[test]")
    paths = ["tests"] if mlx_vlm == REFERENCE else ["tests/numerics", "tests/server", "tests/pins", "tests/bootstrap"]
    session.run("pytest", "-q", *paths, *session.posargs, env={"GLM53_TEST_PIN": mlx_vlm})

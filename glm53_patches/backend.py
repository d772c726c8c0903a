"""Which MLX backend runs here, and whether MLX loads at all: one answer for the whole package."""

import sys
from typing import Optional


def mlx_problem() -> Optional[str]:
    """None when ``mlx.core`` loads; else one line that says what to install."""
    try:
        import mlx.core  # noqa: F401
    except (ImportError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if sys.platform == "darwin":
            hint = 'reinstall it: pip install --force-reinstall "mlx>=0.32.2"'
        else:
            hint = ('on Linux mlx needs a backend: pip install "glm53-patches[cpu]" '
                    '(or "glm53-patches[cuda13]" / "[cuda12]" for an NVIDIA GPU)')
        return f"MLX cannot load ({reason}); {hint}"
    return None


def current() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def gpu() -> Optional[str]:
    """'metal' or 'cuda' when the default device is a GPU, else None."""
    name = current()
    return None if name == "cpu" else name

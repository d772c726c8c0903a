"""Which MLX backend runs here, whether MLX loads at all, and what machine this is: one answer for the package."""

import platform
import subprocess
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


def gpu_backend() -> Optional[str]:
    """'metal' or 'cuda' when MLX's default device is that GPU, else None."""
    import mlx.core as mx

    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else None


def current() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    return gpu_backend() or "cpu"


def sorted_gather_mm_max_experts(backend: str, out: int, inp: int, itemsize: int) -> Optional[int]:
    """How many experts of ``[out, inp]`` weights (``itemsize`` bytes each) one ``gather_mm`` over
    sorted routes may take on ``backend`` (None: no limit known). MLX 0.32's CUDA grouped GEMM
    (the sorted path at one row per route, ``grouped_gemm_unaligned.cu``) offsets expert g's
    weights by ``g * itemsize * out * inp`` in 32-bit ints: from 2**31 bytes on it reads before
    the weights. GLM-5.3-Flash's 288 bf16 experts of 2048 x 4096 wrap at expert 128 (NaNs on the
    H200, BENCHMARKS.md s25). The CPU computes offsets in 64 bits; Metal's are unchecked here
    (dequantized_experts' ``verify`` runs a 288-expert case on a GPU)."""
    if backend != "cuda":
        return None
    return (2**31 - 1) // (itemsize * out * inp) + 1


def machine() -> dict:
    """What a bug report needs about this machine: OS, CPU or chip, Python, MLX's device, versions."""
    from importlib.metadata import PackageNotFoundError, version

    info = {"os": platform.platform(), "machine": platform.machine(), "python": platform.python_version()}
    if sys.platform == "darwin":
        info["macos"] = platform.mac_ver()[0]
        try:
            info["chip"] = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                          text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    for dist in ("mlx", "mlx-metal", "mlx-cuda-12", "mlx-cuda-13", "mlx-cpu", "mlx-vlm", "glm53-patches"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            pass
    if mlx_problem() is None:
        import mlx.core as mx

        info["backend"] = current()
        try:
            info["device"] = {k: (v if isinstance(v, (str, int, float, bool)) else str(v))
                              for k, v in mx.device_info().items()}
        except Exception as exc:  # device_info is newer than some MLX releases
            info["device"] = f"unavailable: {exc!r}"
    return info

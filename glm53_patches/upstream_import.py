"""Import mlx-vlm's glm5_next model modules, even where mlx-vlm's package __init__ cannot load.

A bare GPU machine has mlx and mlx-vlm's files but not the server/processor
dependencies the package __init__ imports (datasets, mlx-audio, ...). The
model modules need none of them, so the packages above them are registered
without running their __init__.
"""

import importlib
import importlib.util
import sys

LANGUAGE = "mlx_vlm.models.glm5_next.language"
_BARE = ("mlx_vlm", "mlx_vlm.models.glm5_next", "mlx_vlm.models.deepseek_v4")
bare_reason = None  # why bare packages were used, or None


def import_language():
    """The glm5_next language module (mlx-vlm's, unmodified)."""
    global bare_reason
    try:
        return importlib.import_module(LANGUAGE)
    except Exception as first:  # noqa: BLE001 - any missing dependency
        for key in [k for k in sys.modules if k == "mlx_vlm" or k.startswith("mlx_vlm.")]:
            del sys.modules[key]
        for package in _BARE:
            spec = importlib.util.find_spec(package)
            if spec is None:
                raise first
            module = importlib.util.module_from_spec(spec)  # registered, never executed
            sys.modules[package] = module
            parent, _, leaf = package.rpartition(".")
            if parent:
                setattr(importlib.import_module(parent), leaf, module)
        bare_reason = f"mlx_vlm's package __init__ failed ({type(first).__name__}: {first}); bare packages used"
        print(f"glm53-patches: {bare_reason}", file=sys.stderr)
        return importlib.import_module(LANGUAGE)

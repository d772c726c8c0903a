"""upstream_pins.txt: the mlx-vlm (and mlx) versions every patch is tested against."""

from pathlib import Path
from typing import Dict, List

# In a checkout the file sits at the root; wheels carry a copy inside the package.
_CANDIDATES = (
    Path(__file__).resolve().parent.parent / "upstream_pins.txt",
    Path(__file__).resolve().parent / "upstream_pins.txt",
)


def read(path=None) -> List[Dict[str, str]]:
    """[{'mlx-vlm': '0.7.10', 'mlx': '0.32.4'}, ...], newest first."""
    path = Path(path) if path else next(p for p in _CANDIDATES if p.is_file())
    pins = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(dict(part.split("==", 1) for part in line.split()))
    return pins


def mlx_vlm_versions(path=None) -> List[str]:
    return [pin["mlx-vlm"] for pin in read(path)]

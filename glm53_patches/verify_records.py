"""Which (patch, backend, mlx, mlx-vlm) combinations passed `verify` on this machine."""

import json
import os
from importlib.metadata import version

from . import config


def _path():
    return config.state_dir() / "verified.json"


def _key(patch: str, backend: str) -> str:
    return f"{patch}|{backend}|mlx {version('mlx')}|mlx-vlm {version('mlx-vlm')}"


def load() -> dict:
    try:
        return json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}


def record(patch: str, backend: str, result: dict) -> None:
    records = load()
    records[_key(patch, backend)] = result
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(records, indent=1, sort_keys=True))
    os.replace(temporary, path)


def passed(patch: str, backend: str) -> bool:
    return load().get(_key(patch, backend), {}).get("passed") is True

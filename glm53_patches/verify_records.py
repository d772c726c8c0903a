"""Which (patch, backend, mlx, mlx-vlm, patch code) combinations passed `verify` on this machine.

The code digest covers the patch's folder and the shared kernels: a record
made for an older kernel does not admit a changed one to ``all``.
"""

import functools
import hashlib
import json
import logging
import os
from importlib.metadata import version
from pathlib import Path

from filelock import FileLock

from . import config
from .log import once

_PACKAGE = Path(__file__).parent


def _path():
    return config.state_dir() / "verified.json"


@functools.lru_cache(maxsize=None)
def code_digest(patch: str) -> str:
    """SHA-256 (12 hex digits) of the patch folder's and glm53_patches/kernels' Python sources."""
    digest = hashlib.sha256()
    for folder in (_PACKAGE / "patches" / patch, _PACKAGE / "kernels"):
        for source in sorted(folder.glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


def _key(patch: str, backend: str) -> str:
    return f"{patch}|{backend}|mlx {version('mlx')}|mlx-vlm {version('mlx-vlm')}|code {code_digest(patch)}"


def load() -> dict:
    """The records; {} when there are none. An unreadable folder or file is said once (it shrinks `all`)."""
    try:
        return json.loads(_path().read_text())
    except (FileNotFoundError, NotADirectoryError):  # none yet; a state "folder" that is a file is said at start-up
        return {}
    except (OSError, ValueError) as exc:
        once(logging.WARNING, f"cannot read the verify records in {_path()} ({exc!r}): GLM53_PATCHES=all "
             "leaves out the patches whose kernels need one")
        return {}


def record(patch: str, backend: str, result: dict) -> None:
    """Add one record: read, update and replace the file under a lock, so parallel verify runs keep theirs."""
    path = _path()
    config.private_dir(path.parent)
    with FileLock(str(path.with_name(path.name + ".lock"))):
        records = load()
        records[_key(patch, backend)] = result
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(records, indent=1, sort_keys=True))
        os.replace(temporary, path)


def passed(patch: str, backend: str) -> bool:
    return load().get(_key(patch, backend), {}).get("passed") is True

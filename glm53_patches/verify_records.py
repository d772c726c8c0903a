"""Which (patch, backend, mlx, mlx-vlm, patch code) combinations passed `verify` on this machine.

The code digest covers the patch's folder and the modules it declares it
``uses``: a record made for older code does not admit changed code to
``all``, and an edit elsewhere voids no record.
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

def _path():
    return config.state_dir() / "verified.json"


def code_digest(patch) -> str:
    """SHA-256 (12 hex digits) of the patch's folder and of what it declares it `uses` (Patch.source_files)."""
    if isinstance(patch, str):
        from . import registry

        patch = registry.available()[patch]
    files = []
    for label, path in patch.source_files():
        info = path.stat()
        files.append((label, str(path), info.st_mtime_ns, info.st_size))
    return _digest(tuple(files))


@functools.lru_cache(maxsize=256)
def _digest(files) -> str:
    """Keyed by each file's stat, so an edited file is hashed again."""
    digest = hashlib.sha256()
    for label, path, _, _ in files:
        digest.update(label.encode() + b"\0" + Path(path).read_bytes())
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

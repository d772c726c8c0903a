"""The package's logger, and log-once: a condition met on every call is said once per process."""

import logging
import sys
import threading

log = logging.getLogger("glm53_patches")
if not log.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("glm53-patches %(levelname)s: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False

_said = set()
_lock = threading.Lock()


def once(level: int, message: str, key=None, logger: logging.Logger = log) -> bool:
    """Log ``message`` unless ``key`` (default: the message) was logged before; True if it was logged now."""
    key = message if key is None else key
    with _lock:
        if key in _said:
            return False
        _said.add(key)
    logger.log(level, message)
    return True


def forget() -> None:
    """Say everything again (on revert, and in tests)."""
    with _lock:
        _said.clear()

"""Whether a patch's GPU kernel runs: its GLM53_<PATCH>_KERNEL knob, else this backend's verify record.

``auto`` (the default) runs the kernel on a backend where `glm53-patches
verify <patch>` passed on this machine for these mlx / mlx-vlm versions;
``1`` runs it on any GPU backend, ``0`` never. A bad value is logged once,
naming the variable, and keeps the kernel off. The decision is made once per
backend and process (``clear`` forgets it; ``forcing`` overrides it).
A patch whose fast path is not a kernel names its own knob and backends
(dequantized_experts: GLM53_DEQUANTIZED_EXPERTS_FAST_PATH, the CPU too, and
``auto`` never on Metal, where its speed is unmeasured).
"""

import contextlib
import logging

from . import config, verify_records

log = logging.getLogger("glm53_patches")

_VALUES = {"auto": None, "1": True, "on": True, "true": True, "force": True, "0": False, "off": False, "false": False}
ACCEPTED = "auto (where `glm53-patches verify` passed), 1/on/force, 0/off"


def _parse(value):
    lowered = value.strip().lower()
    if lowered not in _VALUES:
        raise ValueError(f"accepted: {ACCEPTED}")
    return _VALUES[lowered]


class KernelSwitch:
    def __init__(self, patch: str, backends=("cuda", "metal"), knob="kernel", auto_backends=None):
        self.patch, self.backends, self.knob = patch, backends, knob  # backends: where it can run at all
        self.auto_backends = backends if auto_backends is None else auto_backends  # where `auto` may run it
        self._decision = {}  # backend -> bool
        self._forced = None

    def wanted(self, backend) -> bool:
        """Does the kernel run on ``backend`` (one of ``backends``; never elsewhere)?"""
        if backend not in self.backends:
            return False
        if self._forced is not None:
            return self._forced
        if backend not in self._decision:
            setting, error = config.knob(self.patch, self.knob, _parse, None)
            if error:
                log.error(f"{self.patch}: {error}; the kernel stays off")
                setting = False
            if setting is None:
                setting = backend in self.auto_backends and verify_records.passed(self.patch, backend)
            self._decision[backend] = bool(setting)
        return self._decision[backend]

    def clear(self):
        self._decision.clear()

    @contextlib.contextmanager
    def forcing(self, on):
        """Within the block the kernel runs (True), never runs (False) or follows the setting (None)."""
        previous, self._forced = self._forced, on
        try:
            yield
        finally:
            self._forced = previous

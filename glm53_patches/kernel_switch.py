"""Whether a patch's GPU kernel runs: its GLM53_<PATCH>_KERNEL knob, else this backend's verify record.

``auto`` (the default) runs the kernel on a backend where `glm53-patches
verify <patch>` passed on this machine for these mlx / mlx-vlm versions;
on (``1``) runs it on any GPU backend, off (``0``) never. A bad value is logged once,
naming the variable, and keeps the kernel off. The decision is made once per
backend and process (``clear`` forgets it; ``forcing`` overrides it).
A patch whose fast path is not a kernel names its own knob and backends
(dequantized_experts: GLM53_DEQUANTIZED_EXPERTS_FAST_PATH, the CPU too, and
``auto`` never on Metal, where its speed is unmeasured).
"""

import contextlib
import logging

from . import config, verify_records
from .log import once

KNOB = config.switch()  # what every such knob accepts; declare it in the patch's `knobs`


class KernelSwitch:
    def __init__(self, patch: str, backends=("cuda", "metal"), knob="kernel", auto_backends=None):
        self.patch, self.backends, self.knob = patch, backends, knob  # backends: where it can run at all
        self.auto_backends = backends if auto_backends is None else auto_backends  # where `auto` may run it
        self._decision = {}  # backend -> bool
        self._forced = None

    def wanted(self, backend) -> bool:
        """Does the kernel run on ``backend`` (one of ``backends``; never elsewhere)?"""
        if backend not in self.backends:
            if config.knob(self.patch, self.knob, KNOB, None)[0]:
                once(logging.INFO, f"{config.knob_variable(self.patch, self.knob)} is on, but {self.patch} has "
                     f"no fast path on {backend} (only {', '.join(self.backends)}): the stock path runs")
            return False
        if self._forced is not None:
            return self._forced
        if backend not in self._decision:
            setting, error = config.knob(self.patch, self.knob, KNOB, None)
            if error:
                what = "the kernel" if self.knob == "kernel" else f"its {self.knob.replace('_', ' ')}"
                once(logging.ERROR, f"{self.patch}: {error}; {what} stays off")
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

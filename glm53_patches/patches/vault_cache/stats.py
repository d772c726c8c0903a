"""Counters of the vault, published with the patch's status.

``hits`` counts served entries by tier (``disk``, ``memory``), sealed writes
(``write``), and weight files fingerprinted (``weights_hashed``) or taken from
the fingerprint cache (``weights_cached``). ``fallbacks`` counts every time the
stock cold path ran: ``miss``, ``refused:<reason>``, ``skipped:<reason>``.
``bytes`` adds byte totals (``written``, ``read``, ``refused``) that ``hits``
cannot carry, and ``on_disk``: the size of the SSD tier when last looked at.
``notes`` says, per model directory, why its disk tier is off (memory only).
"""

from collections import Counter

from glm53_patches.stats import Stats


class VaultStats(Stats):
    def __init__(self):
        super().__init__()
        self._bytes = Counter()
        self._notes = {}

    def add_bytes(self, what, amount):
        with self._lock:
            self._bytes[what] += int(amount)

    def set_bytes(self, what, amount):
        with self._lock:
            self._bytes[what] = int(amount)

    def note(self, key, text):
        with self._lock:
            self._notes[str(key)] = str(text)

    def snapshot(self):
        snapshot = super().snapshot()
        with self._lock:
            snapshot["bytes"] = dict(self._bytes)
            snapshot["notes"] = dict(self._notes)
        return snapshot

    def reset(self):
        super().reset()
        with self._lock:
            self._bytes.clear()
            self._notes.clear()

"""Hit and fallback counters: the proof that a fast path really ran."""

import threading
from collections import Counter


class Stats:
    """Thread-safe counts of fast-path hits and of stock fallbacks by reason."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hits = Counter()
        self._fallbacks = Counter()

    def hit(self, what="call"):
        with self._lock:
            self._hits[what] += 1

    def fallback(self, reason):
        with self._lock:
            self._fallbacks[reason] += 1

    def snapshot(self):
        with self._lock:
            return {"hits": dict(self._hits), "fallbacks": dict(self._fallbacks)}

    @property
    def hits(self):
        with self._lock:
            return sum(self._hits.values())

    def reset(self):
        with self._lock:
            self._hits.clear()
            self._fallbacks.clear()

"""layer_decode's counters: per-layer hits tallied by the decode loop with no call per layer.

The loop adds one to a plain attribute of the layer's entry (``Tally``);
``snapshot`` folds the live tallies in. A tally that is dropped (the model,
or which patches are applied, changed) is folded in for good first.
"""

import threading
from collections import Counter

from glm53_patches.stats import Stats


class Tally:
    """Hits of one layer kind in one plan: ``hits`` is bumped in place by the decode loop."""

    __slots__ = ("kind", "hits")

    def __init__(self, kind):
        self.kind, self.hits = kind, 0


class LayerStats(Stats):
    def __init__(self):
        super().__init__()
        self._live = []  # the Tally objects of the current plans
        self._live_lock = threading.Lock()

    def attach(self, tallies):
        with self._live_lock:
            self._live.extend(tallies)

    def detach(self, tallies):
        """Fold ``tallies`` into the permanent counts and stop reading them."""
        with self._live_lock:
            for tally in tallies:
                if tally in self._live:
                    self._live.remove(tally)
                    self._add(tally.kind, tally.hits)

    def _add(self, what, n):
        if n:
            with self._lock:
                self._hits[what] += n

    def snapshot(self):
        snapshot = super().snapshot()
        live = Counter()
        with self._live_lock:
            for tally in self._live:
                live[tally.kind] += tally.hits
        hits = Counter(snapshot["hits"])
        hits.update({kind: n for kind, n in live.items() if n})
        snapshot["hits"] = dict(hits)
        return snapshot

    @property
    def hits(self):
        return sum(self.snapshot()["hits"].values())

    def reset(self):
        super().reset()
        with self._live_lock:
            for tally in self._live:
                tally.hits = 0

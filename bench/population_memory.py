"""Peak resident memory of this process and all its descendants (the TFF worker
processes), sampled in a background thread while a `with` block runs.

Used by `bench_population` (issue 41, item 4): the TFF workers are separate processes,
so this process's own peak (ru_maxrss) would miss most of a round's memory.
"""

from __future__ import annotations

import threading

import psutil

# Sampling period: rounds last seconds, memory moves with them.
_PERIOD_S = 0.2


def tree_rss_bytes(process: psutil.Process) -> int:
    """Resident bytes of `process` and its live descendants now (those that exit while
    being read count as zero)."""
    total = 0
    for member in (process, *process.children(recursive=True)):
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class PeakRss:
    """`with PeakRss() as peak: ...` then `peak.bytes`: the largest process-tree RSS seen."""

    def __init__(self) -> None:
        self.bytes = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss_bytes(self._process))
            if self._stop.wait(_PERIOD_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss_bytes(self._process))

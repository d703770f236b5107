"""Peak resident memory of a process and all its descendants, sampled in a background
thread while a `with` block runs.

The benchmarks' work runs in several processes (TFF worker binaries beside the training
process, a data job's runner), so one process's own peak (ru_maxrss) misses most of it.
Used by `bench_speed` and `bench_population` (this process and its TFF workers) and
`bench_data_scale` (a child `dp-fedemb data` process and its descendants).
"""

from __future__ import annotations

import threading

import psutil

# Sampling period: rounds and stages last seconds, memory moves with them.
_PERIOD_S = 0.2


def tree_rss(process: psutil.Process) -> tuple[int, int, int]:
    """(resident bytes of `process` itself now, of its live descendants, how many
    processes); (0, 0, 0) once `process` has ended, and a descendant that ends while being
    read counts zero."""
    try:
        own = process.memory_info().rss
        descendants = process.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0, 0
    total = 0
    for member in descendants:
        try:
            total += member.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return own, total, 1 + len(descendants)


class PeakRss:
    """`with PeakRss(pid) as peak: ...` then `peak.bytes`, the largest process-tree RSS
    seen, `peak.own_bytes` and `peak.descendants_bytes` the largest of each part (not
    necessarily at the same moment), and `peak.processes`, the most processes the tree
    held; `pid` None: this process."""

    def __init__(self, pid: int | None = None) -> None:
        self.bytes = 0
        self.own_bytes = 0
        self.descendants_bytes = 0
        self.processes = 0
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _record(self) -> None:
        own, descendants, processes = tree_rss(self._process)
        self.bytes = max(self.bytes, own + descendants)
        self.own_bytes = max(self.own_bytes, own)
        self.descendants_bytes = max(self.descendants_bytes, descendants)
        self.processes = max(self.processes, processes)

    def _sample(self) -> None:
        while True:
            self._record()
            if self._stop.wait(_PERIOD_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record()

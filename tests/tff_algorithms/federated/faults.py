"""Faults for the worker-loss tests: an action taken while a worker computes a round.

"Mid-round" is observed, not timed: after the round before has ended (the job's
progress callback), the action waits until the worker process has spent CPU time again,
which an idle worker_binary does not, so it is computing the next round.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

# An idle worker_binary spends no CPU; a worker training its clients spends seconds.
BUSY_TICKS = 3
# Every wait has a bound: a worker that does no work for this long fails the test.
WAIT_BOUND_S = 600.0


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of `pid`, in clock ticks (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


class MidRound:
    """Runs `action` once, on a thread, as soon as `pid` works after `arm()`.

    `done` is set when the action ran; `error` holds why it did not (the bound passed).
    """

    def __init__(self, action: Callable[[], None]) -> None:
        self._action = action
        self.done = threading.Event()
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def arm(self, pid: int) -> None:
        if self._thread is not None:
            return
        start = cpu_ticks(pid)
        self._thread = threading.Thread(target=self._wait, args=(pid, start), daemon=True)
        self._thread.start()

    def _wait(self, pid: int, start: int) -> None:
        deadline = time.monotonic() + WAIT_BOUND_S
        try:
            while cpu_ticks(pid) - start < BUSY_TICKS:
                if time.monotonic() > deadline:
                    self.error = f"worker pid {pid} did no work for {WAIT_BOUND_S:.0f} s"
                    return
                time.sleep(0.01)
        except FileNotFoundError:
            self.error = f"worker pid {pid} ended before the fault"
            return
        self._action()
        self.done.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(WAIT_BOUND_S)
        assert self.error is None, self.error
        assert self.done.is_set(), "the fault was never armed or never ran"


def signal_pid(pid: int, signum: int) -> Callable[[], None]:
    return lambda: os.kill(pid, signum)

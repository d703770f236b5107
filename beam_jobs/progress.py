"""Progress lines of long Beam jobs: how far a stage has come, on stderr.

Between its start and its end a Beam job shows nothing: at 10^5 users dedup ran 49
minutes without a line (BENCHMARKS.md, "Data jobs at 10^4-10^6 users"). `Progress` is a
pass-through step placed after a job's long stages. It counts what flows through it in
the process that runs it and, at most every `every_seconds`, writes one line such as

    dedup: train images fingerprinted 120,000 of 320,000 (37%), 1,850/s, 1 min 4 s, 1 min 48 s left

The time left assumes the rest goes at the rate so far (a stage's elements are alike:
batches of images, users' records). The jobs' long stages give their totals: the
callers count what they will read first (records in files, an image folder's user
folders, a SQLite file's rows) or know the number by construction (key buckets, shards).

The first line comes `every_seconds` after the stage's first element, so a job shorter
than that prints nothing. Counts are per process: on a runner with several worker
processes (the DirectRunner's multi_processing mode, Flink, Dataflow) each reports its
own share and its line names its process id. The same count is also a Beam counter
(`Metrics.counter("progress", <what>)`), which a runner's monitoring shows.

`DP_FEDEMB_PROGRESS_SECONDS` sets `every_seconds` for every stage (default 30). Lines go
to stderr, or where `lines_to` points them for the jobs this process runs in its own
threads (`dp-fedemb run` prints them with its component lines, on stdout).

Imports Beam and the standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import apache_beam as beam

EVERY_SECONDS_ENV = "DP_FEDEMB_PROGRESS_SECONDS"
DEFAULT_EVERY_SECONDS = 30.0


def every_seconds_from_env() -> float:
    """Seconds between a stage's lines, from `DP_FEDEMB_PROGRESS_SECONDS` (default 30)."""
    text = os.environ.get(EVERY_SECONDS_ENV, "")
    if not text:
        return DEFAULT_EVERY_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise ValueError(
            f"{EVERY_SECONDS_ENV}={text!r}: give seconds between progress lines, 0 or more"
        )
    return seconds


@dataclasses.dataclass
class _Count:
    seen: int = 0
    started: float = 0.0
    last_line: float = 0.0


# One count per stage of one pipeline construction and process, shared by the stage's
# DoFn instances (a runner may run several bundles of a stage at once in threads).
_COUNTS: dict[str, _Count] = {}
_LOCK = threading.Lock()
_STDERR = object()
_output: Any = _STDERR


@contextlib.contextmanager
def lines_to(stream: TextIO | None) -> Iterator[None]:
    """Inside, the progress lines this process writes go to `stream` (None: nowhere)."""
    global _output
    previous, _output = _output, stream
    try:
        yield
    finally:
        _output = previous


def _write(line: str) -> None:
    stream = sys.stderr if _output is _STDERR else _output
    if stream is not None:
        stream.write(line + "\n")
        stream.flush()


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {seconds} s"
    return f"{seconds} s"


def progress_line(
    job: str, what: str, seen: int, total: int | None, seconds: float, pid: int | None
) -> str:
    """One progress line (module docstring); `pid` names a worker process, None the
    process that built the pipeline. With a total, the time left at the rate so far."""
    count = f"{seen:,}"
    left = ""
    if total:
        count += f" of {total:,} ({100 * seen // total}%)"
        if 0 < seen < total:
            left = f", {_duration(seconds * (total - seen) / seen)} left"
    per_second = seen / seconds if seconds > 0 else None
    # Slow stages (a batch every few seconds) keep two digits instead of showing 0/s.
    if per_second is None:
        rate = "-"
    elif per_second >= 10:
        rate = f"{per_second:,.0f}/s"
    else:
        rate = f"{per_second:.2g}/s"
    where = f" [worker process {pid}]" if pid is not None else ""
    return f"{job}: {what} {count}, {rate}, {_duration(seconds)}{left}{where}"


class _CountFn(beam.DoFn):
    def __init__(
        self,
        key: str,
        job: str,
        what: str,
        total: int | None,
        every_seconds: float,
        weight: Callable[[Any], int] | None,
        origin_pid: int,
    ):
        self._key, self._job, self._what, self._total = key, job, what, total
        self._every, self._weight, self._origin_pid = every_seconds, weight, origin_pid
        self._counter = beam.metrics.Metrics.counter("progress", f"{job}: {what}")

    def process(self, element):
        amount = 1 if self._weight is None else int(self._weight(element))
        self._counter.inc(amount)
        now = time.monotonic()
        with _LOCK:
            count = _COUNTS.setdefault(self._key, _Count(started=now, last_line=now))
            count.seen += amount
            due = now - count.last_line >= self._every
            if due:
                count.last_line = now
                seen, started = count.seen, count.started
        if due:
            pid = os.getpid()
            line = progress_line(
                self._job,
                self._what,
                seen,
                self._total,
                now - started,
                None if pid == self._origin_pid else pid,
            )
            _write(line)
        yield element


class Progress(beam.PTransform):
    """Passes its input through unchanged and reports how much has passed (module
    docstring).

    Args:
      job: the job's name, first on the line ("dedup").
      what: what is counted, past tense ("train images fingerprinted").
      total: how many there will be, when the caller knows it (adds "of N (p%)").
      weight: how many counted things an element holds (e.g. `len` of a batch); None: 1.
      every_seconds: at most one line per this many seconds; None: from
        `DP_FEDEMB_PROGRESS_SECONDS`.
    """

    def __init__(
        self,
        job: str,
        what: str,
        total: int | None = None,
        weight: Callable[[Any], int] | None = None,
        every_seconds: float | None = None,
    ):
        super().__init__()
        if total is not None and total < 0:
            raise ValueError(f"progress total must be 0 or more, got {total}")
        self._job, self._what, self._total, self._weight = job, what, total, weight
        self._every = every_seconds_from_env() if every_seconds is None else every_seconds
        if not self._every >= 0:
            raise ValueError(f"every_seconds must be 0 or more, got {every_seconds}")
        # A fresh key per construction: two runs in one process never share a count.
        self._key = uuid.uuid4().hex

    def expand(self, pcoll):
        return pcoll | "Count" >> beam.ParDo(
            _CountFn(
                self._key,
                self._job,
                self._what,
                self._total,
                self._every,
                self._weight,
                os.getpid(),
            )
        )

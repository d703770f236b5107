"""What a `dp-fedemb` command shows on its console: its own lines, not its libraries'.

TensorFlow's C++ start-up lines, Google libraries' Python-version FutureWarnings, gRPC's
fork notices and TFX's known-harmless warnings are written straight to file descriptor 2,
by C++ code and by child processes as well as by Python, so they are filtered there:
`QuietStderr` points descriptor 2 at a pipe, a thread copies every line to the full log
and passes on only the lines that match no pattern in `KNOWN_NOISE`. Python warnings go to
the full log only. The full log is kept in memory until the command knows its output
directory (`keep_log_in`); its path is printed once. DP_FEDEMB_VERBOSE=1 turns the
filter off.

Only lines on the known-noise list are held back from the console, so an error nobody
has seen before still reaches the user.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import TextIO

# Lines that say nothing to a user of this product (each seen in `make run` output).
KNOWN_NOISE: tuple[re.Pattern[str], ...] = tuple(
    re.compile(pattern)
    for pattern in (
        # TensorFlow's C++ start-up on a machine without GPU, TensorRT or AVX builds.
        r"tensorflow/.*Unable to register (cuDNN|cuFFT|cuBLAS) factory",
        r"tensorflow/tsl/cuda/cudart_stub\.cc.*Could not find cuda drivers",
        r"tensorflow/core/platform/cpu_feature_guard\.cc",
        r"^To enable the following instructions: .* rebuild TensorFlow",
        r"TF-TRT Warning: Could not find TensorRT",
        r"tensorflow/core/util/port\.cc.*oneDNN custom operations are on",
        # Grappler on a SavedModel signature without fetch nodes (export, evaluation).
        r"grappler_item_builder\.cc.*Failed to detect the fetch node\(s\), skipping this input",
        # tf.data's background optimisation, cancelled when a dataset is dropped before
        # it finishes (seen on a loaded machine only).
        r"tensorflow/core/data/root_dataset\.cc:\d+\] Optimization loop failed: CANCELLED",
        # libjpeg, asked for a conversion it lacks (a CMYK JPEG to one channel): the
        # decoder's own error says so, and the command's error line names the image.
        r"^Unsupported color conversion request$",
        # absl and gRPC in forked children (Beam, TFF workers).
        r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
        r"^I0000 00:00:.*fork_posix\.cc",
        r"Other threads are currently calling into gRPC, skipping fork\(\) handlers",
        # Python warnings printed by child processes (ours go to the log directly).
        r"^\S+\.py:\d+: (FutureWarning|DeprecationWarning|UserWarning|RuntimeWarning): ",
        r"^  warnings\.warn\(",
        # TensorFlow's kernel log of a write that failed on a full disk, a quota or a
        # read-only file system (checkpoint, export): the command's error line names the
        # file and the fix.
        r"tensorflow/core/framework/op_kernel\.cc.*OP_REQUIRES failed at .*"
        r"(No space left on device|Disk quota exceeded|Read-only file system)",
        # TFX 1.15 on a local ML Metadata store, every run.
        r"ArtifactQuery\.property_predicate is not supported",
        r"artifact does not have payload_format",
    )
)
LOG_DIR = "logs"
# Set (to anything) to see every line on the console, unfiltered.
VERBOSE_ENV = "DP_FEDEMB_VERBOSE"
_KEPT_IN_MEMORY = 20_000  # lines of log kept before the output directory is known


def is_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in KNOWN_NOISE)


class QuietStderr:
    """Context manager: descriptor 2 filtered (module docstring) while it is active.

    Re-entrant use is a no-op (a command run inside another command's filter)."""

    _active: QuietStderr | None = None

    def __init__(self) -> None:
        self._saved_fd: int | None = None  # descriptor 2 as it was, restored on exit
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._memory: list[str] = []
        self._log: TextIO | None = None
        self._log_warning: str | None = None
        self._saved_showwarning = None
        self.log_path: str | None = None

    def __enter__(self) -> QuietStderr:
        if QuietStderr._active is not None or os.environ.get(VERBOSE_ENV):
            return QuietStderr._active or self
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        self._saved_fd = os.dup(2)
        # The thread's own copy of the console: it outlives __exit__ while children
        # that inherited the pipe still write to it.
        console_fd = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._thread = threading.Thread(target=self._copy, args=(read_fd, console_fd), daemon=True)
        self._thread.start()
        self._saved_showwarning = warnings.showwarning
        warnings.showwarning = self._warning_to_log
        QuietStderr._active = self
        return self

    def __exit__(self, *exc_info) -> None:
        if QuietStderr._active is not self:
            return
        QuietStderr._active = None
        warnings.showwarning = self._saved_showwarning
        sys.stderr.flush()
        # Descriptor 2 back to the terminal: the pipe's last writer here is closed, so
        # the thread ends when child processes that inherited it have ended too.
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        # Until the pipe is drained; a child still holding it only delays the exit this long.
        self._thread.join(timeout=5.0)
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None

    def _warning_to_log(self, message, category, filename, lineno, file=None, line=None):
        self._record(warnings.formatwarning(message, category, filename, lineno, line))

    def _record(self, text: str) -> None:
        with self._lock:
            if self._log is not None:
                try:
                    self._log.write(text)
                    self._log.flush()
                except OSError as e:
                    # A full disk must not end the command (the log is a copy of what
                    # it printed): the log stops here, and says so where it can.
                    self._log_failed(e)
            elif len(self._memory) < _KEPT_IN_MEMORY:
                self._memory.append(text)

    def _log_failed(self, error: OSError) -> None:
        log, self._log = self._log, None
        with contextlib.suppress(OSError):
            log.close()
        # Shown by the copying thread, which owns a descriptor of the console.
        self._log_warning = (
            f"dp-fedemb: warning: the full log {self.log_path} stops here: "
            f"{error.strerror or type(error).__name__}\n"
        )

    def _show_log_warning(self, console_fd: int) -> None:
        with self._lock:
            warning, self._log_warning = self._log_warning, None
        if warning:
            os.write(console_fd, warning.encode())

    def _copy(self, read_fd: int, console_fd: int) -> None:
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace", newline="") as pipe:
            for line in pipe:
                self._record(line)
                if not is_noise(line):
                    os.write(console_fd, line.encode("utf-8", "replace"))
                self._show_log_warning(console_fd)
        self._show_log_warning(console_fd)
        os.close(console_fd)

    def keep_log_in(self, output_dir: str, command: str) -> str:
        """Writes the full log so far to OUTPUT/logs/<command>-<UTC time>.log and streams
        the rest there; returns its path."""
        directory = os.path.join(output_dir, LOG_DIR)
        os.makedirs(directory, exist_ok=True)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = os.path.join(directory, f"{command}-{stamp}-{os.getpid()}.log")
        with self._lock:
            self._log = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed on exit
            self._log.writelines(self._memory)
            self._log.flush()
            self._memory = []
        self.log_path = path
        return path


class LogFileHandler(logging.Handler):
    """A logging handler writing to the active command's full log (nothing outside one):
    what the console leaves out, e.g. TFX's INFO lines, stays findable there."""

    def __init__(self, level: int = logging.INFO):
        super().__init__(level=level)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        active = QuietStderr._active
        if active is not None:
            active._record(self.format(record) + "\n")


# Libraries that log an error's traceback before raising it (Beam's bundle runner): the
# command's one error line says what failed, the full log keeps the traceback.
_LOGGED_TO_FILE_ONLY = ("apache_beam",)


@contextlib.contextmanager
def library_logs_to_file_only(names: tuple[str, ...] = _LOGGED_TO_FILE_ONLY) -> Iterator[None]:
    """While a command runs: the named loggers write to its full log only."""
    handler = LogFileHandler(level=logging.DEBUG)
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate


def keep_log_in(output_dir: str, command: str) -> None:
    """Inside a command's QuietStderr: keep its full log under OUTPUT/logs/ and say where,
    once. Outside one (a command called in-process by a test): nothing to keep."""
    active = QuietStderr._active
    if active is not None and active.log_path is None:
        try:
            path = active.keep_log_in(output_dir, command)
        except OSError as e:
            # What the command wrote stands; only the copy of its log is missing.
            print(
                f"dp-fedemb {command}: warning: could not keep the full log under "
                f"{os.path.join(output_dir, LOG_DIR)} ({e.strerror or type(e).__name__})",
                file=sys.stderr,
                flush=True,
            )
            return
        print(f"dp-fedemb {command}: full log in {path}", flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class RoundProgress:
    """Prints each training round as it ends: round/total, its seconds, ε spent so far,
    the last validation recall and the time left. On a terminal the line updates in
    place; piped (a log file, a CI job, a pipeline task's log), one line a round.

    Called with the job's history records (tff_algorithms.jobs.train_job's `progress`)."""

    RECALL_FAR = "0.001"

    def __init__(self, total_rounds: int, label: str = "", stream: TextIO | None = None):
        self._total = total_rounds
        self._label = f"{label} " if label else ""
        self._stream = stream
        self._seconds: list[float] = []
        self._recall: float | None = None

    def line(self, record) -> str:
        round_number = int(record["round"])
        self._seconds.append(float(record["round_seconds"]))
        if "eval" in record:
            self._recall = float(record["eval"]["recall_at_far"][self.RECALL_FAR])
        epsilon = float(record["epsilon"])
        # Recent rounds predict the rest best (the first carries tracing).
        recent = self._seconds[-10:]
        left = max(self._total - round_number, 0) * sum(recent) / len(recent)
        parts = [
            f"{self._label}round {round_number}/{self._total}",
            f"{self._seconds[-1]:.2f}s",
            f"ε {epsilon:.4g}" if epsilon != float("inf") else "ε inf (non-private)",
        ]
        if self._recall is not None:
            parts.append(f"recall@FAR=1e-3 {self._recall:.4f}")
        parts.append(f"{_duration(left)} left")
        return "  ".join(parts)

    def __call__(self, record) -> None:
        stream = self._stream or sys.stdout
        text = self.line(record)
        if stream.isatty():
            end = "\n" if int(record["round"]) >= self._total else ""
            stream.write(f"\r\x1b[K{text}{end}")
        else:
            stream.write(text + "\n")
        stream.flush()


def note(text: str) -> None:
    """One indented line of what a pipeline component found (records read, copies
    removed, users scheduled), printed before its "[i/n] ... done" line."""
    print(f"    {text}", flush=True)

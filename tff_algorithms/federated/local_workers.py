"""Local TFF workers: `worker_binary` child processes this process owns, on loopback only.

Each local worker dies with the process that started it, even on SIGKILL (Linux
`PR_SET_PDEATHSIG`), writes to a log file (never the parent's pipes), and listens on
127.0.0.1 only. The runtime (`runtime.py`) starts, connects to, restarts and stops them.

Why the loopback worker (issue 19). worker_binary serves insecure, unauthenticated
gRPC, and whoever reaches it can run TF graphs that read the private data, the
checkpoints and the seeds. The options weighed:

* an in-process C++ executor stack, no worker process: TFF 0.87's pip package ships
  no `executor_bindings` (no extension module at all); its own local factory
  (`executor_factory.local_cpp_executor_factory`) starts worker_binary too;
* a Unix domain socket, or a listen-address flag: worker_binary's flags are `--port`,
  `--max_concurrent_computation_calls` and `--grpc_max_message_length_megabytes`; it
  always listens on "[::]:port";
* its own network namespace: needs unprivileged user namespaces (off under Docker's
  and Kubernetes' default seccomp profile, restricted on recent Ubuntu) and a relay
  process between a socket the trainer can reach and the worker's namespace;
* the worker bound to loopback, chosen: `loopback_shim`, preloaded into worker_binary,
  turns its wildcard bind into a 127.0.0.1 bind. The worker stays the same single
  child process, so every guarantee above holds unchanged. What changes: starting a
  local worker needs a C compiler once (the shim is built and cached on first use;
  without one the runtime refuses to start local workers and names the fix), and the
  runtime refuses a worker that runs without the shim. Loopback is reachable by other
  users of the same host; on a shared host, run training in its own container or VM.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Collection

import portpicker
import tensorflow_federated as tff

from tff_algorithms.federated import loopback_shim

WORKER_BINARY = os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")
_PR_SET_PDEATHSIG = 1


class WorkerStartError(RuntimeError):
    """A worker did not become ready; the message carries the end of its log."""


def worker_flags(port: int, max_concurrent_computation_calls: int) -> list[str]:
    """worker_binary's flags as the runtime starts it; deploy/ starts it the same way
    (tests/repo/test_deploy.py compares them)."""
    return [
        f"--port={port}",
        f"--max_concurrent_computation_calls={max_concurrent_computation_calls}",
    ]


def die_with_parent() -> None:
    """Runs in the worker child before exec: SIGKILL it when its parent dies, and
    default SIGINT handling, which `stop` relies on (a parent started as a background
    job without job control inherits SIGINT ignored, and so would the worker)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.signal(signal.SIGINT, 0)  # SIG_DFL; async-signal-safe, unlike Python's signal()


class LocalWorker:
    """One `worker_binary` child process, listening on and reached at 127.0.0.1 only.

    worker_binary has no bind-address flag and would listen on every interface, with
    no authentication; the preloaded `loopback_shim` library turns that bind into a
    loopback one, and `check_loopback_only` refuses a worker it is not loaded into.
    """

    def __init__(
        self,
        log_dir: str,
        max_concurrent_computation_calls: int,
        taken_ports: Collection[int] = (),
        intra_op_threads: int = 0,
    ) -> None:
        # A port picked for a sibling worker that has not bound it yet looks free.
        self.port = portpicker.pick_unused_port()
        while self.port in taken_ports:
            self.port = portpicker.pick_unused_port()
        self.log_path = os.path.join(log_dir, f"worker_{self.port}.log")
        argv = [WORKER_BINARY, *worker_flags(self.port, max_concurrent_computation_calls)]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        self._log.flush()
        self.shim_path = loopback_shim.library_path()
        preload = " ".join(filter(None, [self.shim_path, os.environ.get("LD_PRELOAD")]))
        env = {**os.environ, "LD_PRELOAD": preload}
        if intra_op_threads:
            env["TF_NUM_INTRAOP_THREADS"] = str(intra_op_threads)
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
            close_fds=True,
            env=env,
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def check_loopback_only(self) -> None:
        """Raises WorkerStartError unless the loopback shim is mapped into the worker:
        the dynamic loader only warns, in the worker's log, about a preload it cannot
        load, and the worker would then listen on every interface."""
        with open(f"/proc/{self.process.pid}/maps") as maps:
            if self.shim_path not in maps.read():
                raise WorkerStartError(
                    f"worker_binary pid {self.process.pid} runs without {self.shim_path}, "
                    f"so it may listen on every interface; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )

    def log_tail(self, max_bytes: int = 2000) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stops the worker; True when it was still running and exited on SIGINT."""
        clean = self.process.poll() is None
        if clean:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                clean = False
                self.process.kill()
                self.process.wait()
        self._log.close()
        return clean


def wait_ready(
    stub: tff.framework.RemoteExecutorGrpcStub,
    address: str,
    timeout_s: float,
    worker: LocalWorker | None,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not stub.is_ready:
        if worker is not None and worker.process.poll() is not None:
            raise WorkerStartError(
                f"worker_binary at {address} exited with code {worker.process.returncode}; "
                f"log {worker.log_path}:\n{worker.log_tail()}"
            )
        if time.monotonic() > deadline:
            tail = f"; log {worker.log_path}:\n{worker.log_tail()}" if worker else ""
            raise WorkerStartError(
                f"TFF worker at {address} not ready after {timeout_s:.0f}s{tail}"
            )
        time.sleep(0.1)


# Local workers' logs: TEMP/dp_fedemb_tff_<pid>_<random>/, removed when the workers
# stop cleanly, kept (and named in a warning) when one failed.
TEMP_LOG_PREFIX = "dp_fedemb_tff_"
_KILLED_RUN_LOGS = re.compile(rf"^{TEMP_LOG_PREFIX}(\d+)_[A-Za-z0-9_]+$")


def remove_logs_of_killed_runs() -> None:
    """Removes the worker-log folders of runs killed before they could (SIGKILL, power
    loss): those whose process is gone and that hold only worker logs."""
    temp = tempfile.gettempdir()
    for name in os.listdir(temp):
        match = _KILLED_RUN_LOGS.match(name)
        path = os.path.join(temp, name)
        if not match or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its process still runs
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        if all(n.endswith(".log") for n in os.listdir(path)):
            shutil.rmtree(path, ignore_errors=True)

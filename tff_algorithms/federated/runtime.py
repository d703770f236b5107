"""Owns TFF execution: the C++ `worker_binary` processes and the execution context.

TFF's default context starts a `worker_binary` whose cleanup lives in a `__del__`
that fails at interpreter shutdown, so the worker outlives Python and keeps the
parent's stdout/stderr open (docs/design.md section 1). `TffRuntime` replaces that:

* local workers are started here, with output to a log file (never our pipes);
* each local worker dies with the process that started it, even on SIGKILL
  (Linux `PR_SET_PDEATHSIG`), and is stopped on normal exit, on exceptions
  (context manager / `atexit`) and on SIGTERM/SIGINT;
* local workers listen on 127.0.0.1 only: no other host can reach them (see below);
* remote workers (addresses such as "10.0.0.5:8000", started by a cluster
  scheduler) are only connected to, never started or stopped (docs/design.md section 8),
  over mutual TLS: the runtime verifies the worker against a CA and presents a client
  certificate, which a TLS-terminating proxy in front of the worker checks
  (docs/scaling.md). A remote address that is not loopback is refused without TLS
  unless `allow_insecure_workers` says the network is isolated.

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

With one worker the context is TFF's synchronous remote-execution context. With
several, computations are compiled to mergeable form and each round's clients are
split across the workers (`MergeableCompExecutionContext`): each worker runs the
computation up to the aggregation on its share of the clients, the partial
aggregates are merged, and the rest (DP noise, server update) runs once on the merged
value. Results equal one worker's up to float32 summation order
(tests/tff_algorithms/federated/test_multi_worker.py); with three or more workers the partial sums merge in the
order workers finish, so the last bits can vary between runs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import gc
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from types import FrameType

import grpc
import portpicker
import tensorflow_federated as tff
from absl import logging
from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import (
    tensorflow_computation,
)

from tff_algorithms.base import validation
from tff_algorithms.federated import loopback_shim

WORKER_BINARY = os.path.join(os.path.dirname(tff.__file__), "data", "worker_binary")

_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_CHANNEL_OPTIONS = (
    ("grpc.max_message_length", _GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _GRPC_MAX_MESSAGE_BYTES),
)
_PR_SET_PDEATHSIG = 1


class WorkerStartError(RuntimeError):
    """A worker did not become ready; the message carries the end of its log."""


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How training reaches its TFF workers.

    Attributes:
      worker_addresses: "host:port" of workers started elsewhere (e.g. by a cluster
        scheduler, docs/scaling.md). Empty means `local_workers` local workers
        started and owned by this process.
      local_workers: how many local workers to start when `worker_addresses` is
        empty. Two or more split each round's clients across them, as remote
        workers would (a single-host check of the multi-worker path; on one host
        it adds no compute, the one worker already uses every core).
      max_concurrent_computation_calls: per-worker limit on parallel calls of one
        computation (bounds memory when a round has many clients); <= 0 means
        unlimited. Applies to local workers; remote ones get it from their launcher.
      worker_intra_op_threads: threads one TensorFlow op of a local worker may use
        (`TF_NUM_INTRAOP_THREADS` in its environment); 0: TensorFlow's default, every
        core. The default 1 runs each op on one thread: a local step's kernels at batch
        8 are too small to split, and the worker runs many virtual clients at once, so
        their concurrent calls fill the cores instead (a default round about 30% faster
        on 2 cores, BENCHMARKS.md "Where a round's time goes"). Raise it when a round
        has fewer virtual clients than cores, or large local batches. Remote workers
        get it from their launcher (docs/scaling.md).
      default_num_clients: client cardinality used when TFF cannot infer it.
      log_dir: where local workers write their logs, kept. None: a temporary
        directory, removed at stop unless a worker ended abnormally (then kept and
        logged, for debugging).
      ready_timeout_s: how long to wait for a worker to accept calls.
      worker_ca: PEM file of the CA that signed the workers' (their TLS proxies')
        server certificates. With `worker_cert` and `worker_key`, remote workers are
        reached over mutual TLS; the three go together.
      worker_cert: PEM file of the client certificate presented to the workers.
      worker_key: PEM file of that certificate's private key.
      allow_insecure_workers: allow plaintext, unauthenticated gRPC to worker
        addresses that are not loopback; only for a network nothing else can reach.
    """

    worker_addresses: tuple[str, ...] = ()
    local_workers: int = 1
    max_concurrent_computation_calls: int = -1
    worker_intra_op_threads: int = 1
    default_num_clients: int = 0
    log_dir: str | None = None
    ready_timeout_s: float = 120.0
    worker_ca: str | None = None
    worker_cert: str | None = None
    worker_key: str | None = None
    allow_insecure_workers: bool = False

    @property
    def uses_tls(self) -> bool:
        return any(getattr(self, name) for name in _TLS_SETTINGS)

    def __post_init__(self) -> None:
        for address in self.worker_addresses:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address {address!r} is not of the form host:port")
        validation.check_int("local_workers", self.local_workers, 1)
        validation.check_int("worker_intra_op_threads", self.worker_intra_op_threads, 0)
        if self.worker_addresses and self.local_workers != 1:
            raise ValueError(
                "local_workers (--local-workers) and worker_addresses (--workers) exclude "
                "each other: give worker addresses or a number of local workers, not both"
            )
        if len(set(self.worker_addresses)) != len(self.worker_addresses):
            raise ValueError(f"worker addresses repeat: {', '.join(self.worker_addresses)}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be positive, got {self.ready_timeout_s}")
        if self.uses_tls:
            missing = [name for name in _TLS_SETTINGS if not getattr(self, name)]
            if missing:
                raise ValueError(
                    f"mutual TLS to the workers needs {', '.join(_TLS_SETTINGS)} together; "
                    f"missing {', '.join(missing)}"
                )
            if not self.worker_addresses:
                raise ValueError(
                    f"{', '.join(_TLS_SETTINGS)} apply to worker_addresses (--workers) only; "
                    "local workers listen on loopback"
                )
        elif not self.allow_insecure_workers:
            exposed = [a for a in self.worker_addresses if not _is_loopback(a)]
            if exposed:
                raise ValueError(
                    f"refusing plaintext gRPC to worker {exposed[0]}: whoever reaches its port "
                    "can run TF graphs that read the private data and the seeds; give "
                    "worker_ca, worker_cert and worker_key (--worker-ca, --worker-cert, "
                    "--worker-key) for mutual TLS, or set allow_insecure_workers "
                    "(--allow-insecure-workers) on an isolated network"
                )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The mutual-TLS credentials of the workers' channels, None without TLS.

        Reads the three files now (once per runtime start); a missing or unreadable
        file, or one that holds no PEM, is a ValueError naming its setting.
        """
        if not self.uses_tls:
            return None
        pem = {name: _read_pem(name, getattr(self, name)) for name in _TLS_SETTINGS}
        return grpc.ssl_channel_credentials(
            root_certificates=pem["worker_ca"],
            private_key=pem["worker_key"],
            certificate_chain=pem["worker_cert"],
        )


_TLS_SETTINGS = ("worker_ca", "worker_cert", "worker_key")


def _is_loopback(address: str) -> bool:
    """Whether a host:port names this host's loopback: localhost, 127.0.0.0/8 or ::1."""
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a DNS name: it may resolve anywhere
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _read_pem(setting: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{setting} {path}: {e.strerror or e}") from None
    # grpc would only fail the handshake later, as a worker that never gets ready.
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting} {path} holds no PEM data")
    return data


def _die_with_parent() -> None:
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
        argv = [
            WORKER_BINARY,
            f"--port={self.port}",
            f"--max_concurrent_computation_calls={max_concurrent_computation_calls}",
        ]
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
            preexec_fn=_die_with_parent,
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


def _wait_ready(
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


def _executor_factory(
    stub: tff.framework.RemoteExecutorGrpcStub, default_num_clients: int
) -> tff.framework.ResourceManagingExecutorFactory:
    def stack_fn(cardinalities: dict) -> tff.framework.RemoteExecutor:
        if cardinalities.get(tff.CLIENTS) is None:
            cardinalities[tff.CLIENTS] = default_num_clients
        executor = tff.framework.RemoteExecutor(stub)
        executor.set_cardinalities(cardinalities)
        return executor

    return tff.framework.ResourceManagingExecutorFactory(executor_stack_fn=stack_fn)


# Local workers' logs: TEMP/dp_fedemb_tff_<pid>_<random>/, removed when the workers
# stop cleanly, kept (and named in a warning) when one failed.
_TEMP_LOG_PREFIX = "dp_fedemb_tff_"
_KILLED_RUN_LOGS = re.compile(rf"^{_TEMP_LOG_PREFIX}(\d+)_[A-Za-z0-9_]+$")


def _remove_logs_of_killed_runs() -> None:
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


class TffRuntime:
    """Starts (or connects to) TFF workers and installs the execution context.

    Use as a context manager, or `start()`/`stop()`; `stop()` is idempotent and
    also registered with `atexit`.
    """

    def __init__(self, config: RuntimeConfig = RuntimeConfig()) -> None:
        self.config = config
        self.local_workers: list[LocalWorker] = []
        self.addresses: tuple[str, ...] = ()
        self._channels: list[grpc.Channel] = []
        self._started = False
        self._lock = threading.Lock()
        self._temp_log_dir: str | None = None

    def start(self) -> TffRuntime:
        with self._lock:
            if self._started:
                return self
            self._started = True
        atexit.register(self.stop)
        try:
            self._start_workers_and_context()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_workers_and_context(self) -> None:
        config = self.config
        # Before any worker starts: a bad TLS file fails without side effects.
        credentials = config.channel_credentials()
        if config.worker_addresses:
            targets = [(address, None) for address in config.worker_addresses]
        else:
            if config.log_dir:
                log_dir = config.log_dir
                os.makedirs(log_dir, exist_ok=True)
            else:
                _remove_logs_of_killed_runs()
                log_dir = self._temp_log_dir = tempfile.mkdtemp(
                    prefix=f"{_TEMP_LOG_PREFIX}{os.getpid()}_"
                )
            for _ in range(config.local_workers):
                worker = LocalWorker(
                    log_dir,
                    config.max_concurrent_computation_calls,
                    taken_ports=[w.port for w in self.local_workers],
                    intra_op_threads=config.worker_intra_op_threads,
                )
                self.local_workers.append(worker)
                logging.info(
                    "Started TFF worker_binary pid %d, log %s", worker.process.pid, worker.log_path
                )
            targets = [(worker.address, worker) for worker in self.local_workers]
        stubs = []
        for address, worker in targets:
            if credentials is None:
                channel = grpc.insecure_channel(address, options=_GRPC_CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(address, credentials, options=_GRPC_CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = tff.framework.RemoteExecutorGrpcStub(channel)
            _wait_ready(stub, address, config.ready_timeout_s, worker)
            if worker is not None:
                worker.check_loopback_only()
            stubs.append(stub)
        self.addresses = tuple(address for address, _ in targets)
        self._context = self._make_context(stubs)
        tff.framework.set_default_context(self._context)
        with _running_lock:
            _running.append(self)
        _collect_import_time_context()

    def _make_context(self, stubs: Sequence[tff.framework.RemoteExecutorGrpcStub]):
        n = self.config.default_num_clients
        if len(stubs) == 1:
            return tff.framework.SyncExecutionContext(
                executor_fn=_executor_factory(stubs[0], n),
                compiler_fn=native_compiler.desugar_and_transform_to_native,
                transform_args=tensorflow_computation.transform_args,
                transform_result=tensorflow_computation.transform_result,
            )
        async_contexts = [
            tff.framework.AsyncExecutionContext(
                executor_fn=_executor_factory(stub, n),
                compiler_fn=native_compiler.desugar_and_transform_to_native,
                transform_args=tensorflow_computation.transform_args,
                transform_result=tensorflow_computation.transform_result,
            )
            for stub in stubs
        ]
        return tff.framework.MergeableCompExecutionContext(
            async_contexts=async_contexts,
            compiler_fn=mergeable_comp_compiler.compile_to_mergeable_comp_form,
        )

    def stop(self) -> None:
        """Stops owned workers and gives the context back to the runtime started before
        this one if it still runs (runtimes nest), else to one that fails loudly."""
        with self._lock:
            workers, self.local_workers = self.local_workers, []
            channels, self._channels = self._channels, []
        if not workers and not channels:
            return
        with _running_lock:
            if self in _running:
                _running.remove(self)
            previous = _running[-1]._context if _running else _StoppedContext()
        tff.framework.set_default_context(previous)
        for channel in channels:
            channel.close()
        clean = True
        for worker in workers:
            clean = worker.stop() and clean
            logging.info("Stopped TFF worker_binary pid %d", worker.process.pid)
        if self._temp_log_dir and clean:
            shutil.rmtree(self._temp_log_dir, ignore_errors=True)
        elif self._temp_log_dir:
            # Renamed out of `_remove_logs_of_killed_runs`' way: this one is for the user.
            kept = self._temp_log_dir.replace(_TEMP_LOG_PREFIX, f"{_TEMP_LOG_PREFIX}kept_", 1)
            with contextlib.suppress(OSError):
                os.rename(self._temp_log_dir, kept)
                self._temp_log_dir = kept
            logging.warning("A TFF worker ended abnormally; its log is in %s", self._temp_log_dir)
        atexit.unregister(self.stop)

    def __enter__(self) -> TffRuntime:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class _StoppedContext(tff.framework.SyncContext):
    def invoke(self, comp, arg):  # noqa: ANN001 - TFF's signature
        raise RuntimeError(
            "the TFF runtime was stopped; start a TffRuntime before running computations"
        )


_active: TffRuntime | None = None
# Started and not yet stopped, oldest first: stopping one reinstates the one before.
_running: list[TffRuntime] = []
_running_lock = threading.Lock()


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    if _active is not None:
        _active.stop()
    # Exit the conventional way for the signal, running the remaining atexit hooks.
    raise SystemExit(128 + signum)


def start(config: RuntimeConfig = RuntimeConfig(), *, handle_signals: bool = True) -> TffRuntime:
    """Starts the process-wide runtime (stopping a previous one) and returns it.

    With `handle_signals`, SIGTERM and SIGINT stop the workers and exit with
    128 + signal number. Signal handlers can only be installed from the main
    thread; elsewhere the atexit hook and parent-death signal still apply.
    """
    global _active
    if _active is not None:
        _active.stop()
    _active = TffRuntime(config).start()
    if handle_signals and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _stop_on_signal)
    return _active


def stop() -> None:
    """Stops the process-wide runtime, if any."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def active() -> TffRuntime | None:
    return _active


@contextlib.contextmanager
def session(
    config: RuntimeConfig | None = None, *, handle_signals: bool = True
) -> Iterator[TffRuntime]:
    """The runtime for the computations of a `with` block; the one way callers get one.

    With no runtime active: starts the process-wide one (`start`, with
    `handle_signals`) and stops it when the block ends, however it ends; one that fails
    to start leaves TFF's import-time context released. With one active: yields it,
    untouched, when `config` asks for nothing else (None or the default), or else a
    runtime of `config` nested over it, whose stop gives the active one its context back
    (workers asked for are never silently ignored).
    """
    current = active()
    if current is not None:
        if config is None or config == RuntimeConfig():
            yield current
        else:
            with TffRuntime(config) as nested:
                yield nested
        return
    try:
        started = start(config or RuntimeConfig(), handle_signals=handle_signals)
    except BaseException:
        release_import_time_context()
        raise
    try:
        yield started
    finally:
        stop()


def release_import_time_context() -> None:
    """Drops TFF's import-time default context unless a runtime is active.

    For processes that import TFF without starting a runtime (e.g. a command that fails
    on bad input first): the dropped context's worker manager is collected now, while
    the interpreter is intact, instead of failing noisily in `__del__` at exit.
    Computations then fail loudly until `start()`.
    """
    with _running_lock:
        if _running:
            return
    tff.framework.set_default_context(_StoppedContext())
    _collect_import_time_context()


_import_time_context_collected = False


def _collect_import_time_context() -> None:
    """Collects TFF's import-time default context once it is no longer the default, while
    the interpreter is intact, so its worker manager's __del__ does not fail at shutdown.
    Its worker manager sits in a reference cycle, so only a full collection frees it; one
    is enough (about 0.6 s in a pipeline's process), later sessions skip it."""
    global _import_time_context_collected
    if not _import_time_context_collected:
        gc.collect()
        _import_time_context_collected = True

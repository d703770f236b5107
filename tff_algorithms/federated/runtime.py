"""Owns TFF execution: the C++ `worker_binary` processes and the execution context.

TFF's default context starts a `worker_binary` whose cleanup lives in a `__del__`
that fails at interpreter shutdown, so the worker outlives Python and keeps the
parent's stdout/stderr open (docs/design.md section 1). `TffRuntime` replaces that:

* local workers are started here, with output to a log file (never our pipes);
* each local worker dies with the process that started it, even on SIGKILL
  (Linux `PR_SET_PDEATHSIG`), and is stopped on normal exit, on exceptions
  (context manager / `atexit`) and on SIGTERM/SIGINT;
* local workers listen on 127.0.0.1 only: no other host can reach them (local_workers.py);
* remote workers (addresses such as "10.0.0.5:8000", started by a cluster
  scheduler) are only connected to, never started or stopped (docs/design.md section 8),
  over mutual TLS: the runtime verifies the worker against a CA and presents a client
  certificate, which a TLS-terminating proxy in front of the worker checks
  (docs/scaling.md). A remote address that is not loopback is refused without TLS
  unless `allow_insecure_workers` says the network is isolated.

With one worker the context is TFF's synchronous remote-execution context. With
several, computations are compiled to mergeable form and each round's clients are
split across the workers (`MergeableCompExecutionContext`): each worker runs the
computation up to the aggregation on its share of the clients, the partial
aggregates are merged, and the rest (DP noise, server update) runs once on the merged
value. Results equal one worker's up to float32 summation order
(tests/tff_algorithms/federated/test_multi_worker.py); with three or more workers the partial sums merge in the
order workers finish, so the last bits can vary between runs.

Every call to a worker has a deadline, and a worker lost during a round is restarted
(local) or dropped (remote) and the round tried again from the same state, within
`max_worker_losses` (`liveness.py`, `TffRuntime.run_round`).

With `executor` in_process no worker is started: the runtime installs
`in_process_executor.InProcessContext`, which runs TFF's compiled form of each round
with this process's TensorFlow (on its GPUs when it sees any).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import ipaddress
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TypeVar

import grpc
import tensorflow_federated as tff
from absl import logging
from tensorflow_federated.python.core.backends.native import compiler as native_compiler
from tensorflow_federated.python.core.backends.native import mergeable_comp_compiler
from tensorflow_federated.python.core.environments.tensorflow_frontend import (
    tensorflow_computation,
)

from tff_algorithms.base import validation
from tff_algorithms.config import executors
from tff_algorithms.config.executors import EXECUTORS, IN_PROCESS, WORKER
from tff_algorithms.federated import in_process_executor, liveness, local_workers
from tff_algorithms.federated.local_workers import LocalWorker

_GRPC_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
_GRPC_CHANNEL_OPTIONS = (
    ("grpc.max_message_length", _GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _GRPC_MAX_MESSAGE_BYTES),
)
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How training reaches its TFF workers.

    Attributes:
      executor: what runs a round's computation: `worker` (TFF's `worker_binary`
        processes, the settings below) or `in_process` (TFF's MapReduceForm of the
        round run by this process's TensorFlow, client work on every GPU it sees;
        `in_process_executor`). in_process takes no worker addresses and one "local
        worker"; `worker_intra_op_threads` applies to its client work.
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
      first_round_deadline_s: how long a call to a worker may take before any round was
        measured (the first round, the one after a worker was replaced) and outside
        rounds; a worker that has not answered by then is lost (`liveness`).
      round_deadline_factor: a round's deadline is this many times the longest round
        measured in this process, so that a slow round is never taken for a lost worker.
      min_round_deadline_s: the shortest round deadline, for rounds of a few seconds.
      max_worker_losses: lost workers a run survives: a lost local worker is restarted,
        a lost remote one dropped, and the round tried again from the same state on the
        workers left. One more loss, or none left, stops training with one line naming
        the worker; re-running resumes from the last checkpoint. 0: stop at the first.
    """

    executor: str = WORKER
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
    first_round_deadline_s: float = executors.FIRST_ROUND_DEADLINE_S
    round_deadline_factor: float = executors.ROUND_DEADLINE_FACTOR
    min_round_deadline_s: float = executors.MIN_ROUND_DEADLINE_S
    max_worker_losses: int = executors.MAX_WORKER_LOSSES

    @property
    def uses_tls(self) -> bool:
        return any(getattr(self, name) for name in _TLS_SETTINGS)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(
                f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}"
            )
        if self.executor == IN_PROCESS and (self.worker_addresses or self.local_workers != 1):
            raise ValueError(
                "executor in_process runs each round in the training process: drop "
                "worker_addresses (--workers) and local_workers (--local-workers)"
            )
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
        for name in ("ready_timeout_s", "first_round_deadline_s", "min_round_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.round_deadline_factor >= 1:
            raise ValueError(
                f"round_deadline_factor must be >= 1, got {self.round_deadline_factor}"
            )
        validation.check_int("max_worker_losses", self.max_worker_losses, 0)
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


@dataclasses.dataclass
class _Target:
    """A worker the runtime reaches: its address, channel and stub, and the local
    process when the runtime owns it."""

    address: str
    worker: LocalWorker | None
    channel: grpc.Channel
    stub: liveness.WorkerStub


class TffRuntime:
    """Starts (or connects to) TFF workers and installs the execution context.

    Use as a context manager, or `start()`/`stop()`; `stop()` is idempotent and
    also registered with `atexit`.
    """

    def __init__(self, config: RuntimeConfig = RuntimeConfig()) -> None:
        self.config = config
        self.local_workers: list[LocalWorker] = []
        self.addresses: tuple[str, ...] = ()
        self.deadlines = liveness.Deadlines(
            config.round_deadline_factor,
            config.min_round_deadline_s,
            config.first_round_deadline_s,
        )
        self.worker_losses: list[str] = []
        self._targets: list[_Target] = []
        self._channels: list[grpc.Channel] = []
        self._credentials: grpc.ChannelCredentials | None = None
        self._log_dir = ""
        self._started = False
        self._context_installed = False
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

    def _start_local_worker(self) -> LocalWorker:
        worker = LocalWorker(
            self._log_dir,
            self.config.max_concurrent_computation_calls,
            taken_ports=[w.port for w in self.local_workers],
            intra_op_threads=self.config.worker_intra_op_threads,
        )
        self.local_workers.append(worker)
        logging.info(
            "Started TFF worker_binary pid %d, log %s", worker.process.pid, worker.log_path
        )
        return worker

    def _connect(self, address: str, worker: LocalWorker | None) -> _Target:
        if self._credentials is None:
            channel = grpc.insecure_channel(address, options=_GRPC_CHANNEL_OPTIONS)
        else:
            channel = grpc.secure_channel(address, self._credentials, options=_GRPC_CHANNEL_OPTIONS)
        self._channels.append(channel)
        stub = liveness.WorkerStub(channel, address, self.deadlines)
        local_workers.wait_ready(stub, address, self.config.ready_timeout_s, worker)
        if worker is not None:
            worker.check_loopback_only()
        return _Target(address, worker, channel, stub)

    def _start_workers_and_context(self) -> None:
        config = self.config
        if config.executor == IN_PROCESS:
            self._context = in_process_executor.InProcessContext(config.worker_intra_op_threads)
            tff.framework.set_default_context(self._context)
            self._register()
            return
        # Before any worker starts: a bad TLS file fails without side effects.
        self._credentials = config.channel_credentials()
        if config.worker_addresses:
            targets = [(address, None) for address in config.worker_addresses]
        else:
            if config.log_dir:
                self._log_dir = config.log_dir
                os.makedirs(self._log_dir, exist_ok=True)
            else:
                local_workers.remove_logs_of_killed_runs()
                self._log_dir = self._temp_log_dir = tempfile.mkdtemp(
                    prefix=f"{local_workers.TEMP_LOG_PREFIX}{os.getpid()}_"
                )
            for _ in range(config.local_workers):
                self._start_local_worker()
            targets = [(worker.address, worker) for worker in self.local_workers]
        self._targets = [self._connect(address, worker) for address, worker in targets]
        self._install_context()
        self._register()

    def _register(self) -> None:
        """Marks this runtime's context as the innermost running one."""
        self._context_installed = True
        with _running_lock:
            _running.append(self)
        _collect_import_time_context()

    def _install_context(self) -> None:
        """A context over the current workers, made the default when this runtime's is."""
        previous = getattr(self, "_context", None)
        self.addresses = tuple(target.address for target in self._targets)
        self._context = self._make_context([target.stub for target in self._targets])
        current = tff.framework.get_context_stack().current
        if previous is None or current is previous:
            tff.framework.set_default_context(self._context)

    def run_round(self, round_number: int, attempt: Callable[[], _T]) -> _T:
        """`attempt()` under the round's deadline, tried again after a lost worker.

        The policy of `liveness`: a lost local worker is restarted, a lost remote one
        dropped, and `attempt` called again (it must start from the same state); past
        `max_worker_losses`, or with no worker left, a one-line WorkerLostError.
        """
        while True:
            try:
                with self.deadlines.round() as (seconds, why):
                    return attempt()
            except liveness.WorkerLostError as lost:
                self._recover(round_number, lost, seconds, why)

    def _recover(
        self, round_number: int, lost: liveness.WorkerLostError, seconds: float, why: str
    ) -> None:
        self.worker_losses.append(f"round {round_number}: {lost}")
        where = (
            f"TFF worker {lost.address} lost in round {round_number}: {lost.reason}; "
            f"the round's deadline was {seconds:.0f} s ({why})"
        )
        target = next(t for t in self._targets if t.address == lost.address)
        remote_left = [t for t in self._targets if t is not target]
        limit = self.config.max_worker_losses
        if len(self.worker_losses) > limit or (target.worker is None and not remote_left):
            reason = (
                f"{len(self.worker_losses)} lost workers, max_worker_losses is {limit}"
                if len(self.worker_losses) > limit
                else "no worker left to retry on (max_worker_losses allows more)"
            )
            raise liveness.WorkerLostError(
                lost.address,
                f"{where}; stopping: {reason}; nothing of the round was released or "
                "charged, and re-running the same command resumes from the last checkpoint",
            ) from None
        target.channel.close()
        if target.worker is None:
            self._targets = remote_left
            action = f"retrying the round on the {len(remote_left)} workers left"
        else:
            # Ours: SIGKILL also ends a stopped process, which SIGINT would not.
            target.worker.process.kill()
            target.worker.stop()
            self.local_workers.remove(target.worker)
            fresh = self._connect_fresh_local_worker()
            self._targets = [fresh if t is target else t for t in self._targets]
            action = f"restarted it as {fresh.address}, retrying the round"
        logging.warning(
            "%s; %s from the same state (loss %d of max_worker_losses %d)",
            where,
            action,
            len(self.worker_losses),
            limit,
        )
        self.deadlines.forget_measurements()
        self._install_context()

    def _connect_fresh_local_worker(self) -> _Target:
        worker = self._start_local_worker()
        return self._connect(worker.address, worker)

    def _make_context(self, stubs: Sequence[liveness.WorkerStub]):
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
            self._targets = []
            installed, self._context_installed = self._context_installed, False
        if not workers and not channels and not installed:
            return
        with _running_lock:
            if self in _running:
                _running.remove(self)
            previous = _running[-1]._context if _running else _StoppedContext()
        tff.framework.set_default_context(previous)
        if isinstance(getattr(self, "_context", None), in_process_executor.InProcessContext):
            self._context.close()
        for channel in channels:
            channel.close()
        clean = not self.worker_losses  # a lost worker's log is worth keeping
        for worker in workers:
            clean = worker.stop() and clean
            logging.info("Stopped TFF worker_binary pid %d", worker.process.pid)
        if self._temp_log_dir and clean:
            shutil.rmtree(self._temp_log_dir, ignore_errors=True)
        elif self._temp_log_dir:
            # Renamed out of `_remove_logs_of_killed_runs`' way: this one is for the user.
            kept = self._temp_log_dir.replace(
                local_workers.TEMP_LOG_PREFIX, f"{local_workers.TEMP_LOG_PREFIX}kept_", 1
            )
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


def current() -> TffRuntime | None:
    """The runtime whose context computations run in now (the innermost of nested ones)."""
    with _running_lock:
        return _running[-1] if _running else None


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

"""Liveness of the TFF workers during rounds: every call has a deadline, a lost worker a name.

Why (issue 62): TFF 0.87's `RemoteExecutorGrpcStub` sends every request without a
deadline, and `AsyncExecutionContext.invoke` retries UNAVAILABLE and FAILED_PRECONDITION
forever (`retrying.retry`, up to 30 s between tries). A killed worker, a SIGSTOPped one
or a cut network link therefore hung training without a line: a stopped worker or a cut
link never answers and never closes the connection, and a killed one is retried for
ever. `WorkerStub` replaces TFF's stub for every worker the runtime reaches:

* each request carries a gRPC deadline from `Deadlines`: inside a round, the time left
  until the round's deadline, which is `round_deadline_factor` times the longest round
  measured so far in this process, at least `min_round_deadline_s`; before a round was
  measured (the first round, the round after a worker was replaced, `initialize`), and
  for calls outside rounds, `first_round_deadline_s` per call;
* the channel's state ends a call early: a worker that dies closes its connection, and
  the call fails at once with UNAVAILABLE;
* UNAVAILABLE, DEADLINE_EXCEEDED and FAILED_PRECONDITION (a worker that forgot its
  executors: restarted between two calls) raise `WorkerLostError`, which TFF does not
  retry, naming the worker; every later request to that worker fails the same way at
  once, so cleanup never waits on it. Other errors (a TensorFlow error in a
  computation) pass through unchanged.

What happens next is the runtime's policy (`runtime.TffRuntime.run_round`): a lost local
worker is replaced by a fresh one, a lost remote worker is dropped, and the round is
tried again from the same state on the workers left, up to `max_worker_losses` losses in
a run; then, or when no worker is left, training stops with one line naming the worker
and the setting, and re-running the same command resumes from the last checkpoint.

Nothing of a failed attempt is released: its output never reaches the training loop (the
call raised), so nothing is checkpointed, logged, evaluated or charged to the ledger, and
the retry starts from the same state with the same virtual clients and the same noise
seed, so it computes the same round (up to float32 summation order across another number
of workers). As for dropped clients (dropouts.py), the accounting treats a retry as
independent of the users' data: a machine failing, not a client. A deadline that a round
misses because its data is large would be a data-dependent retry; the factor's margin
over the measured rounds is what keeps that from happening.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import tensorflow_federated as tff
from absl import logging

# Codes that mean the worker, not the computation, failed (TFF retries the first and last).
_LOST_CODES = {
    grpc.StatusCode.UNAVAILABLE: "its connection failed",
    grpc.StatusCode.DEADLINE_EXCEEDED: "no answer before the deadline",
    grpc.StatusCode.FAILED_PRECONDITION: "it no longer knows its executor (restarted?)",
}
# Disposing a value or an executor frees the worker's memory only; a lost worker holds
# nothing worth waiting for, and a live one answers at once.
_DISPOSE_TIMEOUT_S = 10.0


class WorkerLostError(ConnectionError):
    """A TFF worker died, stopped answering or became unreachable during a call.

    A ConnectionError (an OSError), so the command line prints it as one error line.
    """

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"TFF worker {address} lost: {reason}")
        self.address = address
        self.reason = reason


class Deadlines:
    """The deadline of the calls to the workers: per round, from the rounds measured.

    Shared by the runtime's stubs, which read it from TFF's event-loop thread, and the
    training loop, which opens rounds from the main thread.
    """

    def __init__(self, factor: float, minimum_s: float, first_s: float) -> None:
        self.factor = factor
        self.minimum_s = minimum_s
        self.first_s = first_s
        self._longest_s: float | None = None
        self._round_ends: float | None = None
        self._failed: WorkerLostError | None = None
        self._lock = threading.Lock()

    def budget(self) -> tuple[float, str]:
        """(seconds, how they were derived) a round may take now."""
        with self._lock:
            longest = self._longest_s
        if longest is None:
            return self.first_s, f"first_round_deadline_s {self.first_s:g}: no round measured yet"
        seconds = max(self.minimum_s, self.factor * longest)
        return seconds, (
            f"round_deadline_factor {self.factor:g} x the longest round {longest:.1f} s, "
            f"at least min_round_deadline_s {self.minimum_s:g}"
        )

    @contextlib.contextmanager
    def round(self) -> Iterator[tuple[float, str]]:
        """Calls inside share one deadline; a round that returns is measured."""
        seconds, why = self.budget()
        started = time.monotonic()
        with self._lock:
            self._round_ends = started + seconds
            self._failed = None
        try:
            yield seconds, why
            took = time.monotonic() - started
            with self._lock:
                self._longest_s = max(took, self._longest_s or 0.0)
        finally:
            with self._lock:
                self._round_ends = None
                self._failed = None

    def fail_round(self, lost: WorkerLostError) -> WorkerLostError:
        """The round's first lost worker; every later call of the round raises it too.

        TFF's context runs the workers' shares one after another on its event loop, and
        a share whose worker was lost leaves the others queued, to run after the
        deadline has passed: they must not blame their own, healthy, workers.
        """
        with self._lock:
            if self._round_ends is not None and self._failed is None:
                self._failed = lost
            return self._failed or lost

    def failed(self) -> WorkerLostError | None:
        with self._lock:
            return self._failed

    def forget_measurements(self) -> None:
        """After a worker was replaced: its first round compiles again, like a first one."""
        with self._lock:
            self._longest_s = None

    def timeout_s(self) -> float:
        """The deadline of a call starting now, in seconds from now."""
        with self._lock:
            ends = self._round_ends
        if ends is None:
            return self.first_s
        # Past the deadline a call still gets a moment, and fails with DEADLINE_EXCEEDED.
        return max(ends - time.monotonic(), 0.001)


class WorkerStub(tff.framework.RemoteExecutorGrpcStub):
    """TFF's stub of one worker, with a deadline on every request and a named loss."""

    def __init__(self, channel: grpc.Channel, address: str, deadlines: Deadlines) -> None:
        super().__init__(channel)
        self.address = address
        self.lost: str | None = None
        self._deadlines = deadlines

    def _call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        if self.lost is not None:
            raise WorkerLostError(self.address, self.lost)
        failed = self._deadlines.failed()
        if failed is not None:
            raise WorkerLostError(failed.address, failed.reason)
        timeout = self._deadlines.timeout_s() if timeout_s is None else timeout_s
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            if code not in _LOST_CODES:
                raise
            failed = self._deadlines.failed()
            if failed is not None:  # the round failed while this call waited
                raise WorkerLostError(failed.address, failed.reason) from None
            self.lost = f"{_LOST_CODES[code]} ({code.name} in {method} after {timeout:.0f} s)"
            raise self._deadlines.fail_round(WorkerLostError(self.address, self.lost)) from None

    def _dispose(self, method: str, request: object) -> object:
        try:
            return self._call(method, request, min(_DISPOSE_TIMEOUT_S, self._deadlines.first_s))
        except (WorkerLostError, grpc.RpcError) as e:
            logging.debug("dispose on TFF worker %s failed: %s", self.address, e)
            return None

    def get_executor(self, request):  # noqa: ANN001, ANN201 - TFF's stub interface
        return self._call("GetExecutor", request)

    def create_value(self, request):  # noqa: ANN001, ANN201
        return self._call("CreateValue", request)

    def create_struct(self, request):  # noqa: ANN001, ANN201
        return self._call("CreateStruct", request)

    def create_call(self, request):  # noqa: ANN001, ANN201
        return self._call("CreateCall", request)

    def create_selection(self, request):  # noqa: ANN001, ANN201
        return self._call("CreateSelection", request)

    def compute(self, request):  # noqa: ANN001, ANN201
        return self._call("Compute", request)

    def dispose(self, request):  # noqa: ANN001, ANN201
        return self._dispose("Dispose", request)

    def dispose_executor(self, request):  # noqa: ANN001, ANN201
        return self._dispose("DisposeExecutor", request)

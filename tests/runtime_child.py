"""Child process for the runtime tests: starts the runtime, reports, then ends as told.

usage: python -m tests.runtime_child normal|exception|wait|stopped|session|session-exception

The session modes start the runtime by `runtime.session`, with none active, and print a
second line once its block has ended: whether a runtime is still active and the
worker's exit code (None: still running).
"""

import sys
import time

import numpy as np
import tensorflow_federated as tff

from tff_algorithms.federated import runtime


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def federated_sum(values):
    return tff.federated_sum(values)


def report(rt: runtime.TffRuntime) -> None:
    total = federated_sum([1.0, 2.0, 3.0])
    print(
        f"pid={rt.local_workers[0].process.pid} sum={total} log={rt.local_workers[0].log_path}",
        flush=True,
    )


def session(mode: str) -> None:
    try:
        with runtime.session() as rt:
            worker = rt.local_workers[0].process
            report(rt)
            if mode == "session-exception":
                raise RuntimeError("deliberate failure inside the session")
    finally:
        print(f"after active={runtime.active()} exit={worker.poll()}", flush=True)


def main(mode: str) -> None:
    if mode.startswith("session"):
        session(mode)
        return
    rt = runtime.start()
    report(rt)
    if mode == "exception":
        raise RuntimeError("deliberate failure after the runtime started")
    if mode == "stopped":
        runtime.stop()
        try:
            federated_sum([1.0])
        except RuntimeError as e:
            print(f"refused: {e}", flush=True)
            sys.exit(3)
    if mode == "wait":
        time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])

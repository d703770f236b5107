"""Child process for the runtime tests: starts the runtime, reports, then ends as told.

usage: runtime_child.py normal|exception|wait|stopped
"""

import sys
import time

import numpy as np
import tensorflow_federated as tff

from tff_algorithms import runtime


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def federated_sum(values):
    return tff.federated_sum(values)


def main(mode: str) -> None:
    rt = runtime.start()
    total = federated_sum([1.0, 2.0, 3.0])
    print(
        f"pid={rt.local_workers[0].process.pid} sum={total} log={rt.local_workers[0].log_path}",
        flush=True,
    )
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

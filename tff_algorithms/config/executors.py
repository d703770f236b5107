"""What runs a round's TFF computation (`runtime.RuntimeConfig.executor`, `--executor`):
`worker`, TFF's `worker_binary` processes (the default), or `in_process`, TFF's
compiled form of the round run by the training process's own TensorFlow
(`federated/in_process_executor.py`); and the defaults of how long a worker may stay
silent before it counts as lost, and how many losses a run survives
(`federated/liveness.py`, `runtime.RuntimeConfig`). No TensorFlow at import: the flags
and the pipeline's config read it."""

WORKER = "worker"
IN_PROCESS = "in_process"
EXECUTORS = (WORKER, IN_PROCESS)

# A call's deadline before any round was measured (the first one compiles), a round's
# as a multiple of the longest measured round and at least a minimum, in seconds; and
# the lost workers a run survives (`runtime.RuntimeConfig`'s fields of these names).
FIRST_ROUND_DEADLINE_S = 900.0
ROUND_DEADLINE_FACTOR = 10.0
MIN_ROUND_DEADLINE_S = 60.0
MAX_WORKER_LOSSES = 2

"""What runs a round's TFF computation (`runtime.RuntimeConfig.executor`, `--executor`):
`worker`, TFF's `worker_binary` processes (the default), or `in_process`, TFF's
compiled form of the round run by the training process's own TensorFlow
(`federated/in_process_executor.py`). No TensorFlow at import: the flags check it."""

WORKER = "worker"
IN_PROCESS = "in_process"
EXECUTORS = (WORKER, IN_PROCESS)

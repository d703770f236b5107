"""Training rounds as TensorBoard scalars: `tensorboard --logdir OUTPUT/tensorboard`.

Written from the job's per-round history records (the same records metrics.json holds),
so TensorBoard shows nothing that the published metrics do not:
- privacy/epsilon: ε spent so far (at the job's δ, its accountant and convention), with
  the public mechanism settings privacy/noise_multiplier and privacy/clip_norm;
- validation/recall_at_far_<FAR>: held-out validation identities, at each evaluation;
- time/round_seconds;
- operations/<count>: virtual clients dropped and kept each round. Like metrics.json's
  counts these are operations figures outside the DP guarantee (job_outputs).
Training-user losses are never written, as in metrics.json.
"""

from collections.abc import Mapping
from typing import Any

import tensorflow as tf


class TensorBoardRounds:
    """Callable on each round's history record; writes its scalars under `logdir`."""

    def __init__(self, logdir: str, mechanism: Mapping[str, float]):
        self._logdir = logdir
        self._mechanism = dict(mechanism)
        self._writer: Any = None

    def __call__(self, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            # Made at the first round, so a job refused before training leaves no run.
            self._writer = tf.summary.create_file_writer(self._logdir)
        step = int(record["round"])
        with self._writer.as_default(step=step):
            if record["epsilon"] != float("inf"):
                tf.summary.scalar("privacy/epsilon", float(record["epsilon"]))
                for name, value in self._mechanism.items():
                    tf.summary.scalar(f"privacy/{name}", float(value))
            tf.summary.scalar("time/round_seconds", float(record["round_seconds"]))
            for far, recall in record.get("eval", {}).get("recall_at_far", {}).items():
                tf.summary.scalar(f"validation/recall_at_far_{far}", float(recall))
            for name, count in record.get("clients", {}).items():
                tf.summary.scalar(f"operations/{name}", float(count))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

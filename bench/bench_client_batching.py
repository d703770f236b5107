"""Several virtual clients' local steps as one execution, against one step per client
(issue 40): the lever the round profile (`bench/round_speed.py`, BENCHMARKS.md "Where a
round's time goes") names for the default and the cached rounds.

Both sides are the same hand-written math, so only the batching differs:
- default recipe (`default`): the small CNN's trained part at local batch 8 (two 5x5
  convolutions with GroupNorm of 32 groups, ReLU and max-pooling, then the frozen
  3136x128 embedding and a CosFace-scaled softmax over 40 rows). K clients run either as
  K separate steps in one `tf.function`, or as one step whose convolutions are grouped
  (`feature_group_count` K: client k's images go through client k's filters only) and
  whose GroupNorm and embedding are per client;
- cached embedding-only (`cached`): the 3136x128 embedding layer trained on cached trunk
  features at batch 8, as K matmuls or one batched matmul ([K, 8, 3136] x [K, 3136, 128]).

Each step takes gradients and applies SGD to every client's own weights. It runs in a
child process with one thread per op, as the TFF worker runs (`runtime.RuntimeConfig.
worker_intra_op_threads`). The figure is ms per client-step, best of 5 sweeps of 10 calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

BATCH = 8
HEAD_ROWS = 40
CLIENTS = {"full": (1, 4, 8, 16), "quick": (1, 4)}
# The measuring child's environment: one thread per op, and oneDNN on. TensorFlow's own
# CPU kernels have no gradient for grouped convolutions, and TensorFlow turns oneDNN on
# by default only on CPUs with AVX-512 VNNI/BF16 or AMX; on an AVX2 host the batched
# step needs it set.
CHILD_ENV = {
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLE_ONEDNN_OPTS": "1",
}


def _group_norm(x, groups: int):  # noqa: ANN001, ANN202 - tensors
    height, width, channels = x.shape[1], x.shape[2], x.shape[3]
    grouped = tf.reshape(x, [-1, height, width, groups, channels // groups])
    mean, variance = tf.nn.moments(grouped, [1, 2, 4], keepdims=True)
    return tf.reshape(
        (grouped - mean) * tf.math.rsqrt(variance + 1e-3), [-1, height, width, channels]
    )


def _default_loss(filters, images, embedding, head, clients: int):  # noqa: ANN001, ANN202
    """images [B, 28, 28, K]; filters [5, 5, 1, 32K], [5, 5, 32, 64K]: K clients' losses summed."""
    x = images
    for kernel in filters:  # grouped when K > 1: the kernel's input depth is one client's
        x = tf.nn.conv2d(x, kernel, 1, "SAME")
        x = tf.nn.max_pool2d(tf.nn.relu(_group_norm(x, 32 * clients)), 2, 2, "VALID")
    x = tf.reshape(
        tf.transpose(tf.reshape(x, [BATCH, 7, 7, clients, 64]), [3, 0, 1, 2, 4]),
        [clients, BATCH, -1],
    )
    logits = 30.0 * tf.einsum(
        "kbe,ec->kbc", tf.math.l2_normalize(tf.einsum("kbi,ie->kbe", x, embedding), -1), head
    )
    labels = tf.zeros([clients, BATCH], tf.int32)
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def _cached_loss(embedding, features, head):  # noqa: ANN001, ANN202
    """features [K, B, 3136]; embedding [K, 3136, 128]."""
    logits = 30.0 * tf.einsum(
        "kbe,ec->kbc",
        tf.math.l2_normalize(tf.einsum("kbi,kie->kbe", features, embedding), -1),
        head,
    )
    labels = tf.zeros(logits.shape[:2], tf.int32)
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


class ClientSteps:
    """One SGD step of K clients, each on its own weights and data: as K separate steps
    (`batched` False) or as one step over all of them. The clients' initial weights and
    data depend only on (kind, K), not on `batched`."""

    def __init__(self, kind: str, clients: int, batched: bool) -> None:
        rng = np.random.default_rng(clients)
        self._head = tf.constant(rng.standard_normal((128, HEAD_ROWS)), tf.float32)
        self.kind, self.clients, self.batched = kind, clients, batched
        if kind == "default":
            self._embedding = tf.constant(rng.standard_normal((3136, 128)) * 0.01, tf.float32)
            shapes, scales = [(5, 5, 1, 32), (5, 5, 32, 64)], [0.1, 0.05]
            self._data = tf.constant(rng.random((BATCH, 28, 28, clients)), tf.float32)
        else:
            shapes, scales = [(1, 3136, 128)], [0.01]
            self._data = tf.constant(rng.random((clients, BATCH, 3136)), tf.float32)
        per_client = [
            [rng.standard_normal(shape) * scale for shape, scale in zip(shapes, scales)]
            for _ in range(clients)
        ]
        # Batched, client k's filters are the k-th block of output channels (what grouped
        # convolution pairs with the k-th block of input channels), or the k-th row.
        self._client_axis = -1 if kind == "default" else 0
        sets = (
            [[np.concatenate(ws, self._client_axis) for ws in zip(*per_client)]]
            if batched
            else per_client
        )
        self.variables = [[tf.Variable(w, dtype=tf.float32) for w in weights] for weights in sets]
        self.step = tf.function(self._step, autograph=False)

    def _loss(self, variables, k: int):  # noqa: ANN001, ANN202
        members = self.clients if self.batched else 1
        if self.kind == "default":
            images = self._data[..., k * members : (k + 1) * members]
            return _default_loss(variables, images, self._embedding, self._head, members)
        return _cached_loss(variables[0], self._data[k * members : (k + 1) * members], self._head)

    def _step(self):  # noqa: ANN202
        total = 0.0
        for k, variables in enumerate(self.variables):
            with tf.GradientTape() as tape:
                value = self._loss(variables, k)
            for variable, gradient in zip(variables, tape.gradient(value, variables)):
                variable.assign_sub(0.01 * gradient)
            total += value
        return total

    def client_weights(self) -> list[list[np.ndarray]]:
        """Each client's weights now, in the layout of one client."""
        if not self.batched:
            return [[v.numpy() for v in variables] for variables in self.variables]
        blocks = [np.split(v.numpy(), self.clients, self._client_axis) for v in self.variables[0]]
        return [list(ws) for ws in zip(*blocks)]


def tf_gradient_tape():  # noqa: ANN201
    return tf.GradientTape()


def _measure_here(kinds: list[str], clients: list[int]) -> dict:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows: dict = {}
    for kind in kinds:
        for k in clients:
            row = {}
            for name, batched in (("one_step_per_client", False), ("clients_as_one_step", True)):
                step = ClientSteps(kind, k, batched).step
                step()
                best = min(_timed(step) for _ in range(5))
                row[name] = round(best * 1e3 / k, 3)
            row["batched_over_separate"] = round(
                row["clients_as_one_step"] / row["one_step_per_client"], 3
            )
            rows[f"{kind} K={k}"] = row
    return rows


def _timed(step) -> float:  # noqa: ANN001
    started = time.perf_counter()
    for _ in range(10):
        step()
    return (time.perf_counter() - started) / 10


def run(out_dir: str, quick: bool) -> dict:
    del out_dir  # the result is the returned dict (bench.run_all writes it)
    clients = list(CLIENTS["quick" if quick else "full"])
    job = json.dumps({"kinds": ["default", "cached"], "clients": clients})
    env = {**os.environ, **CHILD_ENV}
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_client_batching", job],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=1800,
    )
    return {
        "ms_per_client_step": json.loads(done.stdout.strip().splitlines()[-1]),
        "batch": BATCH,
        "threads_per_op": 1,
        "onednn": True,
    }


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(_measure_here(request["kinds"], request["clients"])))

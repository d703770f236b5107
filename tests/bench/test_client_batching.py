"""bench_client_batching compares equal math: K clients as one step (grouped convolutions,
a batched matmul) train each client exactly as K separate steps do.

Each comparison runs in a child process with oneDNN on, as the benchmark measures
(`bench_client_batching.CHILD_ENV`): TensorFlow's own CPU kernels have no gradient for
grouped convolutions, and TensorFlow turns oneDNN on by default only on CPUs with
AVX-512 VNNI/BF16 or AMX, so on an AVX2 host the batched step cannot run without it.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from bench import bench_client_batching
from tests import paths


def compare(kind: str) -> None:
    """The comparison itself, in whatever process imports this module."""
    separate = bench_client_batching.ClientSteps(kind, 3, batched=False)
    batched = bench_client_batching.ClientSteps(kind, 3, batched=True)
    before = separate.client_weights()
    for start, after in zip(before, batched.client_weights()):
        for a, b in zip(start, after):
            np.testing.assert_array_equal(a, b)
    for _ in range(2):
        np.testing.assert_allclose(float(separate.step()), float(batched.step()), rtol=1e-5)
    for one, other, start in zip(separate.client_weights(), batched.client_weights(), before):
        for a, b, s in zip(one, other, start):
            assert not np.allclose(a, s)  # the step moved every client's weights
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["default", "cached"])
def test_clients_as_one_step_train_each_client_as_separate_steps(kind):
    code = f"from tests.bench import test_client_batching as t; t.compare({kind!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(paths.REPO),
        env={**os.environ, **bench_client_batching.CHILD_ENV},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]

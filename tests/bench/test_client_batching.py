"""bench_client_batching compares equal math: K clients as one step (grouped convolutions,
a batched matmul) train each client exactly as K separate steps do."""

import numpy as np
import pytest

from bench import bench_client_batching


@pytest.mark.parametrize("kind", ["default", "cached"])
def test_clients_as_one_step_train_each_client_as_separate_steps(kind):
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

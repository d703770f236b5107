"""The server's Adam and LAMB (issue 42): their steps against the published rules in
numpy, a dp-fedemb process built from a job config holding Adam's moments, and the
config's refusals."""

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
from tff_algorithms.config import client_config, job_config, model_config, recipes

BETA1, BETA2, EPSILON = 0.9, 0.999, 1e-8


def _published_steps(name, lr, weights, gradients_per_step):
    """Adam (Kingma and Ba 2014, Algorithm 1, ε added to the bias-corrected √v̂) and
    LAMB (You et al. 2019, Algorithm 2 with φ the identity, no decay), per tensor."""
    weights = [w.astype(np.float64) for w in weights]
    m = [np.zeros_like(w) for w in weights]
    v = [np.zeros_like(w) for w in weights]
    history = []
    for t, gradients in enumerate(gradients_per_step, start=1):
        for i, g in enumerate(gradients):
            m[i] = BETA1 * m[i] + (1 - BETA1) * g
            v[i] = BETA2 * v[i] + (1 - BETA2) * g * g
            r = (m[i] / (1 - BETA1**t)) / (np.sqrt(v[i] / (1 - BETA2**t)) + EPSILON)
            if name == model_config.LAMB:
                w_norm, r_norm = np.linalg.norm(weights[i]), np.linalg.norm(r)
                r = r * (w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0)
            weights[i] = weights[i] - lr * r
        history.append([w.copy() for w in weights])
    return history


@pytest.mark.parametrize("name", [model_config.ADAM, model_config.LAMB])
def test_three_server_steps_follow_the_published_rule(name):
    rng = np.random.default_rng(7)
    # A zero tensor (LAMB's ratio is 1 there until it moves), a non-zero one, and
    # gradients near ε so that where ε is added changes the step.
    weights = [np.zeros((3,), np.float32), rng.normal(size=(2, 2)).astype(np.float32)]
    steps = [
        [(rng.normal(size=w.shape) * scale).astype(np.float32) for w in weights]
        for scale in (1e-7, 0.5, 2e-8)
    ]
    optimizer = processes.server_optimizer(name, 0.1, 0.0)
    state = optimizer.initialize([tf.TensorSpec(w.shape, tf.float32) for w in weights])
    current = [tf.constant(w) for w in weights]
    for gradients, expected in zip(steps, _published_steps(name, 0.1, weights, steps)):
        state, current = optimizer.next(state, current, [tf.constant(g) for g in gradients])
        for got, want in zip(current, expected):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == 3


def _client_dataset(seed, identities, config):
    images = np.random.default_rng(seed).random((len(identities), 28, 28, 1), dtype=np.float32)
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": images, "identity": np.array(identities)}
    )
    return client_work.make_client_dataset(examples, f"vc{seed}", config)


def test_a_job_with_server_adam_builds_a_process_holding_adam_moments(tff_runtime):
    job = job_config.TrainJobConfig(
        server_optimizer="adam", server_momentum=0.0, server_learning_rate=0.01, embedding_size=8
    )
    config = client_config.ClientConfig(client_learning_rate=0.05, head_capacity=4, batch_size=4)
    process = processes.build_fedemb_process(
        job.backbone_config,
        config,
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=1.0, virtual_clients_per_round=1, noise_seed=1
        ),
        processes.server_optimizer(
            job.server_optimizer, job.server_learning_rate, job.server_momentum
        ),
    )
    state = process.initialize()
    trainable = process.get_model_weights(state).trainable
    for moments in ("first_moments", "second_moments"):
        assert [m.shape for m in state.finalizer[moments]] == [w.shape for w in trainable]
    after = process.next(state, [_client_dataset(0, ["a", "b", "a", "b"], config)]).state
    assert int(after.finalizer["step"]) == 1
    # Adam's first step from zero moments moves each coordinate by lr·|g|/(|g| + ε):
    # lr wherever the update is well above ε.
    moved = np.concatenate(
        [
            np.abs(a - b).ravel()
            for a, b in zip(process.get_model_weights(after).trainable, trainable)
        ]
    )
    second = np.concatenate([v.ravel() for v in after.finalizer["second_moments"]])
    large = np.sqrt(second / (1 - BETA2)) > 1e-4
    assert large.mean() > 0.5
    np.testing.assert_allclose(moved[large], 0.01, rtol=1e-3)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"server_optimizer": "adamw"}, "server_optimizer must be one of sgd, adam, lamb"),
        (
            {"server_optimizer": "adam"},
            "server_momentum applies to the sgd server optimizer, not to adam",
        ),
        (
            {"algorithm": "dp-ftrl-fedemb", "server_optimizer": "lamb", "server_momentum": 0},
            "server_optimizer lamb applies to dp-fedemb and dp-fedavg, not dp-ftrl-fedemb "
            "(its tree-aggregated noise",
        ),
        (
            {"algorithm": "dp-last-layer", "server_optimizer": "adam", "server_momentum": 0},
            "not dp-last-layer (it takes its optimizer from dp_sgd.optimizer)",
        ),
        (
            {"algorithm": "centralized", "server_optimizer": "adam", "server_momentum": 0},
            "not centralized (its update is not a federated server step)",
        ),
    ],
)
def test_a_server_optimizer_the_job_cannot_apply_is_one_line(values, message):
    with pytest.raises(ValueError, match=r"^[^\n]*$") as raised:
        job_config.TrainJobConfig(**values)
    assert message in str(raised.value)


def test_server_optimizer_is_recorded_when_not_sgd_and_pretraining_does_not_inherit_it():
    adam = job_config.TrainJobConfig(
        algorithm="dp-fedavg", server_optimizer="lamb", server_momentum=0.0
    )
    assert job_config.TrainJobConfig.from_dict(adam.to_dict()) == adam
    # A record from before the key is the sgd job it was.
    assert "server_optimizer" not in job_config.TrainJobConfig().to_dict()
    train = {**recipes.recipe("default"), "server_optimizer": "adam"}
    assert "server_optimizer" not in recipes.pretrain_values(train, {})
    assert "server_optimizer" not in recipes.private_contrastive_values(train, {})

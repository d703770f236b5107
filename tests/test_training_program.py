"""The training program: checkpoints, resume equal to an uninterrupted run, ledger, history."""

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms import accounting, training
from tff_algorithms.ledger import PrivacyLedger

ROUNDS = 4


def _model_fn() -> tff.learning.models.VariableModel:
    keras_model = tf.keras.Sequential(
        [tf.keras.layers.Dense(2, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))]
    )
    keras_model.build((None, 3))
    return tff.learning.models.from_keras_model(
        keras_model,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=(tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int32)),
    )


@tff.tensorflow.computation(np.str_)
def _client_data(client_id):
    # Deterministic synthetic examples derived from the id, built inside TFF.
    seed = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
    x = tf.random.stateless_normal([8, 3], seed=tf.stack([seed, 0]))
    y = tf.cast(x[:, 0] > 0, tf.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def _process() -> tff.learning.templates.LearningProcess:
    fed_avg = tff.learning.algorithms.build_unweighted_fed_avg(
        _model_fn,
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=0.5),
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=1.0, momentum=0.9),
    )
    return tff.simulation.compose_dataset_computation_with_learning_process(_client_data, fed_avg)


def _clients_for_round(round_num: int) -> list[str]:
    return [f"r{round_num}-c{i}" for i in range(3)]


def _ledger() -> PrivacyLedger:
    spec = accounting.AccountingSpec(
        population=100, users_per_round=3, rounds=ROUNDS, noise_multiplier=1.0, delta=1e-5
    )
    return PrivacyLedger(spec)


def _weights(process, state) -> list[np.ndarray]:
    return [np.asarray(w) for w in process.get_model_weights(state).trainable]


def train_rounds(
    process: tff.learning.templates.LearningProcess,
    directory: str,
    rounds: int,
    evaluate: Callable[[Any, int], Mapping[str, Any]] | None = None,
    evaluate_every: int = 0,
    initial_state: Any = None,
) -> tuple[training.TrainingResult, PrivacyLedger]:
    """Trains (or resumes, from DIRECTORY's checkpoints) this module's program on its
    clients until `rounds` rounds are done, with a fresh ledger for a new run."""
    return training.train(
        process,
        _clients_for_round,
        _ledger(),
        PrivacyLedger.from_json,
        training.TrainingProgramConfig(rounds, directory, evaluate_every=evaluate_every),
        evaluate,
        initial_state=initial_state,
    )


@pytest.fixture(scope="module")
def process(tff_runtime):
    return _process()


def test_resumed_training_equals_uninterrupted(process, tmp_path):
    evaluations = []

    def evaluate(state, rounds_done):
        evaluations.append(rounds_done)
        return {"weight_norm": float(sum(np.linalg.norm(w) for w in _weights(process, state)))}

    straight, straight_ledger = train_rounds(
        process, str(tmp_path / "straight"), ROUNDS, evaluate, evaluate_every=2
    )
    assert straight.resumed_from_round == 0 and evaluations == [2, 4]

    # Interrupted after 2 rounds (the process ends there), then resumed to 4.
    resumed_dir = str(tmp_path / "resumed")
    train_rounds(process, resumed_dir, 2, evaluate, evaluate_every=2)
    resumed, resumed_ledger = train_rounds(process, resumed_dir, ROUNDS, evaluate, evaluate_every=2)
    assert resumed.resumed_from_round == 2
    for a, b in zip(
        _weights(process, straight.state), _weights(process, resumed.state), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert resumed_ledger == straight_ledger
    assert resumed_ledger.rounds_recorded == ROUNDS
    assert [h["round"] for h in resumed.history] == [1, 2, 3, 4]
    assert resumed.history == [
        {**h, "round_seconds": r["round_seconds"]}
        for h, r in zip(straight.history, resumed.history, strict=True)
    ]
    # Epsilon grows with every round and matches the accountant for that round.
    eps = [h["epsilon"] for h in straight.history]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    spec = straight_ledger.spec
    assert eps[-1] == pytest.approx(accounting.compute_privacy(spec.with_rounds(ROUNDS)).epsilon)


def test_partial_checkpoint_is_ignored_and_removed(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    train_rounds(process, directory, 1)
    # A save killed before its rename leaves a temporary directory behind.
    partial = os.path.join(directory, "round_2_temp1234")
    os.makedirs(partial)
    result, ledger = train_rounds(process, directory, 2)
    assert result.resumed_from_round == 1 and ledger.rounds_recorded == 2
    assert not os.path.exists(partial)


def test_more_rounds_on_disk_than_requested_is_an_error(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    train_rounds(process, directory, 2)
    with pytest.raises(ValueError, match="already holds 2 rounds"):
        train_rounds(process, directory, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"total_rounds": 0}, "rounds must be >= 1"),
        ({"total_rounds": 2, "checkpoint_every": 0}, "checkpoint_every"),
        ({"total_rounds": 2, "evaluate_every": -1}, "evaluate_every"),
    ],
)
def test_config_rejects_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training.TrainingProgramConfig(checkpoint_dir="x", **kwargs)

"""The training program: checkpoints, resume equal to an uninterrupted run, ledger, history."""

import os

import numpy as np
import pytest

from tests import support
from tff_algorithms.federated import training
from tff_algorithms.privacy import accounting

ROUNDS = support.TOY_ROUNDS


@pytest.fixture(scope="module")
def process(tff_runtime):
    return support.toy_process()


def test_resumed_training_equals_uninterrupted(process, tmp_path):
    evaluations = []

    def evaluate(state, rounds_done):
        evaluations.append(rounds_done)
        return {
            "weight_norm": float(
                sum(np.linalg.norm(w) for w in support.toy_weights(process, state))
            )
        }

    straight, straight_ledger = support.train_toy_rounds(
        process, str(tmp_path / "straight"), ROUNDS, evaluate, evaluate_every=2
    )
    # The start (round 0) of a fresh run, every second round, the last.
    assert straight.resumed_from_round == 0 and evaluations == [0, 2, 4]

    # Interrupted after 2 rounds (the process ends there), then resumed to 4.
    resumed_dir = str(tmp_path / "resumed")
    support.train_toy_rounds(process, resumed_dir, 2, evaluate, evaluate_every=2)
    resumed, resumed_ledger = support.train_toy_rounds(
        process, resumed_dir, ROUNDS, evaluate, evaluate_every=2
    )
    assert resumed.resumed_from_round == 2
    for a, b in zip(
        support.toy_weights(process, straight.state),
        support.toy_weights(process, resumed.state),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert resumed_ledger == straight_ledger
    assert resumed_ledger.rounds_recorded == ROUNDS
    # The resumed run does not evaluate its start again: round 0 is the first run's.
    assert evaluations == [0, 2, 4, 0, 2, 4]
    assert [h["round"] for h in resumed.history] == [0, 1, 2, 3, 4]
    assert resumed.history[0] == straight.history[0]
    assert resumed.history == [
        {**h, "round_seconds": r["round_seconds"]}
        for h, r in zip(straight.history, resumed.history, strict=True)
    ]
    # Epsilon grows with every round and matches the accountant for that round.
    eps = [h["epsilon"] for h in straight.history[1:]]
    assert straight.history[0]["epsilon"] == 0.0
    assert all(a < b for a, b in zip(eps, eps[1:]))
    spec = straight_ledger.spec
    assert eps[-1] == pytest.approx(accounting.compute_privacy(spec.with_rounds(ROUNDS)).epsilon)


def test_partial_checkpoint_is_ignored_and_removed(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    support.train_toy_rounds(process, directory, 1)
    # A save killed before its rename leaves a temporary directory behind.
    partial = os.path.join(directory, "round_2_temp1234")
    os.makedirs(partial)
    result, ledger = support.train_toy_rounds(process, directory, 2)
    assert result.resumed_from_round == 1 and ledger.rounds_recorded == 2
    assert not os.path.exists(partial)


def test_more_rounds_on_disk_than_requested_is_an_error(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    support.train_toy_rounds(process, directory, 2)
    with pytest.raises(ValueError, match="already holds 2 rounds"):
        support.train_toy_rounds(process, directory, 1)


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

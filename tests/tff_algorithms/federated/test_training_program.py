"""A federated process's rounds (`federated/rounds.py`) through the one training loop
(`jobs/loop.py`): resume equal to an uninterrupted run, ledger, history, a save's
leftover temporary, and the earlier release's TFF program-state checkpoints."""

import os

import numpy as np
import pytest

from tests import support
from tff_algorithms.privacy import accounting

ROUNDS = support.TOY_ROUNDS


@pytest.fixture(scope="module")
def process(tff_runtime):
    return support.toy_process()


def _weight_norm(weights):
    return {"weight_norm": float(sum(np.linalg.norm(w) for w in weights.trainable))}


def test_resumed_training_equals_uninterrupted(process, tmp_path):
    straight = support.train_toy_rounds(
        process, str(tmp_path / "straight"), ROUNDS, _weight_norm, evaluate_every=2
    )
    # The start (round 0) of a fresh run, every second round, the last.
    assert straight.resumed_from_round == 0
    assert [h["round"] for h in straight.history if "eval" in h] == [0, 2, 4]

    # Interrupted after 2 rounds (the process ends there), then resumed to 4.
    resumed_dir = str(tmp_path / "resumed")
    support.train_toy_rounds(process, resumed_dir, 2, _weight_norm, evaluate_every=2)
    resumed = support.train_toy_rounds(process, resumed_dir, ROUNDS, _weight_norm, evaluate_every=2)
    assert resumed.resumed_from_round == 2
    for a, b in zip(support.toy_weights(straight), support.toy_weights(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.ledger.to_json() == straight.ledger.to_json()
    assert resumed.ledger.rounds_recorded == ROUNDS
    # The resumed run does not evaluate its start again: round 0 is the first run's.
    assert [h["round"] for h in resumed.history] == [0, 1, 2, 3, 4]
    assert support.without_round_seconds(resumed.history) == support.without_round_seconds(
        straight.history
    )
    # Epsilon grows with every round and matches the accountant for that round.
    eps = [h["epsilon"] for h in straight.history[1:]]
    assert straight.history[0]["epsilon"] == 0.0
    assert all(a < b for a, b in zip(eps, eps[1:]))
    spec = straight.ledger.spec
    assert eps[-1] == pytest.approx(accounting.compute_privacy(spec.with_rounds(ROUNDS)).epsilon)


def test_partial_checkpoint_is_ignored_and_removed(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    support.train_toy_rounds(process, directory, 1)
    # A save killed before its merge leaves a temporary directory behind.
    partial = os.path.join(directory, "ckpt-2_temp1234")
    os.makedirs(partial)
    result = support.train_toy_rounds(process, directory, 2)
    assert result.resumed_from_round == 1 and result.ledger.rounds_recorded == 2
    assert not os.path.exists(partial)


def test_more_rounds_on_disk_than_requested_is_an_error(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    support.train_toy_rounds(process, directory, 2)
    with pytest.raises(ValueError, match="already holds 2 steps"):
        support.train_toy_rounds(process, directory, 1)


@pytest.mark.parametrize("name", ["round_3", "round_4_temp1234"])
def test_the_earlier_federated_checkpoints_are_refused_in_one_line(process, tmp_path, name):
    # What the federated program of the earlier release saved: TFF program-state folders.
    directory = tmp_path / "ckpt"
    (directory / name / "variables").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"round_<N>/.*new output directory") as refused:
        support.train_toy_rounds(process, str(directory), 2)
    assert "\n" not in str(refused.value)
    assert (directory / name / "variables").is_dir()

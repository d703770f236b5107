"""tff_algorithms/jobs/tensorboard_rounds.py: history records read back from the event files."""

import glob
import os

import pytest
import tensorflow as tf

from tff_algorithms.jobs import tensorboard_rounds


def _read(logdir: str) -> dict[str, dict[int, float]]:
    scalars: dict[str, dict[int, float]] = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return scalars


def test_each_round_becomes_scalars_and_nothing_else(tmp_path):
    logdir = str(tmp_path / "run")
    board = tensorboard_rounds.TensorBoardRounds(
        logdir, {"noise_multiplier": 1.5, "clip_norm": 0.1}
    )
    board(
        {
            "round": 1,
            "epsilon": 0.5,
            "round_seconds": 2.0,
            "clients": {"dropped_clients": 1, "kept_clients": 7},
            "eval": {"recall_at_far": {"0.1": 0.6, "0.001": 0.2}},
        }
    )
    board({"round": 2, "epsilon": 0.75, "round_seconds": 1.0, "train_loss": 3.0})
    board.close()
    scalars = _read(logdir)
    assert scalars["privacy/epsilon"] == {1: 0.5, 2: 0.75}
    assert scalars["privacy/noise_multiplier"] == {1: 1.5, 2: 1.5}
    assert scalars["privacy/clip_norm"] == {1: pytest.approx(0.1), 2: pytest.approx(0.1)}
    assert scalars["validation/recall_at_far_0.001"] == {1: pytest.approx(0.2)}
    assert scalars["operations/dropped_clients"] == {1: 1.0}
    # Fields the writer does not know (a training-user loss) are never written.
    assert not [tag for tag in scalars if "loss" in tag]


def test_a_non_private_job_has_no_privacy_scalars_and_no_run_before_its_first_round(tmp_path):
    logdir = str(tmp_path / "pretrain")
    board = tensorboard_rounds.TensorBoardRounds(logdir, {"clip_norm": 1.0})
    assert not os.path.exists(logdir)
    board({"round": 1, "epsilon": float("inf"), "round_seconds": 1.0})
    board.close()
    assert set(_read(logdir)) == {"time/round_seconds"}

"""The training loop's checkpoints (`loop.run`, `checkpoints`) on a toy step: a newest
checkpoint that does not read back is removed and training resumes from the one before
to the same end; one that reads but does not fit, and the earlier FDML and centralized
formats, are one-line errors. (Every algorithm's jobs: tests/tff_algorithms/jobs/test_crash_safety.py.)"""

import glob
import os
import types

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.jobs import checkpoints, loop
from tff_algorithms.privacy import accounting_spec
from tff_algorithms.privacy.ledger import PrivacyLedger

STEPS = 4
SPEC = accounting_spec.AccountingSpec(
    population=100, users_per_round=3, rounds=STEPS, noise_multiplier=1.0, delta=1e-5
)


class _Stop(Exception):
    pass


def _inputs(directory: str, stop_at: int | None = None) -> types.SimpleNamespace:
    def progress(record):
        if record["round"] == stop_at:
            raise _Stop  # before the step's save, as a kill there

    return types.SimpleNamespace(
        config=types.SimpleNamespace(rounds=STEPS, evaluate_every=0, noise_seed=5),
        spec=SPEC,
        releases=None,
        evaluator=lambda weights: {"sum": float(np.sum(weights))},
        checkpoint_dir=directory,
        progress=progress,
    )


def _train(directory: str, stop_at: int | None = None, shape: tuple[int, ...] = (3,)):
    weights = tf.Variable(tf.zeros(shape))

    def step(t, seed):
        weights.assign_add(tf.random.stateless_normal(shape, seed))

    return loop.run(
        _inputs(directory, stop_at),
        loop.Round(step, {"weights": weights}, lambda: weights.numpy(), checkpoint_every=1),
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _train(str(tmp_path_factory.mktemp("straight")))


def _stopped_at(directory: str, step: int) -> None:
    with pytest.raises(_Stop):
        _train(directory, stop_at=step)


def _tear(prefix: str, how: str) -> None:
    if how == "missing_index":
        os.remove(f"{prefix}.index")
        return
    [path] = glob.glob(f"{prefix}.index" if how == "truncated_index" else f"{prefix}.data-*")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("how", ["missing_index", "truncated_index", "truncated_data"])
def test_torn_newest_checkpoint_is_removed_and_training_resumes_from_the_previous(
    straight, tmp_path, how
):
    directory = str(tmp_path / "ckpt")
    _stopped_at(directory, 4)  # checkpoints of steps 2 and 3 kept
    _tear(os.path.join(directory, "ckpt-3"), how)

    resumed = _train(directory)

    assert resumed.resumed_from_round == 2
    np.testing.assert_array_equal(resumed.backbone, straight.backbone)
    assert resumed.ledger.to_json() == straight.ledger.to_json()
    assert [r["round"] for r in resumed.history] == [1, 2, 3, 4]
    # Step 3 was trained and saved again, whole; the state file names what is there.
    assert tf.train.latest_checkpoint(directory).endswith("ckpt-4")
    assert checkpoints.read_error(os.path.join(directory, "ckpt-3")) is None


def test_a_prune_killed_between_index_and_values_leaves_a_job_that_resumes(straight, tmp_path):
    # The manager removes an old checkpoint's index, then its values: killed between,
    # the values stay without an index, older than the checkpoint resumed from.
    directory = str(tmp_path / "ckpt")
    _stopped_at(directory, 4)  # checkpoints of steps 2 and 3 kept
    os.remove(os.path.join(directory, "ckpt-2.index"))

    resumed = _train(directory)

    assert resumed.resumed_from_round == 3
    np.testing.assert_array_equal(resumed.backbone, straight.backbone)
    assert resumed.ledger.to_json() == straight.ledger.to_json()
    assert not glob.glob(os.path.join(directory, "ckpt-2.*"))


def test_checkpoint_that_reads_but_does_not_fit_is_a_one_line_error(tmp_path):
    directory = str(tmp_path / "ckpt")
    _stopped_at(directory, 2)
    with pytest.raises(ValueError, match="reads back but does not fit this job") as refused:
        _train(directory, shape=(4,))
    assert "\n" not in str(refused.value)
    assert os.path.exists(os.path.join(directory, "ckpt-1.index"))


def test_checkpoints_of_the_earlier_fdml_and_centralized_loops_are_refused(tmp_path):
    fdml_dir = str(tmp_path / "fdml")
    os.makedirs(fdml_dir)
    np.savez(os.path.join(fdml_dir, "fdml-10.npz"), meta=np.array("{}"))
    with pytest.raises(ValueError, match=r"fdml-<round>\.npz") as refused:
        _train(fdml_dir)
    assert "\n" not in str(refused.value)

    # What the oracle's own loop saved: its step was the variable "epoch".
    centralized_dir = str(tmp_path / "centralized")
    checkpoint = tf.train.Checkpoint(
        weights=tf.Variable(tf.zeros(3)),
        epoch=tf.Variable(1, dtype=tf.int64),
        ledger=tf.Variable(PrivacyLedger(SPEC).to_json()),
        history=tf.Variable("[]"),
    )
    tf.train.CheckpointManager(checkpoint, centralized_dir, 2).save(checkpoint_number=1)
    with pytest.raises(ValueError, match="its step is named 'epoch'") as refused:
        _train(centralized_dir)
    assert "\n" not in str(refused.value)

"""A local TFF worker killed or stopped mid-round: never a hang, never an unaccounted round.

Real `worker_binary` processes started by the runtime (`local_workers=2`); the fault
is a real signal sent while one of them computes round 2 (`faults.MidRound`). The
runtime's policy (tff_algorithms/federated/liveness.py): the lost local worker is
restarted and the round tried again from the same state, so the run ends at the
uninterrupted run's weights and ledger; past `max_worker_losses` it stops with one line
naming the worker and the setting, and re-running the same job resumes to the same
weights and ledger.
"""

import json
import os
import signal

import numpy as np
import pytest

from beam_jobs import synthetic
from tests import support
from tests.tff_algorithms.federated import faults
from tff_algorithms.federated import liveness, runtime
from tff_algorithms.jobs import train_job

# The runs with a fault: `make test-slow` (CI) runs them, `make test` leaves them out. On
# one xdist worker, so the module's data and uninterrupted run are built once.
ON_ONE_WORKER = pytest.mark.xdist_group("worker_loss")

SYNTH = synthetic.SyntheticConfig(identities=36, images_per_identity=5, seed=7)
TRAIN_IDENTITIES = 28
CONFIG = support.MULTI_WORKER_JOB
# Two workers again after a restart: the same split of the clients, so the same sums;
# the tolerance of test_multi_worker.py (float32 summation order) covers any reorder.
WEIGHT_TOLERANCE = 1e-5
# Deadlines short enough that a stopped worker is found within the test, still several
# times the measured rounds (the first round, which compiles, is the longest).
LIVENESS = {"round_deadline_factor": 3.0, "min_round_deadline_s": 10.0}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


def _outputs(result) -> tuple[list[np.ndarray], dict]:
    with open(result.ledger_path) as f:
        return support.saved_backbone(result.saved_model_dir), json.load(f)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    config = runtime.RuntimeConfig(local_workers=2, **LIVENESS)
    result = train_job.run_train_job(
        CONFIG, *data, str(tmp_path_factory.mktemp("uninterrupted")), runtime_config=config
    )
    return _outputs(result)


def _assert_same_outputs(expected, got) -> None:
    weights, ledger = got
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(expected[0], weights))
    assert worst <= WEIGHT_TOLERANCE, f"weights differ from the uninterrupted run's by {worst}"
    # One entry per applied round, the same ε: no round lost or charged twice.
    assert ledger == expected[1]
    assert len(ledger["history"]) == CONFIG.rounds


class _FaultInRound2:
    """The job's progress callback: after round 1, arms `signum` against a local worker."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.runtime: runtime.TffRuntime | None = None
        self.victim: int | None = None
        self.fault = faults.MidRound(lambda: os.kill(self.victim, signum))

    def __call__(self, record) -> None:
        if record["round"] == 1:
            self.runtime = runtime.current()
            self.victim = self.runtime.local_workers[0].process.pid
            self.fault.arm(self.victim)


def _run(data, output_dir: str, fault: _FaultInRound2 | None, **settings):
    config = runtime.RuntimeConfig(local_workers=2, **{**LIVENESS, **settings})
    return train_job.run_train_job(CONFIG, *data, output_dir, runtime_config=config, progress=fault)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
@pytest.mark.slow
@ON_ONE_WORKER
def test_lost_local_worker_is_restarted_and_the_run_ends_as_uninterrupted(
    data, uninterrupted, tmp_path, signum
):
    """SIGKILL closes the worker's connection (found at once); SIGSTOP leaves it open and
    silent (found at the round's deadline). Either way the runtime kills what is left of
    the worker, starts another and runs the round again from the same state."""
    fault = _FaultInRound2(signum)
    result = _run(data, str(tmp_path / "run"), fault)
    fault.fault.join()
    assert len(fault.runtime.worker_losses) == 1, fault.runtime.worker_losses
    loss = fault.runtime.worker_losses[0]
    assert "127.0.0.1:" in loss and ("DEADLINE_EXCEEDED" in loss) == (signum == signal.SIGSTOP)
    assert _gone(fault.victim), f"the lost worker {fault.victim} still runs"
    _assert_same_outputs(uninterrupted, _outputs(result))


@pytest.mark.slow
@ON_ONE_WORKER
def test_a_loss_past_max_worker_losses_stops_in_one_line_and_a_rerun_resumes(
    data, uninterrupted, tmp_path
):
    output_dir = str(tmp_path / "run")
    fault = _FaultInRound2(signal.SIGKILL)
    with pytest.raises(liveness.WorkerLostError) as stopped:
        _run(data, output_dir, fault, max_worker_losses=0)
    fault.fault.join()
    message = str(stopped.value)
    assert "\n" not in message
    for named in (fault.runtime.addresses[0], "max_worker_losses", "resumes"):
        assert named in message, message
    # The same job again resumes from the last checkpoint and ends where the
    # uninterrupted run did.
    resumed = _run(data, output_dir, None)
    _assert_same_outputs(uninterrupted, _outputs(resumed))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"first_round_deadline_s": 0}, "first_round_deadline_s must be positive"),
        ({"min_round_deadline_s": -1.0}, "min_round_deadline_s must be positive"),
        ({"round_deadline_factor": 0.5}, "round_deadline_factor must be >= 1"),
        ({"max_worker_losses": -1}, "max_worker_losses must be >= 0"),
    ],
)
def test_liveness_settings_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        runtime.RuntimeConfig(**fields)


def test_deadline_grows_with_the_measured_rounds():
    deadlines = liveness.Deadlines(factor=4.0, minimum_s=1.0, first_s=50.0)
    assert deadlines.budget()[0] == 50.0 and deadlines.timeout_s() == 50.0
    with deadlines.round() as (seconds, why):
        assert seconds == 50.0 and "first_round_deadline_s" in why
        assert 0 < deadlines.timeout_s() <= 50.0
    seconds, why = deadlines.budget()
    assert seconds >= 1.0 and "round_deadline_factor 4 x the longest round" in why
    deadlines.forget_measurements()
    assert deadlines.budget()[0] == 50.0

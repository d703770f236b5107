"""`dp-fedemb train`'s runtime flags reach the TFF runtime: the liveness settings
(tff_algorithms/federated/liveness.py) a user sets on the command line, as
`dp-fedemb run` reads them from its runtime section, with the same defaults."""

import dataclasses

import pytest
from absl import flags

from pipeline import config as pipeline_config
from pipeline.commands import train
from tests import support
from tff_algorithms.base import job_files
from tff_algorithms.federated import runtime

LIVENESS = ("first_round_deadline_s", "round_deadline_factor", "min_round_deadline_s")
LIVENESS += ("max_worker_losses",)


def _values(*args: str) -> dict:
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(["dp-fedemb train", *args])
    return {name: flag_values[name].value for name in flag_values}


def test_the_defaults_are_the_runtimes_and_the_pipelines():
    got = train.runtime_config_of(_values())
    for name in LIVENESS:
        assert getattr(got, name) == getattr(runtime.RuntimeConfig(), name)
        assert getattr(got, name) == getattr(pipeline_config.RuntimeSection(), name)


def test_each_liveness_flag_sets_its_runtime_setting():
    got = train.runtime_config_of(
        _values(
            "--first-round-deadline-s=120",
            "--round-deadline-factor=4",
            "--min-round-deadline-s=15",
            "--max-worker-losses=0",
        )
    )
    assert dataclasses.asdict(got) == {
        **dataclasses.asdict(runtime.RuntimeConfig()),
        "first_round_deadline_s": 120.0,
        "round_deadline_factor": 4.0,
        "min_round_deadline_s": 15.0,
        "max_worker_losses": 0,
    }


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--max-worker-losses=-1", "max_worker_losses must be >= 0"),
        ("--round-deadline-factor=0.5", "round_deadline_factor must be >= 1"),
        ("--first-round-deadline-s=0", "first_round_deadline_s must be positive"),
    ],
)
def test_a_liveness_setting_that_cannot_work_is_refused_in_one_line(flag, message):
    with pytest.raises(ValueError, match=message) as refused:
        train.runtime_config_of(_values(flag))
    assert "\n" not in str(refused.value)


def test_the_command_refuses_it_before_any_work(tmp_path):
    (tmp_path / "raw").mkdir()  # empty: the runtime is checked before the data
    line, _ = support.run_refused(
        "train",
        "--data",
        str(tmp_path / "raw"),
        "--output",
        str(tmp_path / "out"),
        "--min-round-deadline-s=-5",
    )
    assert "min_round_deadline_s must be positive" in line
    for written in (job_files.JOB_FILE, job_files.CHECKPOINT_DIR, job_files.LEDGER_FILE):
        assert not (tmp_path / "out" / written).exists()

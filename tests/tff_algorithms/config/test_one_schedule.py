"""One schedule (issue 25 item 2): what the partition publishes, what training selects
and what the accountant charges all come from `schedule.trained_shape`, with
over-selection and with dropouts, and the pipeline's check compares all of it."""

import json
import os

import pytest

from beam_jobs import partition, schedule
from pipeline.components import artifacts
from pipeline.components import training as training_components
from tff_algorithms.config import job_config, job_plan, report_policy

USERS, K, M, ROUNDS = 200, 2, 8, 6


def _job(**fields) -> job_config.TrainJobConfig:
    values = dict(
        algorithm="dp-fedemb",
        rounds=ROUNDS,
        users_per_virtual_client=K,
        virtual_clients_per_round=M,
        noise_multiplier=1.0,
        schedule_seed=7,
        testing_fixed_schedule=True,
    )
    return job_config.TrainJobConfig(**{**values, **fields})


def _published(config: job_config.TrainJobConfig) -> dict:
    """The partition component's participation statistics for this job's settings."""
    spec = partition.ScheduleSpec(
        config.users_per_virtual_client,
        config.virtual_clients_per_round,
        config.rounds,
        schedule.SAMPLED,
        float(config.over_selection),
    )
    return partition.participation({"users": USERS}, spec)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"over_selection": 0.25},
        {"over_selection": 0.25, "min_report_fraction": 0.9, "max_round_attempts": 4},
        {"virtual_clients_per_round": "auto", "over_selection": 0.1},
    ],
)
def test_published_trained_and_accounted_schedules_agree(fields):
    config = _job(**fields)
    published = _published(config)
    planned = config.virtual_clients_per_round
    if planned == schedule.AUTO:
        planned = schedule.largest_virtual_clients_per_round(USERS, K, config.over_selection)
    selected = schedule.selected_per_round(planned, config.over_selection)
    # Independent of the code under test: ceil(M (1 + o)).
    assert selected == -(-planned * round((1 + config.over_selection) * 100) // 100)
    assert published["virtual_clients_per_round"] == selected
    assert published["users_per_round"] == selected * K
    # Training (auto resolved when the job starts, as run_train_job does) selects that
    # many virtual clients, every round and every retry.
    config, _ = config.calibrated_for(USERS)
    plan = job_plan.schedule_for(config, USERS)
    for round_num in range(ROUNDS):
        for attempt in range(config.max_round_attempts):
            assert plan.round_user_indices(round_num, attempt).shape == (selected, K)
    assert config.report_policy().selected_per_round == selected
    # The accountant charges the same sampling.
    spec = job_plan.accounting_spec_for(config, USERS)
    assert (spec.population, spec.users_per_round, spec.rounds) == (
        published["sampling_units"],
        published["units_per_round"],
        published["rounds"],
    )


def _statistics(tmp_path, stats: dict) -> artifacts.ScheduleStatistics:
    artifact = artifacts.ScheduleStatistics()
    artifact.uri = str(tmp_path)
    with open(os.path.join(tmp_path, partition.PARTICIPATION_FILE), "w") as f:
        json.dump(stats, f)
    return artifact


def test_the_pipeline_refuses_a_published_schedule_that_is_not_the_trained_one(tmp_path):
    config = _job(over_selection=0.25)
    job = config.to_dict()
    training_components.check_published_schedule(
        job, _statistics(tmp_path, _published(config)), USERS
    )
    # What the partition published before: the planned M, not the 10 selected.
    planned_only = schedule.ScheduleShape(USERS, K, M, schedule.SAMPLED)
    stale = planned_only.participation_stats(ROUNDS).to_dict()
    with pytest.raises(ValueError, match="virtual_clients_per_round 8 published, 10 trained"):
        training_components.check_published_schedule(job, _statistics(tmp_path, stale), USERS)


def test_report_policy_and_largest_round_use_the_one_selection_rule():
    policy = report_policy.ReportPolicy(10, over_selection=0.1)
    assert policy.selected_per_round == schedule.selected_per_round(10, 0.1) == 11
    largest = schedule.largest_virtual_clients_per_round(23 * K, K, 0.1)
    assert (
        schedule.selected_per_round(largest, 0.1)
        <= 23
        < schedule.selected_per_round(largest + 1, 0.1)
    )

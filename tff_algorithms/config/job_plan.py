"""What a job's configuration implies: its virtual-client schedule and its accounting.

`schedule_shape_for` / `schedule_for` give the virtual-client schedule a federated job
trains with (`fresh_schedule_seed` when no seed is fixed), `accounting_spec_for` the
accounting spec of that schedule, and `release_plan_for` the shared-negatives releases
its ledger and budget charge beside it. The job (`train_job.run_train_job`) and the
pipeline take its schedule and its accounting spec from here; `TrainJobConfig` itself
(its fields and their checks) is `job_config`.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from beam_jobs import schedule
from tff_algorithms import algorithms
from tff_algorithms.algorithms import rules
from tff_algorithms.privacy import accounting_spec, dplc_releases

if TYPE_CHECKING:
    from tff_algorithms.config.job_config import TrainJobConfig


def fresh_schedule_seed() -> int:
    """A schedule seed from OS entropy, for production runs."""
    return secrets.randbits(62)


def schedule_mode(algorithm: str) -> str:
    """How `algorithm` samples users (its `Algorithm.schedule_mode`): DP-FTRL in epochs,
    the others by round."""
    return algorithms.get(algorithm).schedule_mode


def schedule_shape_for(config: TrainJobConfig, num_users: int) -> schedule.ScheduleShape:
    """The counts of a federated job's schedule over `num_users` users (no seed needed;
    `rules.schedule_shape`)."""
    return rules.schedule_shape(config, num_users)


def schedule_for(
    config: TrainJobConfig, num_users: int, schedule_seed: int | None = None
) -> schedule.VirtualClientSchedule:
    """The virtual-client schedule of a federated job over `num_users` users.

    `schedule_seed`: the job's seed (`run_train_job` passes the one it resolved); None
    takes `config.schedule_seed`, or draws a fresh one from OS entropy when that is None.
    """
    shape = schedule_shape_for(config, num_users)
    if schedule_seed is None:
        schedule_seed = (
            config.schedule_seed if config.schedule_seed is not None else fresh_schedule_seed()
        )
    return schedule.VirtualClientSchedule(
        shape.num_users,
        shape.users_per_virtual_client,
        shape.virtual_clients_per_round,
        schedule_seed,
        shape.mode,
    )


def accounting_spec_for(config: TrainJobConfig, num_users: int) -> accounting_spec.AccountingSpec:
    """The accounting spec of the planned job, by its algorithm's rule
    (`Algorithm.accounting_rule`; centralized: every user every epoch, no noise)."""
    if config.target_epsilon is not None:
        raise ValueError("the noise multiplier is not calibrated yet: use config.calibrated_for")
    delta = config.resolved_delta(num_users)
    return algorithms.get(config.algorithm).accounting_rule(config, num_users, delta)


def release_plan_for(config: TrainJobConfig) -> dplc_releases.ReleasePlan | None:
    """The shared-negatives releases of a job (None without them): what its ledger and
    budget charge beside the accounting spec."""
    if config.shared_negatives is None:
        return None
    return config.shared_negatives.release_plan()

"""Accounting and schedule rules several algorithms share (`registry.Algorithm`).

A job's config is passed as it is (`job_config.TrainJobConfig`, which imports this
package: not imported here); its algorithm's `Algorithm` gives the schedule mode and
the mechanism. No TensorFlow.
"""

from __future__ import annotations

from typing import Any

from beam_jobs import schedule
from tff_algorithms.algorithms import registry
from tff_algorithms.privacy import accounting


def schedule_shape(config: Any, num_users: int) -> schedule.ScheduleShape:
    """The counts of the job's virtual-client schedule over `num_users` users; one line
    when they cannot fill a round. Its rounds select `report_policy().selected_per_round`
    virtual clients (more than planned when over-selecting), so accounting built from
    its participation statistics uses the selected set's sampling. The line names the
    counts as the algorithm's section does, where it has one."""
    algorithm = registry.get(config.algorithm)
    try:
        return schedule.trained_shape(
            num_users,
            config.users_per_virtual_client,
            config.virtual_clients_per_round,
            algorithm.schedule_mode,
            float(config.over_selection),
        )
    except ValueError as e:
        if algorithm.section is None:
            raise
        raise ValueError(algorithm.section.in_own_words(str(e))) from None


def check_schedule_fills(config: Any, num_users: int) -> None:
    """One line when `num_users` cannot fill a round of the job's schedule."""
    schedule_shape(config, num_users)


def scheduled_accounting(config: Any, num_users: int, delta: float) -> accounting.AccountingSpec:
    """Accounting from the virtual-client schedule's participation statistics, with the
    algorithm's mechanism (tree noise: the minimum separation of a user's rounds, unless
    the tree restarts every epoch)."""
    mechanism = registry.get(config.algorithm).mechanism
    stats = schedule_shape(config, num_users).participation_stats(config.rounds)
    is_tree = mechanism is accounting.Mechanism.DPFTRL
    return accounting.AccountingSpec(
        population=stats.sampling_units,
        users_per_round=stats.units_per_round,
        rounds=stats.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=mechanism,
        users_per_virtual_client=config.users_per_virtual_client,
        restart_every_epoch=config.restart_every_epoch,
        min_separation=stats.min_separation if is_tree and not config.restart_every_epoch else None,
    )


def every_user_accounting(config: Any, num_users: int, delta: float) -> accounting.AccountingSpec:
    """No noise, every user in every round (one round an epoch): epsilon infinite."""
    return accounting.AccountingSpec(num_users, num_users, config.rounds, 0.0, delta)

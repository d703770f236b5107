"""Accounting and schedule rules several algorithms share (`registry.Algorithm`).

A job's config is passed as it is (`job_config.TrainJobConfig`, which imports this
package: not imported here); its algorithm's `Algorithm` gives the schedule mode, the
mechanism and its noise's shape (`Algorithm.noise`, from `accounting_spec.RELEASES`).
No TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms.algorithms import registry
from tff_algorithms.base import validation
from tff_algorithms.config import model_config
from tff_algorithms.privacy import accounting_spec


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


def scheduled_accounting(
    config: Any, num_users: int, delta: float
) -> accounting_spec.AccountingSpec:
    """Accounting from the virtual-client schedule's participation statistics, with the
    algorithm's mechanism (tree noise: the minimum separation of a user's rounds, unless
    the tree restarts every epoch)."""
    algorithm = registry.get(config.algorithm)
    stats = schedule_shape(config, num_users).participation_stats(config.rounds)
    is_tree = algorithm.noise is accounting_spec.Noise.TREE
    # Tree restarts are a setting of the tree-noise algorithms' section (`dp_fedemb`).
    restart_every_epoch = is_tree and config.settings.restart_every_epoch
    return accounting_spec.AccountingSpec(
        population=stats.sampling_units,
        users_per_round=stats.units_per_round,
        rounds=stats.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=algorithm.mechanism,
        users_per_virtual_client=config.users_per_virtual_client,
        restart_every_epoch=restart_every_epoch,
        min_separation=stats.min_separation if is_tree and not restart_every_epoch else None,
    )


def every_user_accounting(
    config: Any, num_users: int, delta: float
) -> accounting_spec.AccountingSpec:
    """No noise, every user in every round (one round an epoch): epsilon infinite."""
    return accounting_spec.AccountingSpec(num_users, num_users, config.rounds, 0.0, delta)


def check_gradient_clip_norm(config: Any) -> None:
    """One line naming `gradient_clip_norm` when it is not positive, or set for a private
    algorithm: that clip is the non-private steps' (a large trunk's public pretraining);
    a private algorithm bounds each user's contribution with `clip_norm`, and would
    otherwise take the setting without applying it."""
    value = config.gradient_clip_norm
    if value is None:
        return
    validation.check_number("gradient_clip_norm", value, 0, low_open=True)
    if registry.get(config.algorithm).private:
        takers = " and ".join(registry.names(lambda other: not other.private))
        raise ValueError(
            f"gradient_clip_norm clips the steps of {takers} (public pretraining), not "
            f"{config.algorithm}'s, which clips each user's update with clip_norm: leave "
            "gradient_clip_norm unset (pretrain.job.gradient_clip_norm sets pretraining's)"
        )


def chosen_optimizer(values: Mapping[str, Any], algorithm: registry.Algorithm) -> str:
    """What applies the job's update in layered `values`: its section's `optimizer`
    where its section has one (dp_sgd, logit_dp), else `server_optimizer`."""
    section = algorithm.section
    if section is not None and "optimizer" in section.keys():
        own = values.get(section.name) or {}
        return own.get("optimizer") or section.settings().optimizer
    return values.get("server_optimizer") or model_config.SGD


def without_inapplicable_defaults(
    values: Mapping[str, Any], given: Mapping[str, Any], algorithm: registry.Algorithm
) -> dict[str, Any]:
    """Layered `values` (recipes over defaults, the user's `given` on top) without the
    defaults that do not apply to the job's chosen optimizer: a recipe's server_momentum
    is sgd's, so with adam or lamb (whose momentum is beta1) it becomes 0, unless the
    user set it, which `check_server_optimizer` then refuses in one line (None, a
    config's null, means the default: not set); then those the algorithm's own settings
    make inapplicable (`Algorithm.without_inapplicable`)."""
    values = dict(values)
    unset = given.get("server_momentum") is None
    if unset and chosen_optimizer(values, algorithm) != model_config.SGD:
        values["server_momentum"] = 0.0
    if algorithm.without_inapplicable is not None:  # its own settings' defaults
        values = algorithm.without_inapplicable(values, given)
    return values


def check_server_optimizer(config: Any) -> None:
    """One line naming `server_optimizer` when the job cannot apply it: not one of
    `model_config.OPTIMIZERS`; adam or lamb for an algorithm whose step is not the
    federated server step (`Algorithm.server_optimizer`); or adam or lamb with a
    non-zero `server_momentum`, which they would ignore (their momentum is beta1)."""
    name = config.server_optimizer
    if name not in model_config.OPTIMIZERS:
        raise ValueError(
            f"server_optimizer must be one of {', '.join(model_config.OPTIMIZERS)}, got {name!r}"
        )
    if name == model_config.SGD:
        return
    algorithm = registry.get(config.algorithm)
    if not algorithm.server_optimizer:
        takers = " and ".join(registry.names(lambda other: other.server_optimizer))
        if algorithm.noise is accounting_spec.Noise.TREE:
            why = "its tree-aggregated noise cancels across rounds only in the linear sgd step"
        elif algorithm.section is not None and "optimizer" in algorithm.section.keys():
            why = f"it takes its optimizer from {algorithm.section.name}.optimizer"
        else:
            why = "its update is not a federated server step"
        raise ValueError(
            f"server_optimizer {name} applies to {takers}, not {config.algorithm} ({why}): "
            "leave server_optimizer unset"
        )
    if config.server_momentum:
        raise ValueError(
            f"server_momentum applies to the sgd server optimizer, not to {name} (its momentum "
            f"is beta1 = {model_config.ADAM_KEYS['adam_beta1']:g}): set server_momentum to 0"
        )

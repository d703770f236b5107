"""Federated metric learning (issue 27; `registry.Algorithm`): participants upload
embeddings, the trusted server's triplet loss sends noised derivatives back
(`training`). A round selects ceil(n(1 + over_selection)) users, n =
`users_per_virtual_client` (users per triplet group) x `virtual_clients_per_round`
(groups), from the users holding at least `samples_per_user` images (the population
the accountant counts). Its own fields and checks are `fields`. No TensorFlow.
"""

from __future__ import annotations

from typing import Any

from tff_algorithms.algorithms import registry
from tff_algorithms.algorithms.fdml import fields as fdml_fields
from tff_algorithms.privacy import accounting


def _eligible_users(reader: Any, user_ids: list[str], config: Any) -> list[str]:
    from tff_algorithms.algorithms.fdml import (
        training as fdml_training,  # TensorFlow, only when a job trains
    )

    return fdml_training.eligible_users(reader, user_ids, config.samples_per_user)


def _check_round_fill(config: Any, num_users: int) -> None:
    fdml_fields.fdml_selected_per_round(config, num_users)


def _accounting(config: Any, num_users: int, delta: float) -> accounting.AccountingSpec:
    return accounting.AccountingSpec(
        population=num_users,
        users_per_round=fdml_fields.fdml_selected_per_round(config, num_users),
        rounds=config.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=accounting.Mechanism.FDML,
    )


FDML = registry.register(
    registry.Algorithm(
        name="fdml",
        summary="federated metric learning: --virtual-clients-per-round groups of "
        "--users-per-virtual-client users a round, server-side triplet loss, noised "
        "derivatives and gradients",
        private=True,
        trainer="tff_algorithms.algorithms.fdml.training:train_fdml",
        accounting_rule=_accounting,
        mechanism=accounting.Mechanism.FDML,
        fields=fdml_fields.FDML_FIELDS,
        check_fields=fdml_fields.check_fields,
        check_job=fdml_fields.check_fdml_job,
        check_round_fill=_check_round_fill,
        eligible_users=_eligible_users,
        # Its virtual_clients_per_round counts triplet groups.
        round_groups="triplet groups per round",
        rounds_are="FDML rounds (embeddings up, noised triplet derivatives down, noised "
        "gradients up)",
        pipeline_trains=True,
        tff_runtime=True,
    )
)

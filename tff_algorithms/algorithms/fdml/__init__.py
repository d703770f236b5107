"""Federated metric learning (issue 27; `registry.Algorithm`): participants upload
embeddings, the trusted server's triplet loss sends noised derivatives back
(`training`). A round selects ceil(n(1 + over_selection)) users, n =
`fdml.users_per_group` x `fdml.groups_per_round`, from the users holding at least
`fdml.samples_per_user` images (the population the accountant counts). Its own
settings are the `fdml` section (`SECTION`; the settings and their checks:
`fields`). No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tff_algorithms.algorithms import registry
from tff_algorithms.algorithms.fdml import fields as fdml_fields
from tff_algorithms.privacy import accounting_spec

SECTION = registry.Section(
    name="fdml",
    settings=fdml_fields.FdmlSettings,
    # The triplet groups are the shared schedule's units (`rules`, `fdml_training`).
    shape={
        "groups_per_round": "virtual_clients_per_round",
        "users_per_group": "users_per_virtual_client",
    },
    legacy={
        "virtual_clients_per_round": "groups_per_round",
        "users_per_virtual_client": "users_per_group",
        **{f.name: f.name for f in dataclasses.fields(fdml_fields.FdmlSettings)},
    },
    describe=fdml_fields.DESCRIBE,
)


def _eligible_users(reader: Any, user_ids: list[str], config: Any) -> list[str]:
    from tff_algorithms.algorithms.fdml import (
        training as fdml_training,  # TensorFlow, only when a job trains
    )

    return fdml_training.eligible_users(reader, user_ids, config.settings.samples_per_user)


def _check_round_fill(config: Any, num_users: int) -> None:
    fdml_fields.fdml_selected_per_round(config, num_users)


def _accounting(config: Any, num_users: int, delta: float) -> accounting_spec.AccountingSpec:
    return accounting_spec.AccountingSpec(
        population=num_users,
        users_per_round=fdml_fields.fdml_selected_per_round(config, num_users),
        rounds=config.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=accounting_spec.Mechanism.FDML,
    )


FDML = registry.register(
    registry.Algorithm(
        name="fdml",
        summary="federated metric learning: --fdml-groups-per-round groups of "
        "--fdml-users-per-group users a round, server-side triplet loss, noised "
        "derivatives and gradients",
        private=True,
        trainer="tff_algorithms.algorithms.fdml.training:train_fdml",
        accounting_rule=_accounting,
        mechanism=accounting_spec.Mechanism.FDML,
        section=SECTION,
        check_job=fdml_fields.check_fdml_job,
        check_round_fill=_check_round_fill,
        eligible_users=_eligible_users,
        # Its schedule's units are triplet groups.
        round_groups="triplet groups per round",
        rounds_are="FDML rounds (embeddings up, noised triplet derivatives down, noised "
        "gradients up)",
        pipeline_trains=True,
        tff_runtime=True,
        paper_theorem="tff_algorithms.algorithms.fdml.privacy:paper_theorem",
    )
)

"""Whether a job's local heads have a row for every identity a virtual client may hold,
and what a split's counts say about a job before anything trains.

Checked twice, each time before any budget is charged: by the pipeline right after the
split (`check_split_can_train`, called by `pipeline.components.training.
CheckTrainingSchedule` before dedup, statistics and pretraining spend their minutes)
and by `train_job.run_train_job` from the partition it trains on. No TFF at import: the
pipeline's seconds-long check imports this module.

The head capacity itself is a public setting (`TrainJobConfig.head_capacity`), never
sized from the data: it is a shape every virtual client's computation has
(docs/privacy.md, "Local head capacity").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from beam_jobs import partition, split_protocols, splits
from tff_algorithms import algorithms
from tff_algorithms.config.job_config import TrainJobConfig


def identities_a_client_may_hold(
    config: TrainJobConfig, identities_per_user: Mapping[str, int], identities: int | None
) -> tuple[int, str]:
    """(the most distinct identities a virtual client of the job may hold, why that many).

    The least of three bounds: the sum of the `users_per_virtual_client` largest per-user
    identity counts of `identities_per_user` ({distinct identities a user holds: users
    holding that many}), the `identities` of the training data (None: not counted, an
    older partition), which bounds it when users share identities (writers of the same
    62 characters), and `max_examples_per_client` (one identity per example)."""
    k = config.users_per_virtual_client
    bounds = [
        (
            partition.most_identities_of_users(
                {partition.IDENTITIES_PER_USER: identities_per_user}, k
            ),
            f"the {k} users holding the most identities hold that many together",
        ),
        (config.max_examples_per_client, "max_examples_per_client examples, one identity each"),
    ]
    if identities is not None:
        bounds.append((identities, "the training data's identities, which its users share"))
    return min(bounds, key=lambda bound: bound[0])


def check_local_heads_fit(
    config: TrainJobConfig,
    identities_per_user: Mapping[str, int] | None,
    identities: int | None = None,
) -> None:
    """Refuses a job whose local heads have fewer rows than the identities a virtual
    client may hold (`identities_a_client_may_hold`): when users hold many identities, a
    round drawing the users holding the most would stop the job midway
    (`_head_capacity_check` of the federated trainer), its budget spent.
    `identities_per_user` None: counts not kept (an older partition), checked per round
    instead."""
    if not algorithms.get(config.algorithm).local_heads:
        return  # DP-FedAvg's head is global; the others have no federated head
    if identities_per_user is None:
        return
    needed, why = identities_a_client_may_hold(config, identities_per_user, identities)
    capacity = config.client_config().head_capacity
    if needed > capacity:
        raise ValueError(
            f"a virtual client of {config.users_per_virtual_client} training users may hold "
            f"{needed} identities ({why}), more than the local head capacity "
            f"{capacity}: set head_capacity (--head-capacity, train.head_capacity) to at "
            f"least {needed}"
        )


def check_split_can_train(config: TrainJobConfig, split_summary: Mapping[str, Any]) -> None:
    """Raises ValueError naming the setting to change when the training split of
    `split_summary` (`beam_jobs.splits.run_split`'s) cannot carry `config`: a round its
    users cannot fill or a target epsilon out of reach (`TrainJobConfig.calibrated_for`),
    or users whose identities overflow a virtual client's local head."""
    config.calibrated_for(split_summary["users"][split_protocols.TRAIN])
    check_local_heads_fit(
        config,
        split_summary.get(splits.TRAIN_IDENTITIES_PER_USER),
        split_summary.get("identities", {}).get(split_protocols.TRAIN),
    )

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


def check_local_heads_fit(
    config: TrainJobConfig, identities_per_user: Mapping[str, int] | None
) -> None:
    """Refuses a job whose local heads have fewer rows than the identities a virtual
    client may hold: when users share identities a user holds many, and a round drawing
    the users holding the most would stop the job midway (`_head_capacity_check` of the
    federated trainer), its budget spent. The bound is the sum of the
    `users_per_virtual_client` largest per-user identity counts of `identities_per_user`
    ({distinct identities a user holds: users holding that many}, `partition.
    IDENTITIES_PER_USER`), at most `max_examples_per_client` (one identity per example).
    None: counts not kept (an older partition), checked per round instead."""
    if not algorithms.get(config.algorithm).local_heads:
        return  # DP-FedAvg's head is global; the others have no federated head
    if identities_per_user is None:
        return
    most = partition.most_identities_of_users(
        {partition.IDENTITIES_PER_USER: identities_per_user}, config.users_per_virtual_client
    )
    needed = min(most, config.max_examples_per_client)
    capacity = config.client_config().head_capacity
    if needed > capacity:
        raise ValueError(
            f"a virtual client of {config.users_per_virtual_client} training users may hold "
            f"{needed} identities (users hold several), more than the local head capacity "
            f"{capacity}: set head_capacity (--head-capacity, train.head_capacity) to at "
            f"least {needed}"
        )


def check_split_can_train(config: TrainJobConfig, split_summary: Mapping[str, Any]) -> None:
    """Raises ValueError naming the setting to change when the training split of
    `split_summary` (`beam_jobs.splits.run_split`'s) cannot carry `config`: a round its
    users cannot fill or a target epsilon out of reach (`TrainJobConfig.calibrated_for`),
    or users whose identities overflow a virtual client's local head."""
    config.calibrated_for(split_summary["users"][split_protocols.TRAIN])
    check_local_heads_fit(config, split_summary.get(splits.TRAIN_IDENTITIES_PER_USER))

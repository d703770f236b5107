"""The privacy mechanism of a federated job, built from the accounting spec that charges it.

A DP learning process is a process shape (`processes.build_fedemb_process` or
`build_fedavg_process`) given a DP aggregator. `aggregator_for_spec` is the one place
that chooses that aggregator: the kind of noise (`Mechanism.DPSGD`: independent Gaussian
noise each round; `Mechanism.DPFTRL`: tree-aggregated noise), the noise multiplier and
the tree's restarts all come from the `accounting_spec.AccountingSpec` the job's ledger
accounts with, so a job cannot train one mechanism and account for another.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow_federated as tff

from tff_algorithms.algorithms.dp_fedemb import aggregators
from tff_algorithms.privacy import accounting_spec


class _TreeAggregationFactory(tff.aggregators.UnweightedAggregationFactory):
    """Tree aggregation whose record specs are those of the value it is created for.

    The tree's noise generator needs the structure of one client's update; taking it
    from `create`'s value type means the caller cannot pass a structure other than the
    one aggregated (the FedEmb backbone, or DP-FedAvg's backbone and global head).
    """

    def __init__(
        self, build: Callable[[object], tff.aggregators.UnweightedAggregationFactory]
    ) -> None:
        self._build = build

    def create(self, value_type: tff.Type) -> tff.templates.AggregationProcess:
        return self._build(tff.types.type_to_tf_tensor_specs(value_type)).create(value_type)


def aggregator_for_spec(
    spec: accounting_spec.AccountingSpec,
    *,
    clip_norm: float,
    virtual_clients_per_round: int,
    noise_seed: int,
    rounds_per_epoch: int,
    use_efficient_tree: bool = True,
) -> tff.aggregators.UnweightedAggregationFactory:
    """The DP aggregator that `spec` accounts for.

    Args:
      spec: the job's accounting spec; its mechanism, noise multiplier z and
        `restart_every_epoch` define the noise (z is never passed separately).
      clip_norm: γ, the L2 clip of one virtual client's update.
      virtual_clients_per_round: the planned M, the aggregate's fixed denominator.
      noise_seed: seed of the noise (`loop_schedule.job_noise_seed` in production).
      rounds_per_epoch: the training schedule's rounds per epoch. The tree restarts
        every this many rounds, and the spec's tree accounting (restarts, or one tree's
        participations and min separation) assumes its own `spec.rounds_per_epoch`: the
        two must agree. Independent Gaussian noise does not depend on it.
      use_efficient_tree: Honaker's variance-reduced prefix sums (same privacy).

    Raises:
      ValueError: a tree spec whose rounds per epoch differ from the schedule's.
    """
    if spec.mechanism is accounting_spec.Mechanism.DPSGD:
        return aggregators.gaussian_fixed(
            noise_multiplier=spec.noise_multiplier,
            clip_norm=clip_norm,
            virtual_clients_per_round=virtual_clients_per_round,
            noise_seed=noise_seed,
        )
    if rounds_per_epoch != spec.rounds_per_epoch:
        raise ValueError(
            f"the schedule has {rounds_per_epoch} rounds per epoch but the accounting spec "
            f"assumes {spec.rounds_per_epoch} ({spec.population} users, "
            f"{spec.users_per_round} per round): the tree would restart or repeat users at "
            "other rounds than the accountant charges for"
        )
    restart_every_rounds = rounds_per_epoch if spec.restart_every_epoch else None

    def tree(record_specs: object) -> tff.aggregators.UnweightedAggregationFactory:
        return aggregators.tree_aggregation(
            noise_multiplier=spec.noise_multiplier,
            clip_norm=clip_norm,
            virtual_clients_per_round=virtual_clients_per_round,
            record_specs=record_specs,
            noise_seed=noise_seed,
            restart_every_rounds=restart_every_rounds,
            use_efficient=use_efficient_tree,
        )

    return _TreeAggregationFactory(tree)

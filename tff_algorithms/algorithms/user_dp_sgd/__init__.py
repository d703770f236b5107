"""The user-level DP-SGD baselines, dp-sgd-centralized and dp-last-layer (issue 21,
item 2; `registry.Algorithm`s), and their recipes.

Both read their `dp_sgd` section (`SECTION`, `config`): `rounds`
steps of `dp_sgd.users_per_step` single users, each user's gradient clipped,
noise on the sum, accounted as DP-FedEmb with one user per virtual client; with
`dp_sgd.full_batch` every training user each step, accounted as that many Gaussian
mechanisms without amplification (`accounting_spec.Sampling.FULL`, `_accounting`).
The noised mean gradient goes to `dp_sgd.optimizer` (sgd, adam, lamb).
dp-last-layer trains the zero-initialised embedding layer alone on cached features of
the frozen prefix. Each takes its recipe over the private recipe when chosen
(`recipes.own_recipe_values`). The trainers (below) import `tff_algorithms.algorithms.user_dp_sgd.training`
when a job trains; registering imports no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tff_algorithms.algorithms import registry, rules
from tff_algorithms.algorithms.user_dp_sgd.config import (
    DESCRIBE,
    ZERO_INIT_HEAD_LOSS,
    DpSgdSettings,
    check_full_batch_fills,
    check_last_layer_job,
    check_user_dp_sgd_job,
)
from tff_algorithms.privacy import accounting_spec

# Both algorithms' own settings: a step samples single users by the shared schedule
# (or takes them all, `full_batch`).
SECTION = registry.Section(
    name="dp_sgd",
    settings=DpSgdSettings,
    shape={"users_per_step": "virtual_clients_per_round"},
    implied={"users_per_virtual_client": 1},
    legacy={"virtual_clients_per_round": "users_per_step"},
    describe=DESCRIBE,
)


def _without_inapplicable(values: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """With dp_sgd.sigmoid_head chosen, the recipe's head_loss (cosface, for the
    federated algorithms) gives way to the softmax head it scores, unless the user set
    head_loss, which `check_user_dp_sgd_job` then refuses in one line."""
    values = dict(values)
    if (values.get(SECTION.name) or {}).get("sigmoid_head") and given.get("head_loss") is None:
        values["head_loss"] = ZERO_INIT_HEAD_LOSS
    return values


# Layered over the private recipe: a step's users are `dp_sgd.users_per_step`; the rest of the private recipe (target epsilon 8 at
# delta 1e-4, the model) stays. First values, not yet tuned on the default data (the
# bench rows of issue 21 item 3 compare them).
# dp-sgd-centralized: the private recipe's trained layers (conv and GroupNorm) and head
# loss (CosFace, on a global head), 256 users a step (~1,000 images on the default
# data) for 100 steps, and DP-FedEmb's server step (lr 0.3, no momentum): lr 0.5 with
# momentum 0.9 (an effective step of 5) lost 0.11 recall@FAR 1e-2 against it on real
# photos from the pipeline's pretrained start (BENCHMARKS.md, "The feature cache on
# real images").
DP_SGD_CENTRALIZED_RECIPE: Mapping[str, Any] = {
    "algorithm": "dp-sgd-centralized",
    "rounds": 100,
    "dp_sgd": {"users_per_step": 256},
    "server_learning_rate": 0.3,
    "server_momentum": 0.0,
    "evaluate_every": 25,
}
# dp-last-layer (the seed's recipe: zero last layer, large batches, many steps): the
# embedding layer alone on cached features, a third of the default data's ~3,000
# training users a step, 300 steps; softmax because a zero embedding has no direction
# for the cosine losses (`user_dp_sgd`).
DP_LAST_LAYER_RECIPE: Mapping[str, Any] = {
    "algorithm": "dp-last-layer",
    "rounds": 300,
    "dp_sgd": {"users_per_step": 1024},
    "trainable_layers": ["embedding"],
    "head_loss": "softmax",
    "server_learning_rate": 1.0,
    "server_momentum": 0.9,
    "evaluate_every": 100,
}


def _accounting(config: Any, num_users: int, delta: float) -> accounting_spec.AccountingSpec:
    """Full batch: every user in each of `rounds` steps, no sampling to amplify by
    (`accounting_spec.Sampling.FULL`); else the sampled schedule's (`rules`)."""
    if not config.settings.full_batch:
        return rules.scheduled_accounting(config, num_users, delta)
    return accounting_spec.AccountingSpec(
        population=num_users,
        users_per_round=num_users,
        rounds=config.rounds,
        noise_multiplier=config.noise_multiplier,
        delta=delta,
        mechanism=accounting_spec.Mechanism.DPSGD,
        sampling=accounting_spec.Sampling.FULL,
    )


def train_dp_sgd_centralized(inputs: Any, schedule_seed: int) -> Any:
    """dp-sgd-centralized's trainer (`user_dp_sgd.train_user_dp_sgd`)."""
    from tff_algorithms.algorithms.user_dp_sgd import (
        training as user_dp_sgd,  # TensorFlow, only when a job trains
    )

    return user_dp_sgd.train_user_dp_sgd(inputs, schedule_seed, last_layer=False)


def train_dp_last_layer(inputs: Any, schedule_seed: int) -> Any:
    """dp-last-layer's trainer (`user_dp_sgd.train_user_dp_sgd` on the last layer)."""
    from tff_algorithms.algorithms.user_dp_sgd import (
        training as user_dp_sgd,  # TensorFlow, only when a job trains
    )

    return user_dp_sgd.train_user_dp_sgd(inputs, schedule_seed, last_layer=True)


DP_SGD_CENTRALIZED = registry.register(
    registry.Algorithm(
        name="dp-sgd-centralized",
        summary="user-level DP-SGD: --dp-sgd-users-per-step users a step, each user's "
        "gradient clipped; takes its recipe over --recipe",
        private=True,
        trainer="tff_algorithms.algorithms.user_dp_sgd:train_dp_sgd_centralized",
        accounting_rule=_accounting,
        mechanism=accounting_spec.Mechanism.DPSGD,
        recipe=DP_SGD_CENTRALIZED_RECIPE,
        section=SECTION,
        check_job=check_user_dp_sgd_job,
        without_inapplicable=_without_inapplicable,
        check_round_fill=check_full_batch_fills,
        rounds_are="user-level DP-SGD steps (one clipped gradient per sampled user)",
        pipeline_trains=True,
    )
)
DP_LAST_LAYER = registry.register(
    registry.Algorithm(
        name="dp-last-layer",
        summary="user-level DP-SGD on the zero-initialised embedding layer alone, on cached "
        "features of the frozen prefix; takes its recipe over --recipe",
        private=True,
        trainer="tff_algorithms.algorithms.user_dp_sgd:train_dp_last_layer",
        accounting_rule=_accounting,
        mechanism=accounting_spec.Mechanism.DPSGD,
        recipe=DP_LAST_LAYER_RECIPE,
        # It trains the embedding layer alone whatever the prefix holds.
        keeps_recipe_layers=True,
        section=SECTION,
        check_job=check_last_layer_job,
        without_inapplicable=_without_inapplicable,
        check_round_fill=check_full_batch_fills,
        rounds_are="user-level DP-SGD steps of the embedding layer on cached features",
        # Always on the cache of its frozen prefix (`user_dp_sgd`).
        cacheable=True,
        pipeline_trains=True,
    )
)

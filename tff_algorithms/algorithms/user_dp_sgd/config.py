"""The two user-level DP-SGD baselines' job checks (issue 21, item 2).

TensorFlow-free, so `job_config` can check a job before anything is built (their
`registry.Algorithm`s: `tff_algorithms/algorithms/user_dp_sgd/__init__.py`); the training is
`user_dp_sgd`. Their own settings are the `dp_sgd` section (`DpSgdSettings`, its
`users_per_step` the shared schedule's count): `rounds` steps, each sampling
`dp_sgd.users_per_step` users (n) without
replacement by DP-FedEmb's schedule with one user per virtual client (or, with
`dp_sgd.full_batch`, every training user), each user's clipped gradient (`clip_norm`),
noise `noise_multiplier`·clip_norm on the sum, the noised sum over n applied at
`server_learning_rate` by `dp_sgd.optimizer` (momentum SGD with `server_momentum`,
Adam or LAMB; issue 42). Local training, local-head and dropout fields do not apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from beam_jobs import schedule
from tff_algorithms.algorithms import rules
from tff_algorithms.base import validation
from tff_algorithms.config.model_config import (
    ADAM_KEYS,
    OPTIMIZER_DESCRIBE,
    SGD,
    check_optimizer_momentum,
    check_optimizer_settings,
)

# The layer dp-last-layer trains (both backbone families end in it; `models`).
EMBEDDING_LAYER = "embedding"
# The head loss defined at a zero embedding (`user_dp_sgd`, module docstring).
ZERO_INIT_HEAD_LOSS = "softmax"


@dataclasses.dataclass(frozen=True)
class DpSgdSettings:
    """The `dp_sgd` section's settings beside its `users_per_step` (the shared
    schedule's count, `TrainJobConfig.virtual_clients_per_round`).

    Attributes:
      optimizer: what applies the noised mean gradient (`OPTIMIZERS`): sgd (momentum
        `server_momentum`), adam or lamb (`tff_algorithms.modeling.optimizers`);
        post-processing, so the accounting is the same for each.
      adam_beta1, adam_beta2, adam_epsilon: Adam's and LAMB's moment decays and the
        ε added to √v̂ (Kingma and Ba's defaults).
      weight_decay: λ·w added to Adam's and LAMB's update (before LAMB's trust ratio).
      full_batch: every training user in every step instead of a sample of
        `users_per_step` (which must then be auto); accounted as that many Gaussian
        mechanisms without amplification (`accounting_spec.Sampling.FULL`).
      sigmoid_head: score the softmax head's logits eᵀω plus a trained per-identity
        bias with sigmoid cross-entropy (one-vs-all, summed over identities) instead of
        softmax, the seed paper's loss.
      head_bias: that bias's start (the paper's −10: every identity's probability
        starts near 0); only with `sigmoid_head`.
    """

    optimizer: str = SGD
    adam_beta1: float = ADAM_KEYS["adam_beta1"]
    adam_beta2: float = ADAM_KEYS["adam_beta2"]
    adam_epsilon: float = ADAM_KEYS["adam_epsilon"]
    weight_decay: float = ADAM_KEYS["weight_decay"]
    full_batch: bool = False
    sigmoid_head: bool = False
    head_bias: float = -10.0

    def __post_init__(self) -> None:
        check_optimizer_settings("dp_sgd", self)
        validation.check_bool("dp_sgd.full_batch", self.full_batch)
        validation.check_bool("dp_sgd.sigmoid_head", self.sigmoid_head)
        validation.check_number("dp_sgd.head_bias", self.head_bias, -100, 100, low_open=True)
        if not self.sigmoid_head and self.head_bias != DpSgdSettings.head_bias:
            raise ValueError(
                "dp_sgd.head_bias applies to the sigmoid head: set dp_sgd.sigmoid_head to "
                "true, or leave dp_sgd.head_bias unset"
            )


# What each key of the `dp_sgd` section means (--help, docs/config.md).
DESCRIBE = {
    "users_per_step": "users a step, each user's gradient clipped (n; or auto: the most "
    "the users fill)",
    **OPTIMIZER_DESCRIBE,
    "full_batch": "every training user in every step (no sampling; users_per_step auto), "
    "accounted without amplification",
    "sigmoid_head": "sigmoid cross-entropy over the identities, with a trained bias, "
    "instead of softmax (head_loss softmax)",
    "head_bias": "the sigmoid head's starting bias (the paper's -10)",
}


def check_user_dp_sgd_job(config: Any) -> None:
    """One-line ValueError for a dp-sgd-centralized or dp-last-layer job that user-level
    DP-SGD cannot train (`tff_algorithms/algorithms/user_dp_sgd/__init__.py` runs it on theirs)."""
    name = config.algorithm
    if config.users_per_virtual_client != 1:
        raise ValueError(
            f"{name} clips each sampled user's own gradient (no virtual clients): set "
            f"users_per_virtual_client to 1 (got {config.users_per_virtual_client})"
        )
    for field in ("over_selection", "failure_injection_rate"):
        if getattr(config, field):
            raise ValueError(f"{field} applies to federated rounds, not to {name}: set it to 0")
    settings = config.settings
    if settings.sigmoid_head and config.head_loss != ZERO_INIT_HEAD_LOSS:
        raise ValueError(
            f"dp_sgd.sigmoid_head scores the {ZERO_INIT_HEAD_LOSS} head's logits: set "
            f"head_loss to {ZERO_INIT_HEAD_LOSS} (got {config.head_loss})"
        )
    check_optimizer_momentum("dp_sgd", settings, config.server_momentum)


def check_full_batch_fills(config: Any, num_users: int) -> None:
    """One line when `num_users` cannot fill a step of the job's schedule, or when a
    full-batch job's users a step is not every training user (`auto` resolves to it)."""
    rules.check_schedule_fills(config, num_users)
    steps_users = config.virtual_clients_per_round
    if config.settings.full_batch and steps_users not in (schedule.AUTO, num_users):
        raise ValueError(
            f"dp_sgd.full_batch takes every one of the {num_users} training users each "
            f"step: set dp_sgd.users_per_step to auto (got {steps_users})"
        )


def check_last_layer_job(config: Any) -> None:
    """`check_user_dp_sgd_job`, then what training the zero-initialised embedding layer
    alone on cached features needs (a dp-last-layer job)."""
    check_user_dp_sgd_job(config)
    name = config.algorithm
    if tuple(config.trainable_layers) != (EMBEDDING_LAYER,):
        raise ValueError(
            f"{name} trains the {EMBEDDING_LAYER} layer alone on cached features: set "
            f'trainable_layers to ["{EMBEDDING_LAYER}"] (got {list(config.trainable_layers)}; '
            f"a backbone of your own names its last layer {EMBEDDING_LAYER})"
        )
    if config.cache_features is False:
        raise ValueError(
            f"{name} trains on cached features of the frozen prefix: set cache_features "
            "to null or true"
        )
    if config.head_loss != ZERO_INIT_HEAD_LOSS:
        raise ValueError(
            f"{name} starts the {EMBEDDING_LAYER} layer at zero, where the {config.head_loss} "
            f"loss's normalised embedding is undefined: set head_loss to {ZERO_INIT_HEAD_LOSS}"
        )

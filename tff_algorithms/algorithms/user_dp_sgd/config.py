"""The two user-level DP-SGD baselines' job checks (issue 21, item 2).

TensorFlow-free, so `job_config` can check a job before anything is built (their
`registry.Algorithm`s: `tff_algorithms/algorithms/user_dp_sgd/__init__.py`); the training is
`user_dp_sgd`. Their own settings are the `dp_sgd` section (`DpSgdSettings`, its
`users_per_step` the shared schedule's count): `rounds` steps, each sampling
`dp_sgd.users_per_step` users (n) without
replacement by DP-FedEmb's schedule with one user per virtual client, each user's
clipped gradient (`clip_norm`), noise `noise_multiplier`·clip_norm on the sum, momentum
SGD at `server_learning_rate` / `server_momentum` on the noised sum over n. Local
training, local-head and dropout fields do not apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# The layer dp-last-layer trains (both backbone families end in it; `models`).
EMBEDDING_LAYER = "embedding"
# The head loss defined at a zero embedding (`user_dp_sgd`, module docstring).
ZERO_INIT_HEAD_LOSS = "softmax"


@dataclasses.dataclass(frozen=True)
class DpSgdSettings:
    """The `dp_sgd` section's settings beside its `users_per_step` (the shared
    schedule's count, `TrainJobConfig.virtual_clients_per_round`): none yet."""


# What each key of the `dp_sgd` section means (--help, docs/config.md).
DESCRIBE = {
    "users_per_step": "users a step, each user's gradient clipped (n; or auto: the most "
    "the users fill)",
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


def check_last_layer_job(config: Any) -> None:
    """`check_user_dp_sgd_job`, then what training the zero-initialised embedding layer
    alone on cached features needs (a dp-last-layer job)."""
    check_user_dp_sgd_job(config)
    name = config.algorithm
    if tuple(config.trainable_layers) != (EMBEDDING_LAYER,):
        raise ValueError(
            f"{name} trains the {EMBEDDING_LAYER} layer alone on cached features: set "
            f'trainable_layers to ["{EMBEDDING_LAYER}"] (got {list(config.trainable_layers)})'
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

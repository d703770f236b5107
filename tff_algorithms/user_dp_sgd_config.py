"""The two user-level DP-SGD baselines' names and job checks (issue 21, item 2).

TensorFlow-free, so `job_config` can check a job before anything is built; the
training is `user_dp_sgd`. Both read the federated fields as one step's shape:
`rounds` steps, each sampling `virtual_clients_per_round` users (n) without
replacement by DP-FedEmb's schedule with one user per virtual client, each user's
clipped gradient (`clip_norm`), noise `noise_multiplier`·clip_norm on the sum, momentum
SGD at `server_learning_rate` / `server_momentum` on the noised sum over n. Local
training, local-head and dropout fields do not apply.
"""

from __future__ import annotations

from typing import Any

# User-level DP-SGD over the backbone's trainable layers and a global head.
DP_SGD_CENTRALIZED = "dp-sgd-centralized"
# The embedding layer alone, zero-initialised, on cached features of the frozen prefix.
DP_LAST_LAYER = "dp-last-layer"
USER_DP_SGD_ALGORITHMS = (DP_SGD_CENTRALIZED, DP_LAST_LAYER)
# The layer dp-last-layer trains (both backbone families end in it; `models`).
EMBEDDING_LAYER = "embedding"
# The head loss defined at a zero embedding (`user_dp_sgd`, module docstring).
ZERO_INIT_HEAD_LOSS = "softmax"


def check_user_dp_sgd_job(config: Any) -> None:
    """One-line ValueError for a dp-sgd-centralized or dp-last-layer job that its
    algorithm cannot train (other algorithms pass)."""
    name = config.algorithm
    if name not in USER_DP_SGD_ALGORITHMS:
        return
    if config.users_per_virtual_client != 1:
        raise ValueError(
            f"{name} clips each sampled user's own gradient (no virtual clients): set "
            f"users_per_virtual_client to 1 (got {config.users_per_virtual_client})"
        )
    for field in ("over_selection", "failure_injection_rate"):
        if getattr(config, field):
            raise ValueError(f"{field} applies to federated rounds, not to {name}: set it to 0")
    if name != DP_LAST_LAYER:
        return
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

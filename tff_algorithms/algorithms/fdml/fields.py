"""fdml's own settings (issue 27, item 3; issue 39, item 3): the `fdml` section of a
training job, its checks, and the users an fdml round selects. No TensorFlow.

fdml's `registry.Section` (`tff_algorithms/algorithms/fdml/__init__.py`) is built from them: a
job record or a pipeline's `train` holds `fdml: {groups_per_round, users_per_group,
samples_per_user, ...}`; `TrainJobConfig.settings` holds an `FdmlSettings`, checked
only for an fdml job; the triplet groups set the shared schedule's counts
(`TrainJobConfig.virtual_clients_per_round` / `users_per_virtual_client`). The flat
keys of the release before (`virtual_clients_per_round`, `samples_per_user`, ...)
are accepted with one deprecation line (`registry.user_layer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from beam_jobs import schedule
from tff_algorithms.base import validation

# fdml's triplet strategies (`triplet.STRATEGIES`, which imports TensorFlow).
TRIPLET_STRATEGIES = ("batch_all", "semi_hard")


@dataclasses.dataclass(frozen=True)
class FdmlSettings:
    """fdml's settings beside the triplet groups' counts (`FDML_SECTION`).

    Attributes:
      samples_per_user: s, images each participant embeds per round (at least 2: a
        positive pair).
      derivative_clip: C_r, the L2 clip of each derivative row.
      derivative_noise_share: the derivatives' share of the round's 1/z^2.
      triplet_strategy / triplet_margin: `batch_all` or `semi_hard`, margin m.
    """

    samples_per_user: int = 8
    derivative_clip: float = 1.0
    derivative_noise_share: float = 0.5
    triplet_strategy: str = TRIPLET_STRATEGIES[0]
    triplet_margin: float = 0.2

    def __post_init__(self) -> None:
        validation.check_int("fdml.samples_per_user", self.samples_per_user, 2)
        validation.check_number("fdml.derivative_clip", self.derivative_clip, 0, low_open=True)
        validation.check_number(
            "fdml.derivative_noise_share", self.derivative_noise_share, 0, 1, low_open=True
        )
        if self.triplet_strategy not in TRIPLET_STRATEGIES:
            raise ValueError(
                f"fdml.triplet_strategy must be one of {TRIPLET_STRATEGIES}, "
                f"got {self.triplet_strategy!r}"
            )
        validation.check_number("fdml.triplet_margin", self.triplet_margin, 0, low_open=False)


# What each key of the `fdml` section means (--help, docs/config.md), the triplet
# groups' counts first.
DESCRIBE = {
    "groups_per_round": "triplet groups a round (or auto: the most the users fill)",
    "users_per_group": "users per triplet group (g)",
    "samples_per_user": "images each participant embeds per round (s)",
    "derivative_clip": "L2 clip of each triplet-derivative row (C_r)",
    "derivative_noise_share": "the derivatives' share of the round's noise budget 1/z^2, in (0, 1)",
    "triplet_strategy": "batch_all | semi_hard",
    "triplet_margin": "the triplet loss margin m",
}


def check_fdml_job(config: Any) -> None:
    """Refuses the other fields an fdml job cannot honour (an fdml job's)."""
    if config.failure_injection_rate:
        raise ValueError(
            "failure_injection_rate applies to DP-FedEmb's virtual clients, not to fdml: "
            "set it to 0"
        )


def fdml_selected_per_round(config: Any, num_users: int) -> int:
    """Users an fdml round selects, ceil(n (1 + over_selection)) with n = g x groups (all
    of them count for the sampling: any may fill the buffer); one line when `num_users`
    (those holding `samples_per_user` images) cannot fill it."""
    n = config.users_per_virtual_client * int(config.virtual_clients_per_round)
    selected = schedule.selected_per_round(n, float(config.over_selection))
    if selected > num_users:
        raise ValueError(
            f"fdml selects {selected} users a round ({config.virtual_clients_per_round} "
            f"groups of {config.users_per_virtual_client}, over_selection "
            f"{config.over_selection:g}) but only {num_users} users hold "
            f"samples_per_user={config.settings.samples_per_user} images"
        )
    return selected

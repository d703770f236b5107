"""The training-job fields only `fdml` reads (issue 27, item 3), and their checks.

`job_config.TrainJobConfig` holds the fields (their public names and defaults are
its own); this module names them (`FDML_FIELDS`, fdml's `Algorithm.fields` in
`tff_algorithms/algorithms/fdml/__init__.py`: `TrainJobConfig.to_dict` leaves them out of other
algorithms' records at their defaults), validates them (`check_fields`, for every job;
`check_fdml_job`, for an fdml job) and gives the users an fdml round selects
(`fdml_selected_per_round`). No TensorFlow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from beam_jobs import schedule
from tff_algorithms.base import validation

if TYPE_CHECKING:
    from tff_algorithms.config.job_config import TrainJobConfig

# The fields only fdml reads (`TrainJobConfig`).
FDML_FIELDS = (
    "samples_per_user",
    "derivative_clip",
    "derivative_noise_share",
    "triplet_strategy",
    "triplet_margin",
)
# fdml's triplet strategies (`triplet.STRATEGIES`, which imports TensorFlow).
TRIPLET_STRATEGIES = ("batch_all", "semi_hard")


def check_fields(config: TrainJobConfig) -> None:
    """Validates `config`'s `FDML_FIELDS` (a job of any algorithm)."""
    validation.check_int("samples_per_user", config.samples_per_user, 2)
    validation.check_number("derivative_clip", config.derivative_clip, 0, low_open=True)
    validation.check_number(
        "derivative_noise_share", config.derivative_noise_share, 0, 1, low_open=True
    )
    if config.triplet_strategy not in TRIPLET_STRATEGIES:
        raise ValueError(
            f"triplet_strategy must be one of {TRIPLET_STRATEGIES}, got {config.triplet_strategy!r}"
        )
    validation.check_number("triplet_margin", config.triplet_margin, 0, low_open=False)


def check_fdml_job(config: TrainJobConfig) -> None:
    """Refuses the other fields an fdml job cannot honour (an fdml job's)."""
    if config.failure_injection_rate:
        raise ValueError(
            "failure_injection_rate applies to DP-FedEmb's virtual clients, not to fdml: "
            "set it to 0"
        )


def fdml_selected_per_round(config: TrainJobConfig, num_users: int) -> int:
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
            f"samples_per_user={config.samples_per_user} images"
        )
    return selected

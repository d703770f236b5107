"""The FDML driver loop (issue 27, items 1-2): `run_fdml` runs rounds of an
`fdml.FdmlProcess` with the sampling the accountant assumes and charges every release.

`fdml` builds the process (the two federated computations and the trusted server's step);
this module chooses who takes part in each round (`round_users`, uniformly without
replacement, from a seed alone), which participants fail (`draw_failures`, independent
of the data), restarts rounds with too few uploads, and accounts for the run
(`privacy_spec`: the `fdml_privacy` spec of exactly the mechanism the process runs).
The training job's loop (`fdml_training`) samples with the same `round_users`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from beam_jobs import schedule
from tff_algorithms.algorithms.fdml import privacy as fdml_privacy
from tff_algorithms.algorithms.fdml.protocol import UNPRIVATE_METRICS, FdmlProcess
from tff_algorithms.algorithms.fdml.round_config import FdmlConfig
from tff_algorithms.base import validation


def privacy_spec(
    config: FdmlConfig,
    *,
    population: int,
    selected_per_round: int,
    rounds: int,
    abandoned_rounds: int = 0,
    sampling: fdml_privacy.Sampling | str = fdml_privacy.Sampling.UNIFORM,
) -> fdml_privacy.FdmlPrivacySpec:
    """What the accountant charges for a run of `config`: the group size, samples and noise
    the process uses, so a run cannot train one mechanism and account for another.

    `selected_per_round`: participants selected per round (over-selection included);
    `rounds` / `abandoned_rounds`: the run's applied and abandoned rounds (restarts are
    not charged). A config without a clip has no sensitivity: its noise counts as zero
    (epsilon infinite).
    """
    if selected_per_round < config.users_per_round:
        raise ValueError(
            f"selected_per_round ({selected_per_round}) is below users_per_round "
            f"({config.users_per_round})"
        )
    return fdml_privacy.FdmlPrivacySpec(
        population=population,
        users_per_round=selected_per_round,
        users_per_group=config.group_size,
        samples_per_user=config.samples_per_user,
        derivative_noise_multiplier=(
            config.derivative_noise_multiplier if config.row_clip is not None else 0.0
        ),
        gradient_noise_multiplier=(
            config.gradient_noise_multiplier if config.gradient_clip is not None else 0.0
        ),
        rounds=rounds,
        abandoned_rounds=abandoned_rounds,
        sampling=sampling,
    )


def draw_failures(
    seed: int, round_num: int, selected: int, case_a_rate: float, case_b_rate: float
) -> tuple[list[int], list[int]]:
    """Case A and Case B failures of one round, drawn from (seed, round) alone: independent
    of the data, as the accounting requires. Returns (case_a, case_b) index lists."""
    rng = np.random.default_rng([seed, round_num])
    a = rng.random(selected) < case_a_rate
    b = rng.random(selected) < case_b_rate
    return [int(i) for i in np.flatnonzero(a)], [int(i) for i in np.flatnonzero(b & ~a)]


def round_users(
    seed: int, round_num: int, attempt: int, population: int, selected: int
) -> np.ndarray:
    """The users (indices into the population) an attempt of a round selects, uniformly
    without replacement and in a random arrival order, from (seed, round, attempt) alone:
    `run_fdml`'s and the training job's sampling, the one the accountant assumes."""
    rng = np.random.default_rng([seed, round_num, attempt])
    return rng.choice(population, size=selected, replace=False)


class RoundRestartedTooOften(RuntimeError):
    """Every attempt of a round had too few embedding uploads (Case A)."""


@dataclasses.dataclass(frozen=True)
class FdmlRun:
    """What `run_fdml` did: the final state, the charged rounds and each round's record.

    `history` holds, per round, the counts and the user-level epsilon so far; the server's
    `UNPRIVATE_METRICS` are left out of it.
    """

    state: Any
    applied_rounds: int
    abandoned_rounds: int
    restarts: int
    epsilon: float
    spec: fdml_privacy.FdmlPrivacySpec
    history: list[dict[str, float]]


def run_fdml(
    process: FdmlProcess,
    state: Any,
    user_data: Callable[[int, int], tf.data.Dataset],
    *,
    population: int,
    rounds: int,
    delta: float,
    seed: int,
    over_selection: float = 0.0,
    case_a_rate: float = 0.0,
    case_b_rate: float = 0.0,
    max_attempts: int = 3,
) -> FdmlRun:
    """Trains `rounds` rounds with the sampling the accountant assumes, charging every release.

    Each attempt of a round selects ceil(n (1 + over_selection)) users uniformly without
    replacement from `population` (`fdml_privacy.Sampling.UNIFORM`, all selected users
    counted), in a random arrival order, from (seed, round, attempt) alone; failures come
    from `draw_failures`. A restart (too few uploads) draws a fresh selection, up to
    `max_attempts`. Rounds abandoned under AS count as rounds (the model does not move) and
    are charged their derivative release.

    Args:
      user_data: (user index in [0, population), round) -> the user's dataset for that
        round; its first `samples_per_user` elements are the round's samples (the paper
        draws them afresh each round: `shuffle(..., seed=f(user, round),
        reshuffle_each_iteration=False)` does that). It must yield the same elements in
        the same order each time it is iterated: the replay iterates it again.

    Raises:
      RoundRestartedTooOften: no attempt of a round had enough uploads.
    """
    validation.check_int("rounds", rounds, 0)
    validation.check_int("max_attempts", max_attempts, 1)
    config = process.config
    selected = schedule.selected_per_round(config.users_per_round, over_selection)
    if selected > population:
        raise ValueError(f"a round selects {selected} users but the population is {population}")
    applied = abandoned = restarts = 0
    history = []
    spec = privacy_spec(config, population=population, selected_per_round=selected, rounds=0)
    epsilon = 0.0
    for round_num in range(rounds):
        for attempt in range(max_attempts):
            users = round_users(seed, round_num, attempt, population, selected)
            case_a, case_b = draw_failures(
                seed, round_num * max_attempts + attempt, selected, case_a_rate, case_b_rate
            )
            output = process.next(
                state,
                [user_data(int(u), round_num) for u in users],
                case_a_failures=case_a,
                case_b_failures=case_b,
            )
            if not output.restarted:
                break
            restarts += 1
        else:
            raise RoundRestartedTooOften(
                f"round {round_num + 1}: {max_attempts} attempts each had fewer than "
                f"{config.users_per_round} embedding uploads (case A failure rate {case_a_rate})"
            )
        state = output.state
        applied += output.applied
        abandoned += output.abandoned
        spec = dataclasses.replace(spec, rounds=applied, abandoned_rounds=abandoned)
        epsilon = fdml_privacy.compute_epsilon(spec, delta)
        record = {k: v for k, v in output.metrics.items() if k not in UNPRIVATE_METRICS}
        record.update(round=round_num + 1, attempts=attempt + 1, epsilon=epsilon)
        record.update(applied=int(output.applied), abandoned=int(output.abandoned))
        history.append(record)
    return FdmlRun(state, applied, abandoned, restarts, epsilon, spec, history)

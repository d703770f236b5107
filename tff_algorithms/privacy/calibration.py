"""Noise calibration to a target epsilon, and extrapolation of a schedule's epsilon.

One calibration, generic over releases, as dp_accounting's `mechanism_calibration` is
over events: `calibrate_noise` finds the smallest noise multiplier z for which a release
built with z (any function z -> epsilon, non-increasing in z) costs at most a target
epsilon. It brackets z by doubling or halving from 1 within
[`MIN_CALIBRATED_NOISE_MULTIPLIER`, `accounting_spec.MAX_NOISE_MULTIPLIER`], then bisects
log z: about 15 accountant calls for a typical target, at most ~35. What it searches over:

- `calibrate_noise_multiplier`: a job's accounting spec (`accounting.compute_privacy`,
  composed with its shared-negatives releases), what every algorithm's job and
  `dp-fedemb privacy --target-epsilon` calibrate;
- `event_epsilon`: the dp_accounting event an algorithm builds of its own release (FDML's
  two Gaussians a round, `algorithms/fdml/privacy.py`), under the RDP accountant.

Also:
- `extrapolate_privacy` moves a schedule to a larger population at several users per
  round, with the noise scaled to keep the utility (paper Fig. 2c/2d, 6b/6c), and
  `write_extrapolation_plot` draws the result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tff_algorithms.privacy import accounting, accounting_spec, dplc_releases

if TYPE_CHECKING:
    import dp_accounting

CALIBRATION_RELATIVE_TOLERANCE = 1e-3
# The bracket's lower end: below it the accountants are slow (PLD) and a target that
# holds there is better given as a noise multiplier.
MIN_CALIBRATED_NOISE_MULTIPLIER = 0.1


class TargetOutOfReach(ValueError):
    """No noise multiplier up to `accounting_spec.MAX_NOISE_MULTIPLIER` reaches the target epsilon."""


# A pure function of frozen arguments, and a pipeline calibrates the same schedule twice
# (its schedule check, then the training job): 0.5 s of accountant calls each time.
@functools.lru_cache(maxsize=64)
def calibrate_noise_multiplier(
    spec: accounting_spec.AccountingSpec,
    target_epsilon: float,
    relative_tolerance: float = CALIBRATION_RELATIVE_TOLERANCE,
    releases: dplc_releases.ReleasePlan | None = None,
) -> float:
    """Smallest noise multiplier (as configured, before the virtual-client rule) for which
    `spec` costs at most `target_epsilon` at `spec.delta`.

    `releases`: shared-negatives releases whose fixed cost the schedule composes with
    (`dplc_releases.composed_privacy`): the target is then the total. The search is
    `calibrate_noise`'s; `spec.noise_multiplier` is ignored.
    """

    def epsilon_at(z: float) -> float:
        return dplc_releases.composed_privacy(spec.with_noise_multiplier(z), releases).epsilon

    return calibrate_noise(epsilon_at, target_epsilon, relative_tolerance)


def calibrate_noise(
    epsilon_at: Callable[[float], float],
    target_epsilon: float,
    relative_tolerance: float = CALIBRATION_RELATIVE_TOLERANCE,
) -> float:
    """Smallest noise multiplier z for which `epsilon_at(z)` is at most `target_epsilon`.

    `epsilon_at(z)`: the epsilon of the release built with noise multiplier z, for any
    release whose epsilon is non-increasing in z (a spec's, `calibrate_noise_multiplier`;
    an event's, `event_epsilon`). Bisection on log z: the result z satisfies
    epsilon_at(z) <= target_epsilon, and epsilon_at(z * (1 - relative_tolerance)) >
    target_epsilon: it overshoots the exact smallest z by at most a fraction
    `relative_tolerance`.
    """
    if isinstance(target_epsilon, bool) or not (
        isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon)
    ):
        raise ValueError(f"target epsilon must be a finite number, got {target_epsilon!r}")
    if not 0 < target_epsilon <= accounting_spec.MAX_TARGET_EPSILON:
        raise ValueError(
            f"target epsilon must be in (0, {accounting_spec.MAX_TARGET_EPSILON:g}], "
            f"got {target_epsilon:g}"
        )
    if not 1e-9 <= relative_tolerance < 1:
        raise ValueError(f"relative tolerance must be in [1e-9, 1), got {relative_tolerance}")

    # epsilon is non-increasing in z. Bracket the target by doubling or halving from
    # z = 1 (the accountants are slow or unstable at the extremes, so they are only
    # visited when the target asks for them), then bisect geometrically.
    low = high = 1.0
    if epsilon_at(high) > target_epsilon:
        while epsilon_at(high) > target_epsilon:
            if high >= accounting_spec.MAX_NOISE_MULTIPLIER:
                raise TargetOutOfReach(
                    f"target epsilon {target_epsilon:g} is out of reach for noise "
                    f"multipliers up to {accounting_spec.MAX_NOISE_MULTIPLIER:g}"
                )
            low, high = high, min(2 * high, accounting_spec.MAX_NOISE_MULTIPLIER)
    else:
        while epsilon_at(low) <= target_epsilon:
            if low <= MIN_CALIBRATED_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target epsilon {target_epsilon:g} holds even at noise multiplier "
                    f"{MIN_CALIBRATED_NOISE_MULTIPLIER:g}: give the noise multiplier instead"
                )
            low, high = max(low / 2, MIN_CALIBRATED_NOISE_MULTIPLIER), low
    while high > low * (1 + relative_tolerance):
        middle = math.sqrt(low * high)
        if epsilon_at(middle) > target_epsilon:
            low = middle
        else:
            high = middle
    return high


def event_epsilon(
    make_event: Callable[[float], dp_accounting.DpEvent],
    delta: float,
    relation: accounting_spec.NeighboringRelation = accounting_spec.NeighboringRelation.REPLACE_ONE,
) -> Callable[[float], float]:
    """z -> the RDP epsilon at `delta` of the event `make_event(z)`, under `relation`
    (`accounting.event_rdp_epsilon`): what `calibrate_noise` searches for a release whose
    algorithm builds its own event."""
    return lambda z: accounting.event_rdp_epsilon(make_event(z), delta, relation)


# Extrapolation (paper Fig. 2c/2d, 6b/6c).


@dataclasses.dataclass(frozen=True)
class ExtrapolationPoint:
    users_per_round: int
    noise_multiplier: float
    epsilon: float
    zcdp_rho: float | None


def extrapolate_privacy(
    base: accounting_spec.AccountingSpec, population: int, users_per_round: Sequence[int]
) -> list[ExtrapolationPoint]:
    """Epsilon of `base`'s schedule moved to `population` users, for each users-per-round.

    The noise multiplier grows linearly with users per round (z = base z * M / base M),
    which keeps the noise on the average update, and so the utility, unchanged (the
    paper's extrapolation hypothesis); rounds, delta and everything else stay as in `base`.
    """
    if not users_per_round:
        raise ValueError("extrapolation needs at least one users-per-round value")
    points = []
    for users in users_per_round:
        # The spec checks `users` before the noise is scaled by it.
        moved = dataclasses.replace(base, population=population, users_per_round=users)
        noise = base.noise_multiplier * moved.users_per_round / base.users_per_round
        result = accounting.compute_privacy(moved.with_noise_multiplier(noise))
        points.append(
            ExtrapolationPoint(moved.users_per_round, noise, result.epsilon, result.zcdp_rho)
        )
    return points


def write_extrapolation_plot(
    curves: Mapping[str, Sequence[ExtrapolationPoint]],
    path: str,
    title: str = "",
    quantity: str = "epsilon",
) -> None:
    """Write a PNG of epsilon (or zcdp_rho) against users per round, one line per curve."""
    if quantity not in ("epsilon", "zcdp_rho"):
        raise ValueError(f"quantity must be 'epsilon' or 'zcdp_rho', got {quantity!r}")
    if not curves:
        raise ValueError("nothing to plot: no curves")
    # The object-oriented API with the Agg canvas leaves pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for label, points in curves.items():
        values = [getattr(point, quantity) for point in points]
        if any(value is None for value in values):
            raise ValueError(f"curve {label!r} has no {quantity} (dpsgd has no zCDP rho)")
        axes.plot([point.users_per_round for point in points], values, marker="o", label=label)
    axes.set_xlabel("users per round")
    axes.set_ylabel("zCDP rho" if quantity == "zcdp_rho" else "epsilon")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    if title:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, format="png")

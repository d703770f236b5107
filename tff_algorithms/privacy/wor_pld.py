"""Tight PLD accounting of fixed-size sampling without replacement under substitute-one.

The proof is in docs/privacy.md ("Tight accounting of fixed-size sampling"). In short:
each round samples m of N users without replacement (q = m / N) and releases
f(sample) + N(0, sigma^2 I), where replacing one sampled user moves f by at most Delta
(the mechanism's substitute-one L2 sensitivity; z = sigma / Delta is the spec's
`effective_noise_multiplier`). For every ordered pair of neighbouring datasets and every
eps >= 0, one round's hockey-stick divergence is at most

    delta_R(eps) = H_{e^eps}((1 - q) N(0, z^2) + q N(1, z^2) || N(0, z^2)),

the "remove" direction of the Poisson-subsampled Gaussian at multiplier z. The relation
is symmetric, so the same bound holds for the reverse order: the round is dominated, for
every eps including negative ones, by the symmetric pair whose privacy curve is delta_R
in both directions (the f-DP tradeoff min(f, f^-1)**, Dong, Roth and Su 2022, Theorem
4.2 applies to the same sampling). Composing that one pair with itself over the rounds is
valid for adaptive rounds. Composing the two Poisson directions separately (what
dp_accounting's add-or-remove PLD does) is not: one round's pair can take either
orientation (Lebeda et al. 2024 on composing single-round worst cases).

The symmetric pair's privacy-loss distribution is built with pessimistic
connect-the-dots (Doroshenko et al. 2022; `dp_accounting.pld.pld_pmf`) from delta_R on a
grid of step `discretization`: its curve is at or above the true one everywhere, so every
epsilon read off it is an upper bound.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where used: dp_accounting and scipy take ~1 s to import
    from dp_accounting.pld import pld_pmf, privacy_loss_distribution


@functools.lru_cache(maxsize=256)
def one_round_pmf(
    sampling_probability: float, noise_multiplier: float, discretization: float
) -> pld_pmf.PLDPmf:
    """The pessimistic PLD pmf of one round's symmetric dominating pair (module docstring).

    Cached: a schedule of T rounds self-composes this one pmf, and calibration, the ledger
    and reports ask for the same (q, z) many times.
    """
    from dp_accounting.pld import pld_pmf, privacy_loss_mechanism

    remove = privacy_loss_mechanism.GaussianPrivacyLoss(
        noise_multiplier,
        sensitivity=1.0,
        sampling_prob=sampling_probability,
        adjacency_type=privacy_loss_mechanism.AdjacencyType.REMOVE,
    )
    # The curve is evaluated out to where dp_accounting's own Gaussian PLD stops (its
    # connect-the-dots bounds); the mass beyond goes to an infinite loss (pessimistic).
    bounds = remove.connect_dots_bounds()
    top = math.ceil(max(bounds.epsilon_upper, -bounds.epsilon_lower) / discretization)
    grid = np.arange(0, top + 1)
    curve_at_positive = np.asarray(remove.get_delta_for_epsilon(grid * discretization), float)
    # The symmetric pair's curve below zero: delta(-e) = 1 - e^-e + e^-e delta_R(e).
    negative = -grid[1:][::-1] * discretization
    curve_at_negative = -np.expm1(negative) + np.exp(negative) * curve_at_positive[1:][::-1]
    curve = np.concatenate([curve_at_negative, curve_at_positive])
    # Rounding can leave the curve a few ulps above 1 or rising where it is flat; raising
    # each value to the largest at or after it restores the shape, and is pessimistic.
    curve = np.minimum(np.maximum.accumulate(curve[::-1])[::-1], 1.0)
    return pld_pmf.create_pmf_pessimistic_connect_dots(
        discretization, np.concatenate([-grid[1:][::-1], grid]), curve
    )


def composed(
    sampling_probability: float, noise_multiplier: float, rounds: int, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD of `rounds` rounds (fresh samples each) of the symmetric pair."""
    from dp_accounting.pld import privacy_loss_distribution

    pmf = one_round_pmf(sampling_probability, noise_multiplier, discretization)
    return privacy_loss_distribution.PrivacyLossDistribution(pmf).self_compose(rounds)

"""Independent check of the tight PLD accountant for fixed-size sampling without replacement.

docs/privacy.md ("Tight accounting of fixed-size sampling") proves that one round of
sampling m of N users without replacement, summing their clipped updates (clip 1) and
adding N(0, z^2 I), is dominated under substitute-one by the symmetric pair whose privacy
curve in both directions is that of the "remove" Poisson pair at sensitivity 2:

    P* = (1 - q) N(0, z^2) + q N(2, z^2),   Q* = N(0, z^2),   q = m / N.

Nothing here imports dp_accounting or the accountant's internals (only the epsilon under
test comes from the project):

(a) over random realisable one-round pairs (a few users, every m-subset enumerated, the
    other users' updates anywhere in the unit ball in 1 to 3 dimensions, the changed
    user's two updates anywhere in it), the exact hockey-stick divergence, integrated on
    a grid over the whole mixture, never exceeds the claimed pair's; the pair is attained
    (so the integrator is accurate enough to see a violation) and a pair at half the
    sensitivity is exceeded (so the check has power);
(b) the product's multi-round epsilon lies between a rigorous lower bound and a rigorous
    upper bound on the exact epsilon of the composed symmetric pair, both computed here
    by discretising its loss distribution (rounded down / up) and composing by FFT.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import fft, special

from tff_algorithms.privacy import accounting, accounting_spec

# ---------------------------------------------------------------------------------------
# The claimed one-round pair, in closed form (1-D: both are Gaussians on one line).


def _loss_threshold(eps: float, q: float, sigma: float, sensitivity: float) -> float:
    """x with log p*(x)/q*(x) = eps for P* = (1-q)N(0)+qN(s), Q* = N(0); -inf when every
    x has a larger loss (e^eps <= 1 - q). The loss is increasing in x."""
    excess = math.exp(eps) - (1 - q)
    if excess <= 0:
        return -math.inf
    return sigma**2 / sensitivity * math.log(excess / q) + sensitivity / 2


def remove_pair_delta(eps: float, q: float, sigma: float, sensitivity: float = 2.0) -> float:
    """H_{e^eps}(P* || Q*) for eps >= 0: P*(L > eps) - e^eps Q*(L > eps)."""
    x = _loss_threshold(eps, q, sigma, sensitivity)
    p_above = (1 - q) * special.ndtr(-x / sigma) + q * special.ndtr((sensitivity - x) / sigma)
    return float(p_above - math.exp(eps) * special.ndtr(-x / sigma))


# ---------------------------------------------------------------------------------------
# (a) Realisable pairs: the whole mixture over m-subsets, integrated on a grid.


def _mixture_density(points: np.ndarray, means: np.ndarray, sigma: float) -> np.ndarray:
    """Equal-weight mixture of N(mean, sigma^2 I) at `points` (shape (n, d))."""
    squared = ((points[:, None, :] - means[None, :, :]) ** 2).sum(axis=2)
    dim = points.shape[1]
    norm = (2 * math.pi * sigma**2) ** (dim / 2)
    return np.exp(-squared / (2 * sigma**2)).mean(axis=1) / norm


def exact_round_deltas(
    others: np.ndarray,
    update: np.ndarray,
    replacement: np.ndarray,
    m: int,
    sigma: float,
    epsilons: list[float],
    step: float,
) -> tuple[list[float], list[float]]:
    """delta(eps) of one round in both orders, by a grid sum over R^d.

    User 0 holds `update` in one dataset and `replacement` in the other; users 1..N-1 hold
    the rows of `others`. Every m-subset is equally likely; the output is the sum of the
    subset's updates plus N(0, sigma^2 I).
    """
    users = len(others) + 1
    subsets = list(itertools.combinations(range(users), m))

    def means(first: np.ndarray) -> np.ndarray:
        table = np.vstack([first, others])
        return np.array([table[list(subset)].sum(axis=0) for subset in subsets])

    means_p, means_q = means(update), means(replacement)
    dim = others.shape[1]
    low = np.minimum(means_p.min(axis=0), means_q.min(axis=0)) - 8 * sigma
    high = np.maximum(means_p.max(axis=0), means_q.max(axis=0)) + 8 * sigma
    axes = [np.arange(low[i], high[i] + step, step) for i in range(dim)]
    points = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, dim)
    p = _mixture_density(points, means_p, sigma)
    q = _mixture_density(points, means_q, sigma)
    cell = step**dim
    forward = [float(np.maximum(p - math.exp(e) * q, 0).sum() * cell) for e in epsilons]
    backward = [float(np.maximum(q - math.exp(e) * p, 0).sum() * cell) for e in epsilons]
    return forward, backward


def _in_ball(rng: np.random.Generator, count: int, dim: int) -> np.ndarray:
    """Points anywhere in the unit ball, a third of them on its surface (the extremes)."""
    directions = rng.normal(size=(count, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radii = np.where(rng.random(count) < 1 / 3, 1.0, rng.random(count) ** (1 / dim))
    return directions * radii[:, None]


EPSILONS = [0.0, 0.25, 0.5, 1.0, 2.0]
# (dimension, users, grid step / sigma, relative tolerance of the grid sum, pairs):
# the grid sum's error is checked against the closed form on the attained pair below.
SETTINGS = [(1, (6, 12), 0.005, 1e-3, 40), (2, (5, 7), 0.08, 3e-3, 6), (3, (4, 5), 0.2, 2e-2, 2)]


def _attaining_pair(users: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every other user at +e, the changed user +e vs -e: P* and Q* themselves (shifted)."""
    axis = np.eye(dim)[0]
    return np.tile(axis, (users - 1, 1)), axis, -axis


@pytest.mark.parametrize(("dim", "users_range", "step", "tolerance", "pairs"), SETTINGS)
def test_realisable_pairs_never_exceed_the_claimed_pair(
    dim: int, users_range: tuple[int, int], step: float, tolerance: float, pairs: int
) -> None:
    rng = np.random.default_rng(dim)
    worst_ratio = 0.0
    for trial in range(pairs):
        users = int(rng.integers(users_range[0], users_range[1] + 1))
        m = int(rng.integers(1, users))
        sigma = float(rng.choice([0.7, 1.0, 1.773, 3.0]))
        q = m / users
        if trial == 0:  # the claimed pair is realisable: the integrator must find it
            others, update, replacement = _attaining_pair(users, dim)
        else:
            others = _in_ball(rng, users - 1, dim)
            update, replacement = _in_ball(rng, 2, dim)
        forward, backward = exact_round_deltas(
            others, update, replacement, m, sigma, EPSILONS, step * sigma
        )
        for eps, f, b in zip(EPSILONS, forward, backward):
            bound = remove_pair_delta(eps, q, sigma)
            assert max(f, b) <= bound * (1 + tolerance) + 1e-9, (dim, users, m, sigma, eps)
            if trial == 0:
                # Attained: the ordered pair (P_r, Q_r) = (N(0), (1-q)N(0)+qN(-2)) has the
                # remove curve in its backward order.
                assert b == pytest.approx(bound, rel=tolerance, abs=1e-9)
            worst_ratio = max(worst_ratio, max(f, b) / bound)
    assert worst_ratio > 0.9


def test_half_the_sensitivity_is_exceeded() -> None:
    """The check has power: the Poisson pair at sensitivity 1 (the paper's arithmetic)
    is exceeded by a realisable pair."""
    others, update, replacement = _attaining_pair(8, 1)
    sigma, q = 1.0, 3 / 8
    _, backward = exact_round_deltas(others, update, replacement, 3, sigma, [0.5], 0.005)
    assert backward[0] > 1.5 * remove_pair_delta(0.5, q, sigma, sensitivity=1.0)


# ---------------------------------------------------------------------------------------
# (b) The composed symmetric pair, discretised here and composed by FFT.


def _tail_weight(eps: np.ndarray, q: float, sigma: float, sensitivity: float) -> np.ndarray:
    """W(eps) = integral over {L > eps} of e^-L d(omega), omega the symmetric pair's loss
    distribution. From its curve delta(eps) (delta_R for eps >= 0, and
    1 - e^eps + e^eps delta_R(-eps) below): W = -e^-eps delta'(eps), which is
    Q*(L > eps) for eps >= 0 and P*(L <= -eps) for eps < 0 (an atom at L = 0 between)."""
    out = np.empty_like(eps)
    for i, e in enumerate(eps):
        x = _loss_threshold(abs(e), q, sigma, sensitivity)
        if e >= 0:
            out[i] = special.ndtr(-x / sigma)
        else:
            out[i] = (1 - q) * special.ndtr(x / sigma) + q * special.ndtr((x - sensitivity) / sigma)
    return out


def _symmetric_delta(eps: float, q: float, sigma: float) -> float:
    if eps >= 0:
        return remove_pair_delta(eps, q, sigma)
    return -math.expm1(eps) + math.exp(eps) * remove_pair_delta(-eps, q, sigma)


def composed_epsilon_bounds(
    q: float, sigma: float, rounds: int, delta: float, step: float, reach: float
) -> tuple[float, float]:
    """(lower, upper) bounds on the exact epsilon of `rounds` rounds of the symmetric pair.

    The loss mass in a cell (e_k, e_k+1] is between (W(e_k) - W(e_k+1)) e^e_k and the same
    times e^e_k+1. Lower: the smaller mass at e_k (the rest dropped to -inf). Upper: the
    larger mass at e_k+1, the mass above the grid at +inf, the mass below it at its bottom.
    Moving loss down or dropping mass lowers every delta(eps) of the composition; moving
    it up or adding mass raises it.
    """
    count = int(round(reach / step))
    grid = np.arange(-count, count + 1) * step
    weights = _tail_weight(grid, q, sigma, 2.0)
    cell = weights[:-1] - weights[1:]
    assert np.all(cell >= -1e-15)
    lower = cell * np.exp(grid[:-1])
    top_mass = _symmetric_delta(grid[-1], q, sigma) + math.exp(grid[-1]) * weights[-1]
    bottom_mass = 1 - _symmetric_delta(grid[0], q, sigma) - math.exp(grid[0]) * weights[0]
    upper = np.concatenate([[bottom_mass], cell * np.exp(grid[1:])])
    bounds = []
    for pmf, infinite in ((np.append(lower, 0.0), 0.0), (upper, top_mass)):
        length = rounds * (len(pmf) - 1) + 1
        size = fft.next_fast_len(length, real=True)
        composed = np.maximum(fft.irfft(fft.rfft(pmf, size) ** rounds, size)[:length], 0)
        losses = rounds * grid[0] + np.arange(length) * step
        positive = losses > 0  # epsilon is searched in [0, 64]
        losses, composed = losses[positive], composed[positive]
        # delta(eps) = inf mass + sum over L > eps of c (1 - e^(eps - L)): suffix sums.
        mass_above = np.cumsum(composed[::-1])[::-1]
        weight_above = np.cumsum((composed * np.exp(-losses))[::-1])[::-1]
        infinite_mass = 1 - (1 - infinite) ** rounds

        def delta_at(
            eps: float, losses=losses, mass=mass_above, weight=weight_above, inf=infinite_mass
        ) -> float:
            first = int(np.searchsorted(losses, eps, side="right"))
            if first == len(losses):
                return inf
            return inf + mass[first] - math.exp(eps) * weight[first]

        low, high = 0.0, 64.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if delta_at(middle) > delta else (low, middle)
        bounds.append(high)
    return bounds[0], bounds[1]


# (population, users per round, rounds, z, delta): the default schedule, a long one at small
# q, and one with half the users each round.
SCHEDULES = [
    (2994, 384, 20, 1.773, 1e-4),
    (10_000, 100, 50, 1.0, 1e-5),
    (1000, 500, 10, 4.0, 1e-3),
]


@pytest.mark.parametrize(("population", "users", "rounds", "z", "delta"), SCHEDULES)
def test_product_epsilon_matches_independent_composition(
    population: int, users: int, rounds: int, z: float, delta: float
) -> None:
    spec = accounting_spec.AccountingSpec(population, users, rounds, z, delta, accountant="pld")
    product = accounting.compute_privacy(spec).epsilon
    lower, upper = composed_epsilon_bounds(users / population, z, rounds, delta, 1e-3, 12.0)
    assert lower <= product <= upper + 1e-9
    # Each round's loss moves by at most one step either way: the bracket is that narrow,
    # narrow enough to refuse the per-direction Poisson value (4.60 at the default schedule).
    assert upper - lower <= 2 * rounds * 1e-3 + 1e-6


def test_the_tight_pld_is_the_default_for_uniform_sampling_under_strict_only():
    def spec(**options):
        return accounting_spec.AccountingSpec(2994, 384, 20, 1.773, 1e-4, **options)

    assert spec().accountant is accounting_spec.Accountant.PLD
    for options in (
        dict(convention="paper"),  # published numbers are RDP's
        dict(sampling="poisson"),
        dict(mechanism="dpftrl", users_per_virtual_client=8),
    ):
        assert spec(**options).accountant is accounting_spec.Accountant.RDP, options
    assert spec(mechanism="logit_dp").accountant is accounting_spec.Accountant.PLD
    assert spec(mechanism="fdml").accountant is accounting_spec.Accountant.PLD
    result = accounting.compute_privacy(spec(), rdp_cross_check=True)
    assert result.epsilon == pytest.approx(4.844, abs=1e-3)
    assert result.epsilon_rdp == pytest.approx(7.996, abs=1e-3)
    assert accounting.compute_privacy(spec(accountant="rdp")).epsilon == result.epsilon_rdp

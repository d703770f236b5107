"""The one-run audit bound (Steinke, Nasr & Jagielski 2023), checked numerically."""

import math

import numpy as np
import pytest
from scipy import stats

from beam_jobs import canaries
from tff_algorithms.jobs import audit

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow


def test_without_delta_the_p_value_is_the_randomized_response_binomial_tail():
    for epsilon in (0.0, 0.5, 2.0):
        q = math.exp(epsilon) / (1 + math.exp(epsilon))
        assert audit.p_value(100, 40, 30, epsilon, 0.0) == pytest.approx(
            stats.binom.sf(29, 40, q), rel=1e-12
        )


def test_the_p_value_grows_with_epsilon_and_delta():
    values = [audit.p_value(100, 40, 34, e, 1e-5) for e in np.linspace(0, 4, 9)]
    assert values == sorted(values)
    assert audit.p_value(100, 40, 34, 1.0, 1e-3) > audit.p_value(100, 40, 34, 1.0, 1e-6)


def test_lower_bound_is_valid_and_tight_on_randomized_response():
    """Monte Carlo: ε0-randomized response on each canary's bit, one guess per canary.

    At 95% confidence the bound may exceed ε0 in at most 5% of runs (validity), and
    with many canaries it comes close to ε0 (the bound is tight for this mechanism).
    """
    rng = np.random.default_rng(0)
    epsilon0, canaries, trials = 1.0, 1000, 400
    q0 = math.exp(epsilon0) / (1 + math.exp(epsilon0))
    bounds = []
    for _ in range(trials):
        membership = rng.random(canaries) < 0.5
        released = np.where(rng.random(canaries) < q0, membership, ~membership)
        correct = int(np.sum(released == membership))
        bounds.append(audit.epsilon_lower_bound(canaries, canaries, correct, 0.0, 0.95))
    bounds = np.array(bounds)
    assert np.mean(bounds > epsilon0) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert 0.75 * epsilon0 < np.median(bounds) < epsilon0


def test_all_guesses_right_gives_the_closed_form_bound():
    # δ = 0 and v = r: q^r = 1 - confidence, so ε = log(q / (1 - q)).
    q = 0.05 ** (1 / 16)
    assert audit.epsilon_lower_bound(32, 16, 16, 0.0, 0.95) == pytest.approx(
        math.log(q / (1 - q)), abs=1e-5
    )
    # δ > 0 can only weaken the bound; chance-level guessing proves nothing.
    assert audit.epsilon_lower_bound(32, 16, 16, 1e-5) <= math.log(q / (1 - q)) + 1e-6
    assert audit.epsilon_lower_bound(32, 16, 8, 1e-5) == 0.0


def test_guesses_take_the_top_and_bottom_scores():
    scores = np.array([0.9, 0.1, 0.5, 0.8, 0.2, 0.4])
    included = np.array([True, False, True, False, True, False])
    # Top 2: canaries 0 (in, right) and 3 (out, wrong); bottom 2: 1 (out, right), 4 (in, wrong).
    assert audit.guess_membership(scores, included, 2, 2) == audit.Guesses(4, 2)
    with pytest.raises(ValueError, match="cannot make"):
        audit.guess_membership(scores, included, 4, 3)


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 11, 5, 1.0, 0.0), "guesses <= canaries"),
        ((10, 5, 6, 1.0, 0.0), "correct <= guesses"),
        ((10, 5, 3, -1.0, 0.0), "epsilon >= 0"),
    ],
)
def test_nonsense_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        audit.p_value(*args)


# The canary audit of real DP-FedEmb training runs (tiny population, a few rounds).
POPULATION = canaries.CanaryPopulation(canaries=32, images_per_identity=8, membership_seed=1)
GUESSES_PER_SIDE = 8
# 16 right guesses out of 16 give the largest bound this audit can report.
LARGEST_BOUND = math.log(0.05 ** (1 / 16) / (1 - 0.05 ** (1 / 16)))


def test_without_noise_the_audit_detects_membership(tff_runtime, tmp_path):
    config = audit.audit_train_config(POPULATION, noise_multiplier=0.0, noise_seed=0)
    result = audit.run_canary_audit(POPULATION, config, str(tmp_path), GUESSES_PER_SIDE)
    assert math.isinf(result.theoretical_epsilon)
    assert result.guesses == 16
    # At least 14 of 16 right: the bound exceeds 0.6 (13 right would give 0.34).
    assert result.correct >= 14
    assert result.epsilon_lower_bound > 0.6


def test_with_noise_the_lower_bound_stays_below_the_ledger_epsilon(tff_runtime, tmp_path):
    # z = 16: the strict ledger (substitute-one moves the clipped sum by 2 x clip) gives
    # epsilon 1.26, below the largest bound 16 guesses can show.
    config = audit.audit_train_config(POPULATION, noise_multiplier=16.0, noise_seed=0)
    result = audit.run_canary_audit(POPULATION, config, str(tmp_path), GUESSES_PER_SIDE)
    # The ledger's ε is small enough that a broken mechanism could exceed it.
    assert 0 < result.theoretical_epsilon < LARGEST_BOUND
    assert result.epsilon_lower_bound <= result.theoretical_epsilon
    assert result.accounting_convention == "strict"

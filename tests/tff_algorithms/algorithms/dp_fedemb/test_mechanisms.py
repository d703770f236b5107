"""The aggregator built from an accounting spec is the mechanism that spec accounts for."""

import numpy as np
import pytest

from tests import support
from tff_algorithms.algorithms.dp_fedemb import mechanisms
from tff_algorithms.privacy import accounting_spec

_NUM_COORDINATES = 20_000


def _std_ratio_bounds(n: int) -> tuple[float, float]:
    """99.99% bounds of sample_std / true_std for n i.i.d. normals (chi-square, normal approx)."""
    half_width = 3.9 * np.sqrt(1.0 / (2.0 * n))
    return 1.0 - half_width, 1.0 + half_width


def _spec(mechanism, noise_multiplier, restart_every_epoch=False):
    # 8 users, 2 per round: 4 rounds per epoch.
    return accounting_spec.AccountingSpec(
        population=8,
        users_per_round=2,
        rounds=8,
        noise_multiplier=noise_multiplier,
        delta=1e-3,
        mechanism=mechanism,
        restart_every_epoch=restart_every_epoch,
    )


def test_dpsgd_spec_gives_independent_gaussian_noise_with_the_spec_noise_multiplier(tff_runtime):
    z, clip, planned = 1.5, 2.0, 4
    factory = mechanisms.aggregator_for_spec(
        _spec(accounting_spec.Mechanism.DPSGD, z),
        clip_norm=clip,
        virtual_clients_per_round=planned,
        noise_seed=3,
        rounds_per_epoch=4,
    )
    low, high = _std_ratio_bounds(_NUM_COORDINATES)
    sigma = z * clip / planned
    for t, prefix_sum in enumerate(
        support.zero_update_noise_prefix_sums(factory, _NUM_COORDINATES, 4), start=1
    ):
        # Independent draws: t rounds of noise add up to sqrt(t) of one round's.
        assert low < prefix_sum.std() / (sigma * np.sqrt(t)) < high, t


@pytest.mark.parametrize("restart_every_epoch", [False, True])
def test_dpftrl_spec_gives_tree_noise_restarting_as_the_spec_says(tff_runtime, restart_every_epoch):
    z, clip, planned = 0.5, 1.0, 2
    factory = mechanisms.aggregator_for_spec(
        _spec(accounting_spec.Mechanism.DPFTRL, z, restart_every_epoch),
        clip_norm=clip,
        virtual_clients_per_round=planned,
        noise_seed=5,
        rounds_per_epoch=4,
        use_efficient_tree=False,
    )
    low, high = _std_ratio_bounds(_NUM_COORDINATES)
    sigma = z * clip / planned
    prefix_sums = support.zero_update_noise_prefix_sums(factory, _NUM_COORDINATES, 8)
    # After 4 rounds one tree's root holds the prefix sum: one node of noise, where
    # independent noise would give 2 sigma.
    assert low < prefix_sums[3].std() / sigma < high
    # After 8 rounds: one tree's root, or with restarts two trees' roots.
    nodes = 2 if restart_every_epoch else 1
    assert low < prefix_sums[7].std() / (sigma * np.sqrt(nodes)) < high


@pytest.mark.parametrize("restart_every_epoch", [False, True])
def test_tree_whose_epoch_differs_from_the_spec_is_refused(restart_every_epoch):
    spec = _spec(accounting_spec.Mechanism.DPFTRL, 1.0, restart_every_epoch)
    with pytest.raises(ValueError, match="rounds per epoch"):
        mechanisms.aggregator_for_spec(
            spec, clip_norm=1.0, virtual_clients_per_round=1, noise_seed=0, rounds_per_epoch=3
        )

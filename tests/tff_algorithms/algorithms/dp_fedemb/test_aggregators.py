"""Numerical privacy tests of the aggregation factories, run as real TFF processes."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.aggregators import differential_privacy

from tests import support
from tff_algorithms.algorithms.dp_fedemb import aggregators

# Noise tests draw this many i.i.d. coordinates per release.
_NUM_COORDINATES = 20_000


def _process(factory, shapes):
    specs = [tf.TensorSpec(s, tf.float32) for s in shapes]
    return factory.create(tff.types.tensorflow_to_type(specs))


def _std_ratio_bounds(n: int) -> tuple[float, float]:
    """99.99% bounds of sample_std / true_std for n i.i.d. normals (chi-square, normal approx)."""
    half_width = 3.9 * np.sqrt(1.0 / (2.0 * n))
    return 1.0 - half_width, 1.0 + half_width


def test_each_virtual_client_is_clipped_to_the_bound(tff_runtime):
    clip = 0.5
    process = _process(
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=clip, virtual_clients_per_round=1, noise_seed=1
        ),
        [(3,)],
    )
    for update in ([30.0, -40.0, 0.0], [0.1, 0.2, -0.2]):
        output = process.next(process.initialize(), [[np.array(update, np.float32)]])
        norm = np.linalg.norm(update)
        expected = np.array(update) * min(1.0, clip / norm)
        np.testing.assert_allclose(output.result[0], expected, rtol=1e-6)
        assert np.linalg.norm(output.result[0]) <= clip * (1 + 1e-6)


def test_clip_is_per_client_and_global_over_the_structure(tff_runtime):
    clip = 1.0
    process = _process(
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=clip, virtual_clients_per_round=2, noise_seed=1
        ),
        [(2,), (1,)],
    )
    big = [np.array([3.0, 0.0], np.float32), np.array([4.0], np.float32)]  # global norm 5
    small = [np.array([0.0, 0.3], np.float32), np.array([0.4], np.float32)]  # global norm 0.5
    output = process.next(process.initialize(), [big, small])
    np.testing.assert_allclose(
        output.result[0], (np.array([0.6, 0.0]) + np.array([0.0, 0.3])) / 2, rtol=1e-6
    )
    np.testing.assert_allclose(output.result[1], (np.array([0.8]) + np.array([0.4])) / 2, rtol=1e-6)


def test_denominator_is_the_planned_number_of_clients(tff_runtime):
    planned = 4
    for factory in (
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=100.0, virtual_clients_per_round=planned, noise_seed=1
        ),
        aggregators.no_dp(virtual_clients_per_round=planned),
    ):
        process = _process(factory, [(2,)])
        updates = [[np.array([1.0, 2.0], np.float32)], [np.array([3.0, -2.0], np.float32)]]
        output = process.next(process.initialize(), updates)
        np.testing.assert_allclose(output.result[0], np.array([4.0, 0.0]) / planned, rtol=1e-6)


def test_gaussian_noise_std_is_z_gamma_over_m(tff_runtime):
    z, clip, planned = 1.5, 0.4, 8
    process = _process(
        aggregators.gaussian_fixed(
            noise_multiplier=z, clip_norm=clip, virtual_clients_per_round=planned, noise_seed=7
        ),
        [(_NUM_COORDINATES,)],
    )
    state = process.initialize()
    zero = [np.zeros(_NUM_COORDINATES, np.float32)]
    draws = []
    for _ in range(3):
        output = process.next(state, [zero])
        state = output.state
        draws.append(output.result[0])
    low, high = _std_ratio_bounds(_NUM_COORDINATES)
    for noise in draws:
        assert abs(noise.mean()) < 4 * z * clip / planned / np.sqrt(_NUM_COORDINATES)
        assert low < noise.std() / (z * clip / planned) < high
    # Rounds draw fresh noise: independent draws have correlation ~ N(0, 1/n).
    assert abs(np.corrcoef(draws[0], draws[1])[0, 1]) < 4 / np.sqrt(_NUM_COORDINATES)
    # The DP event the ledger reads is the Gaussian mechanism with multiplier z.
    event = differential_privacy.extract_dp_event_from_state(state)
    assert isinstance(event, dp_accounting.GaussianDpEvent)
    assert event.noise_multiplier == pytest.approx(z)


def test_noise_is_reproducible_from_the_seed_and_differs_across_seeds(tff_runtime):
    def first_noise(seed):
        process = _process(
            aggregators.gaussian_fixed(
                noise_multiplier=1.0, clip_norm=1.0, virtual_clients_per_round=1, noise_seed=seed
            ),
            [(50,)],
        )
        return process.next(process.initialize(), [[np.zeros(50, np.float32)]]).result[0]

    np.testing.assert_array_equal(first_noise(3), first_noise(3))
    assert not np.allclose(first_noise(3), first_noise(4))


def test_tree_prefix_sum_noise_follows_the_nodes_summed(tff_runtime):
    z, clip, planned, rounds = 1.0, 2.0, 4, 7
    factory = aggregators.tree_aggregation(
        noise_multiplier=z,
        clip_norm=clip,
        virtual_clients_per_round=planned,
        record_specs=[tf.TensorSpec([_NUM_COORDINATES], tf.float32)],
        noise_seed=11,
        use_efficient=False,
    )
    low, high = _std_ratio_bounds(_NUM_COORDINATES)
    for t, prefix_sum in enumerate(
        support.zero_update_noise_prefix_sums(factory, _NUM_COORDINATES, rounds), start=1
    ):
        # The prefix sum of the first t leaves is the sum of popcount(t) tree nodes.
        nodes = bin(t).count("1")
        expected_std = z * clip / planned * np.sqrt(nodes)
        assert low < prefix_sum.std() / expected_std < high, (t, nodes)


def test_tree_restart_starts_a_new_tree_each_epoch(tff_runtime):
    z, clip, planned, period = 1.0, 1.0, 1, 3
    factory = aggregators.tree_aggregation(
        noise_multiplier=z,
        clip_norm=clip,
        virtual_clients_per_round=planned,
        record_specs=[tf.TensorSpec([_NUM_COORDINATES], tf.float32)],
        noise_seed=5,
        restart_every_rounds=period,
        use_efficient=False,
    )
    low, high = _std_ratio_bounds(_NUM_COORDINATES)
    prefix_sums = support.zero_update_noise_prefix_sums(factory, _NUM_COORDINATES, 6)
    for t, prefix_sum in enumerate(prefix_sums, start=1):
        # Completed epochs each contribute a full tree of `period` leaves, then the current tree.
        epochs_done, in_epoch = divmod(t - 1, period)
        nodes = epochs_done * bin(period).count("1") + bin(in_epoch + 1).count("1")
        assert low < prefix_sum.std() / (z * clip * np.sqrt(nodes)) < high, (t, nodes)


@pytest.mark.parametrize("restart_every_rounds", [None, 2])
def test_tree_aggregation_clips_each_virtual_client(tff_runtime, restart_every_rounds):
    clip, planned = 0.5, 2
    process = _process(
        aggregators.tree_aggregation(
            noise_multiplier=0.0,
            clip_norm=clip,
            virtual_clients_per_round=planned,
            record_specs=[tf.TensorSpec([3], tf.float32)],
            noise_seed=3,
            restart_every_rounds=restart_every_rounds,
        ),
        [(3,)],
    )
    big, small = np.array([30.0, -40.0, 0.0], np.float32), np.array([0.1, 0.2, -0.2], np.float32)
    output = process.next(process.initialize(), [[big], [small]])
    expected = (big * clip / np.linalg.norm(big) + small) / planned
    np.testing.assert_allclose(output.result[0], expected, rtol=1e-6)


def test_efficient_tree_noise_is_at_most_the_plain_tree_noise(tff_runtime):
    z, clip, rounds = 1.0, 1.0, 7
    factory = aggregators.tree_aggregation(
        noise_multiplier=z,
        clip_norm=clip,
        virtual_clients_per_round=1,
        record_specs=[tf.TensorSpec([_NUM_COORDINATES], tf.float32)],
        noise_seed=9,
        use_efficient=True,
    )
    _, high = _std_ratio_bounds(_NUM_COORDINATES)
    for t, prefix_sum in enumerate(
        support.zero_update_noise_prefix_sums(factory, _NUM_COORDINATES, rounds), start=1
    ):
        assert 0 < prefix_sum.std() < high * z * clip * np.sqrt(bin(t).count("1"))


def test_adaptive_clipping_factory_builds_and_clips(tff_runtime):
    process = _process(
        aggregators.gaussian_adaptive(
            noise_multiplier=0.0, virtual_clients_per_round=1, initial_clip=1.0
        ),
        [(2,)],
    )
    output = process.next(process.initialize(), [[np.array([30.0, 40.0], np.float32)]])
    np.testing.assert_allclose(np.linalg.norm(output.result[0]), 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(noise_multiplier=-1.0, clip_norm=1.0, virtual_clients_per_round=1, noise_seed=0),
        dict(noise_multiplier=1.0, clip_norm=0.0, virtual_clients_per_round=1, noise_seed=0),
        dict(noise_multiplier=1.0, clip_norm=1.0, virtual_clients_per_round=0, noise_seed=0),
    ],
)
def test_nonsense_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        aggregators.gaussian_fixed(**kwargs)


def test_integer_parameters_reach_tf_privacy_as_floats():
    factory = aggregators.gaussian_fixed(
        noise_multiplier=1, clip_norm=2, virtual_clients_per_round=3, noise_seed=0
    )
    numerator = factory._query._numerator
    assert isinstance(numerator._l2_norm_clip, float) and isinstance(numerator._stddev, float)

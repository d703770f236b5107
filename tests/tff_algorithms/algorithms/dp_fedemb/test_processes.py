"""Learning processes end to end on tiny models: privacy structure and server behaviour."""

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, mechanisms, processes
from tff_algorithms.config import client_config, model_config
from tff_algorithms.modeling import identity_heads, models
from tff_algorithms.privacy import accounting_spec

BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
CONFIG = client_config.ClientConfig(client_learning_rate=0.05, head_capacity=5, batch_size=4)


def _client_dataset(seed, identities, client_id=None):
    images = np.random.default_rng(seed).random((len(identities), 28, 28, 1), dtype=np.float32)
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": images, "identity": np.array(identities)}
    )
    return client_work.make_client_dataset(examples, client_id or f"vc{seed}", CONFIG)


def _nan_dataset():
    images = np.full((4, 28, 28, 1), np.nan, np.float32)
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": images, "identity": np.array(["p", "q", "p", "q"])}
    )
    return client_work.make_client_dataset(examples, "nan", CONFIG)


def _backbone(process, state):
    return processes.backbone_model_weights(process.get_model_weights(state))


def _delta(process, before, after):
    return [
        a - b
        for a, b in zip(_backbone(process, after).trainable, _backbone(process, before).trainable)
    ]


@pytest.fixture(scope="module")
def fedemb_process(tff_runtime):
    # No noise, server SGD with lr 1 and no momentum: the global step is exactly the
    # negated mean of the clipped client updates.
    return processes.build_fedemb_process(
        BACKBONE,
        CONFIG,
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=0.01, virtual_clients_per_round=2, noise_seed=1
        ),
        processes.server_sgdm(1.0, 0.0),
    )


def test_no_head_in_state_broadcast_or_aggregate(fedemb_process):
    head_shape = f"float32[{BACKBONE.embedding_size},{CONFIG.head_capacity}]"
    signature = fedemb_process.next.type_signature
    for tff_type in (
        fedemb_process.initialize.type_signature.result,
        signature.parameter,
        signature.result,
    ):
        assert head_shape not in str(tff_type)
    weights_type = fedemb_process.get_model_weights.type_signature.result
    assert weights_type.is_equivalent_to(models.backbone_weights_type(BACKBONE))


def test_each_virtual_client_moves_the_backbone_at_most_clip(fedemb_process):
    state = fedemb_process.initialize()
    output = fedemb_process.next(
        state, [_client_dataset(0, ["a", "b", "a", "c"]), _client_dataset(1, ["d"] * 4)]
    )
    step = _delta(fedemb_process, state, output.state)
    norm = np.sqrt(sum(np.sum(d.astype(np.float64) ** 2) for d in step))
    # Two clipped updates of norm <= 0.01 each, divided by 2: the step is at most 0.01.
    assert 0.0 < norm <= 0.01 * (1 + 1e-5)


def test_non_finite_client_contributes_zero_and_still_counts(fedemb_process):
    state = fedemb_process.initialize()
    good = _client_dataset(2, ["a", "b", "a", "b"])
    with_nan = fedemb_process.next(state, [good, _nan_dataset()])
    assert with_nan.metrics["client_work"]["non_finite_updates"] == 1
    alone = fedemb_process.next(state, [_client_dataset(2, ["a", "b", "a", "b"])])
    # Same divisor (the planned 2 clients) whether the NaN client is there or absent.
    for a, b in zip(
        _delta(fedemb_process, state, with_nan.state), _delta(fedemb_process, state, alone.state)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
    both = fedemb_process.next(
        state, [good, _client_dataset(2, ["a", "b", "a", "b"], client_id="vc2")]
    )
    for a, b in zip(
        _delta(fedemb_process, state, both.state), _delta(fedemb_process, state, alone.state)
    ):
        # Deltas are differences of float32 weights up to ~1: compare at their resolution.
        np.testing.assert_allclose(a, 2 * b, rtol=1e-4, atol=3e-7)


def test_noise_reaches_the_global_backbone_with_std_z_gamma_over_m(tff_runtime):
    z, clip, planned = 2.0, 0.5, 4
    process = processes.build_fedemb_process(
        BACKBONE,
        CONFIG,
        aggregators.gaussian_fixed(
            noise_multiplier=z, clip_norm=clip, virtual_clients_per_round=planned, noise_seed=3
        ),
        processes.server_sgdm(1.0, 0.0),
    )
    state = process.initialize()
    output = process.next(state, [_client_dataset(3, ["a", "b", "a", "b"])])
    step = np.concatenate([d.ravel() for d in _delta(process, state, output.state)])
    # The client's clipped signal has norm <= 0.5/4 spread over ~30k coordinates: negligible.
    assert step.std() / (z * clip / planned) == pytest.approx(1.0, abs=0.03)


def test_dataset_loaded_inside_tff_from_virtual_client_ids(tff_runtime):
    """With a loader only the id crosses into the client computation, which builds the
    client dataset itself; it trains what the process given those datasets trains."""

    def load_examples(virtual_client_id):
        seed = tf.stack([tf.strings.to_hash_bucket_fast(virtual_client_id, 1 << 30), 0])
        images = tf.random.stateless_uniform([6, 28, 28, 1], seed=seed)
        identities = tf.strings.join(
            [virtual_client_id, tf.strings.as_string(tf.range(6) % 3)], "/"
        )
        return tf.data.Dataset.from_tensor_slices({"image": images, "identity": identities})

    def build(loader):
        return processes.build_fedemb_process(
            BACKBONE,
            CONFIG,
            aggregators.no_dp(virtual_clients_per_round=2),
            processes.server_sgdm(1.0, 0.0),
            client_loader=loader,
        )

    process = build(client_work.ClientLoader(load_examples))
    assert str(process.next.type_signature.parameter[1]) == "{str}@CLIENTS"
    ids = ["r0/vc0", "r0/vc1"]
    output = process.next(process.initialize(), ids)
    assert output.metrics["client_work"]["num_examples"] == 12
    assert output.metrics["client_work"]["examples_over_head_capacity"] == 0

    given_datasets = build(None)
    expected = given_datasets.next(
        given_datasets.initialize(),
        [client_work.make_client_dataset(load_examples(tf.constant(i)), i, CONFIG) for i in ids],
    )
    for got, want in zip(
        _backbone(process, output.state).trainable,
        _backbone(given_datasets, expected.state).trainable,
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert (
        np.abs(
            np.concatenate([d.ravel() for d in _delta(process, process.initialize(), output.state)])
        ).max()
        > 0
    )


def test_dp_ftrl_process_runs_with_tree_noise_and_restarts(tff_runtime):
    """The tree's noise and its restart, seen in the process's own weights: with server
    SGD at lr 1 and no momentum the backbone after t rounds is the start minus the sum of
    the t releases, whose noise is the tree's prefix sum: popcount(t) nodes of std z γ / M
    each. 12 users, 4 per round: 3 rounds per epoch, so at round 4 a restarted tree holds
    popcount(3) + popcount(1) = 3 nodes where one tree would hold popcount(4) = 1."""
    z, clip, planned = 1.0, 0.1, 2
    spec = accounting_spec.AccountingSpec(
        population=12,
        users_per_round=4,
        rounds=4,
        noise_multiplier=z,
        delta=1e-3,
        mechanism=accounting_spec.Mechanism.DPFTRL,
        users_per_virtual_client=2,
        restart_every_epoch=True,
    )
    process = processes.build_fedemb_process(
        BACKBONE,
        CONFIG,
        mechanisms.aggregator_for_spec(
            spec,
            clip_norm=clip,
            virtual_clients_per_round=planned,
            noise_seed=4,
            rounds_per_epoch=3,
            use_efficient_tree=False,  # the plain tree: node counts give the std exactly
        ),
        processes.server_sgdm(1.0, 0.0),
    )
    assert "float32[8,5]" not in str(process.next.type_signature)
    start = process.initialize()
    state = start
    ratios = []
    for seed in range(4):
        state = process.next(state, [_client_dataset(seed, ["a", "b", "a", "b"])]).state
        moved = np.concatenate([d.ravel() for d in _delta(process, start, state)])
        # The clipped updates (norm <= γ / M a round) are negligible beside the noise.
        ratios.append(moved.std() / (z * clip / planned))
    # 99.99% bounds of a sample std over ~30k coordinates.
    half_width = 3.9 * np.sqrt(1.0 / (2.0 * moved.size))
    for ratio, nodes in zip(ratios, [1, 1, 2, 3]):
        assert abs(ratio / np.sqrt(nodes) - 1) < half_width + 0.01, ratios


def test_dp_fedavg_aggregates_and_noises_the_global_head(tff_runtime):
    vocabulary = identity_heads.identity_keys_vocabulary(["a", "b", "c"])
    process = processes.build_fedavg_process(
        BACKBONE,
        CONFIG,
        vocabulary,
        aggregators.gaussian_fixed(
            noise_multiplier=0.0, clip_norm=100.0, virtual_clients_per_round=1, noise_seed=5
        ),
        processes.server_sgdm(1.0, 0.0),
    )
    state = process.initialize()
    weights = process.get_model_weights(state)
    assert weights.trainable["head"][0].shape == (BACKBONE.embedding_size, 3)
    output = process.next(state, [_client_dataset(5, ["a", "b", "c", "zzz"])])
    assert (
        output.metrics["client_work"]["examples_over_head_capacity"] == 1
    )  # "zzz" is not a training identity
    new_head = process.get_model_weights(output.state).trainable["head"][0]
    assert not np.allclose(new_head, weights.trainable["head"][0])
    assert len(_backbone(process, output.state).trainable) == len(
        models.build_backbone(BACKBONE).trainable_weights
    )

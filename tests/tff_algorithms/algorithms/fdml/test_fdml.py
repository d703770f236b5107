"""FDML (issue 27): the grouped triplet loss, Alg. 1's derivatives, and the two-computation round."""

import collections
import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.algorithms.fdml import privacy as fdml_privacy
from tff_algorithms.algorithms.fdml import protocol as fdml
from tff_algorithms.algorithms.fdml import round_config, triplet
from tff_algorithms.algorithms.fdml import run as fdml_run
from tff_algorithms.config import model_config
from tff_algorithms.federated import runtime

IMAGE_SHAPE = (2, 2, 1)
EMBEDDING = 3


def _reference_triplets(embeddings, keys, valid, strategy, margin):
    """Active mined triplets of one group by plain loops (independent of `triplet`)."""
    rows = range(len(keys))

    def dist(i, j):
        return float(np.linalg.norm(embeddings[i] - embeddings[j]))

    found = []
    for a in rows:
        for p in rows:
            if a == p or not (valid[a] and valid[p]) or keys[a] != keys[p]:
                continue
            negatives = [n for n in rows if valid[n] and keys[n] != keys[a]]
            if not negatives:
                continue
            if strategy == triplet.SEMI_HARD:
                farther = [n for n in negatives if dist(a, n) > dist(a, p)]
                if farther:
                    negatives = [min(farther, key=lambda n: (dist(a, n), n))]
                else:
                    negatives = [max(negatives, key=lambda n: (dist(a, n), -n))]
            found += [(a, p, n) for n in negatives if dist(a, p) - dist(a, n) + margin > 0]
    return found


def _reference_derivatives(embeddings, triplets):
    """Alg. 1, lines 2-10, literally."""
    out = np.zeros_like(embeddings)
    for a, p, n in triplets:
        u_ap = (embeddings[a] - embeddings[p]) / np.linalg.norm(embeddings[a] - embeddings[p])
        u_an = (embeddings[a] - embeddings[n]) / np.linalg.norm(embeddings[a] - embeddings[n])
        out[a] += u_ap - u_an
        out[p] += -u_ap
        out[n] += u_an
    return out / max(len(triplets), 1)


def _reference_buffer(embeddings, keys, valid, users_per_group, strategy, margin):
    """(derivatives, active count) of a [slots, s, d] buffer, group by group."""
    slots, s, _ = embeddings.shape
    out = np.zeros_like(embeddings)
    total = 0
    for start in range(0, slots, users_per_group):
        group = slice(start, min(start + users_per_group, slots))
        e = embeddings[group].reshape(-1, embeddings.shape[-1])
        found = _reference_triplets(
            e, keys[group].reshape(-1), valid[group].reshape(-1), strategy, margin
        )
        out[group] = _reference_derivatives(e, found).reshape(embeddings[group].shape)
        total += len(found)
    return out, total


def _random_buffer(seed, slots=5, s=3, d=4, identities=3):
    rng = np.random.default_rng(seed)
    embeddings = rng.normal(size=(slots, s, d))
    keys = rng.integers(0, identities, size=(slots, s)).astype(np.int64)
    valid = rng.random((slots, s)) > 0.25
    return embeddings, keys, valid


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
@pytest.mark.parametrize("users_per_group", [1, 2, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alg1_derivatives_equal_autodiff_and_a_loop_over_triplets(strategy, users_per_group, seed):
    embeddings, keys, valid = _random_buffer(seed)
    e = tf.constant(embeddings)
    with tf.GradientTape() as tape:
        tape.watch(e)
        loss = triplet.buffer_loss(e, keys, valid, users_per_group, strategy, 0.5)
    autodiff = tape.gradient(loss, e).numpy()
    alg1, count = triplet.buffer_derivatives(e, keys, valid, users_per_group, strategy, 0.5)
    reference, reference_count = _reference_buffer(
        embeddings, keys, valid, users_per_group, strategy, 0.5
    )
    np.testing.assert_allclose(alg1.numpy(), autodiff, atol=1e-12)
    np.testing.assert_allclose(alg1.numpy(), reference, atol=1e-12)
    assert int(count) == reference_count


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
def test_mining_with_tied_distances_matches_the_loop(strategy):
    """Distinct points of an integer grid: many equal distances, so the semi-hard choice
    and the binary searches meet ties (the loop breaks them by the lowest row)."""
    rng = np.random.default_rng(7)
    grid = np.array([(x, y) for x in range(4) for y in range(4)], np.float64)
    embeddings = grid[rng.permutation(len(grid))[:12]].reshape(3, 4, 2)
    keys = rng.integers(0, 3, size=(3, 4)).astype(np.int64)
    valid = np.ones((3, 4), bool)
    for margin in (0.3, 1.3):
        alg1, count = triplet.buffer_derivatives(
            tf.constant(embeddings), keys, valid, 3, strategy, margin
        )
        reference, reference_count = _reference_buffer(embeddings, keys, valid, 3, strategy, margin)
        np.testing.assert_allclose(alg1.numpy(), reference, atol=1e-12)
        assert int(count) == reference_count


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
def test_padded_rows_are_in_no_triplet(strategy):
    embeddings, keys, valid = _random_buffer(3)
    derivatives, count = triplet.buffer_derivatives(
        tf.constant(embeddings), keys, valid, 2, strategy, 1.0
    )
    assert np.all(derivatives.numpy()[~valid] == 0)
    # Whatever padding holds, even NaN, nothing changes.
    rng = np.random.default_rng(9)
    for filler in (100 * rng.normal(size=embeddings.shape), np.full(embeddings.shape, np.nan)):
        other = np.where(valid[..., None], embeddings, filler)
        other_keys = np.where(valid, keys, keys[0, 0])
        derivatives2, count2 = triplet.buffer_derivatives(
            tf.constant(other), other_keys, valid, 2, strategy, 1.0
        )
        np.testing.assert_array_equal(derivatives.numpy(), derivatives2.numpy())
        assert int(count) == int(count2)
        loss = triplet.buffer_loss(tf.constant(other), other_keys, valid, 2, strategy, 1.0)
        assert np.isfinite(loss.numpy())


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
def test_buffers_without_a_triplet_have_zero_derivatives(strategy):
    embeddings, _, valid = _random_buffer(5)
    for keys, mask in [
        (np.zeros((5, 3), np.int64), valid),  # one identity: no negative
        (np.arange(15, dtype=np.int64).reshape(5, 3), valid),  # no positive pair
        (np.zeros((5, 3), np.int64), np.zeros((5, 3), bool)),  # all padding
    ]:
        derivatives, count = triplet.buffer_derivatives(
            tf.constant(embeddings), keys, mask, 5, strategy, 1.0
        )
        assert int(count) == 0 and not np.any(derivatives.numpy())


def test_groups_do_not_reach_each_other():
    embeddings, keys, valid = _random_buffer(4, slots=4)
    before, _ = triplet.buffer_derivatives(
        tf.constant(embeddings), keys, valid, 2, "batch_all", 1.0
    )
    changed = embeddings.copy()
    changed[3] = np.random.default_rng(5).normal(size=changed[3].shape)
    after, _ = triplet.buffer_derivatives(tf.constant(changed), keys, valid, 2, "batch_all", 1.0)
    np.testing.assert_array_equal(before.numpy()[:2], after.numpy()[:2])


# --- the process ----------------------------------------------------------------------


def _backbone(image_shape=IMAGE_SHAPE):
    return tf.keras.Sequential(
        [
            tf.keras.layers.Flatten(input_shape=image_shape),
            # No bias: distances ignore a shift, so its gradient is zero up to rounding,
            # which Adam would amplify into a spurious comparison failure.
            tf.keras.layers.Dense(
                EMBEDDING,
                use_bias=False,
                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1),
            ),
        ]
    )


def _user(seed, identity, count):
    rng = np.random.default_rng(seed)
    return {
        "image": rng.random((count, *IMAGE_SHAPE)).astype(np.float32),
        "identity": np.full(count, identity, np.int64),
    }


def _dataset(user):
    return tf.data.Dataset.from_tensor_slices(user)


# Five users of three identities (one user with fewer than s examples: padded rows).
USERS = [_user(0, 0, 3), _user(1, 0, 3), _user(2, 1, 2), _user(3, 1, 3), _user(4, 2, 3)]


def _centralized_gradient(model, users, s, strategy, margin):
    """Autodiff of the centralized triplet loss over the same examples (one group)."""
    images = np.concatenate([u["image"][:s] for u in users])
    keys = np.concatenate([u["identity"][:s] for u in users])
    with tf.GradientTape() as tape:
        embeddings = model(images, training=False)
        found = _reference_triplets(
            embeddings.numpy(), keys, np.ones(len(keys), bool), strategy, margin
        )
        a, p, n = (list(x) for x in zip(*found))
        d_ap = tf.norm(tf.gather(embeddings, a) - tf.gather(embeddings, p), axis=1)
        d_an = tf.norm(tf.gather(embeddings, a) - tf.gather(embeddings, n), axis=1)
        loss = tf.reduce_mean(d_ap - d_an + margin)
    return tape.gradient(loss, model.trainable_weights)


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
def test_one_round_equals_the_centralized_triplet_gradient(tff_runtime, strategy):
    config = round_config.FdmlConfig(
        samples_per_user=3,
        users_per_round=5,
        strategy=strategy,
        margin=1.0,
        server_learning_rate=0.01,
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    state = process.initialize()
    output = process.next(state, [_dataset(u) for u in USERS])
    assert output.applied and output.metrics["aggregated"] == 5

    model = _backbone()
    weights = fdml.backbone_weights(state)
    for variable, value in zip(model.trainable_weights, weights.trainable):
        variable.assign(value)
    expected = _centralized_gradient(model, USERS, 3, strategy, 1.0)
    # Eq. 2: the released aggregate is the sum of the participants' gradients over n.
    for got, want in zip(output.gradient, expected):
        np.testing.assert_allclose(got * 5, want.numpy(), rtol=1e-5, atol=1e-6)

    # The server's Adam step on that gradient.
    adam = tff.learning.optimizers.build_adam(learning_rate=0.01)
    specs = [tf.TensorSpec(w.shape, tf.float32) for w in weights.trainable]
    _, stepped = adam.next(
        adam.initialize(specs),
        [tf.constant(w) for w in weights.trainable],
        [w / 5 for w in expected],
    )
    for got, want in zip(fdml.backbone_weights(output.state).trainable, stepped):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def small_process():
    config = round_config.FdmlConfig(samples_per_user=3, users_per_round=3, margin=1.0)
    return fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)


def test_case_a_over_selection_fills_the_buffer_and_too_few_restart(tff_runtime, small_process):
    state = small_process.initialize()
    data = [_dataset(u) for u in USERS]
    output = small_process.next(state, data, case_a_failures=[1])
    assert output.applied
    assert output.metrics["case_a_failures"] == 1
    assert output.metrics["case_b_failures"] == 0
    # Users 0, 2, 3 uploaded first: the same round as selecting exactly them.
    same = small_process.next(state, [data[0], data[2], data[3]])
    for got, want in zip(output.gradient, same.gradient):
        np.testing.assert_allclose(got, want, rtol=1e-6)

    with pytest.raises(ValueError, match="case_b_failures must index"):
        small_process.next(state, data, case_b_failures=[5])
    restarted = small_process.next(state, data, case_a_failures=[0, 1, 2])
    assert restarted.restarted and not restarted.applied and not restarted.abandoned
    assert restarted.state is state


def test_case_b_continue_or_abandon(tff_runtime):
    base = dict(samples_per_user=3, users_per_round=3, margin=1.0)
    data = [_dataset(u) for u in USERS[:3]]
    uc = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, round_config.FdmlConfig(**base))
    state = uc.initialize()
    output = uc.next(state, data, case_b_failures=[1])
    assert output.applied and output.metrics["case_b_failures"] == 1
    assert output.metrics["aggregated"] == 2
    assert output.metrics["case_a_failures"] == 0

    as_ = fdml.FdmlProcess(
        _backbone, IMAGE_SHAPE, round_config.FdmlConfig(**base, case_b_strategy=round_config.AS)
    )
    state = as_.initialize()
    abandoned = as_.next(state, data, case_b_failures=[1])
    assert abandoned.abandoned and not abandoned.applied
    for got, want in zip(
        fdml.backbone_weights(abandoned.state).trainable, fdml.backbone_weights(state).trainable
    ):
        np.testing.assert_array_equal(got, want)
    # The derivatives were released under this round's seed: the next round draws anew.
    assert int(abandoned.state["round_num"]) == int(state["round_num"]) + 1


def test_response_rate_aggregates_the_first_arrivals(tff_runtime):
    config = round_config.FdmlConfig(
        samples_per_user=3, users_per_round=3, margin=1.0, response_rate=0.6
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    output = process.next(process.initialize(), [_dataset(u) for u in USERS[:3]])
    assert output.metrics["aggregated"] == 2


def test_noise_is_seeded_by_round_and_clips_hold(tff_runtime):
    config = round_config.FdmlConfig(
        samples_per_user=3,
        users_per_round=3,
        margin=1.0,
        row_clip=0.1,
        derivative_noise_multiplier=1.0,
        gradient_clip=0.05,
        gradient_noise_multiplier=0.0,
        noise_seed=7,
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    embeddings = np.random.default_rng(0).normal(size=(3, 3, EMBEDDING)).astype(np.float32)
    keys = np.array([[0] * 3, [0] * 3, [1] * 3], np.int64)
    valid = np.ones((3, 3), bool)
    seed = np.array([7, 0], np.int64)
    first = process.server_step(embeddings, keys, valid, seed, np.int64(0))["derivatives"]
    again = process.server_step(embeddings, keys, valid, seed, np.int64(0))["derivatives"]
    second = process.server_step(embeddings, keys, valid, seed, np.int64(1))["derivatives"]
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, second)
    output = process.next(process.initialize(), [_dataset(u) for u in USERS[:3]])
    # No gradient noise: the aggregate is a mean of 3 gradients clipped to 0.05.
    norm = np.sqrt(sum(float(np.sum(g**2)) for g in output.gradient))
    assert norm <= 0.05 + 1e-6


@pytest.mark.parametrize("strategy", triplet.STRATEGIES)
def test_every_released_derivative_row_is_clipped_to_row_clip(tff_runtime, strategy):
    """R1's sensitivity (`fdml_privacy`) rests on every row the real server step releases
    having norm <= C_r: without noise the release is exactly clip_{C_r}(Alg. 1's row)."""
    row_clip = 0.01
    config = round_config.FdmlConfig(
        samples_per_user=3,
        users_per_round=5,
        users_per_group=3,
        strategy=strategy,
        margin=1.0,
        row_clip=row_clip,
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    embeddings, keys, valid = _random_buffer(6, slots=5, s=3, d=EMBEDDING, identities=2)
    step = process.server_step(
        embeddings.astype(np.float32), keys, valid, np.array([0, 0], np.int64), np.int64(0)
    )
    released = np.asarray(step["derivatives"], np.float64)
    assert np.all(np.linalg.norm(released, axis=-1) <= row_clip * (1 + 1e-5))
    # The clip had work to do: most real rows of Alg. 1 are far above C_r.
    raw, _ = _reference_buffer(embeddings, keys, valid, 3, strategy, 1.0)
    raw_norms = np.linalg.norm(raw, axis=-1)
    assert (raw_norms > 10 * row_clip).sum() >= 5, raw_norms
    # Clipping scales a row, never turns it: the released row is clip(Alg. 1's row).
    expected = raw * np.minimum(1.0, row_clip / np.maximum(raw_norms, 1e-30))[..., None]
    np.testing.assert_allclose(released, expected, rtol=1e-4, atol=1e-7)


def test_server_step_drops_embeddings_and_treats_non_finite_uploads_as_padding(tff_runtime):
    config = round_config.FdmlConfig(
        samples_per_user=10, users_per_round=6, margin=1.0, embedding_drop_rate=0.3
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    rng = np.random.default_rng(1)
    embeddings = rng.normal(size=(6, 10, EMBEDDING)).astype(np.float32)
    keys = np.repeat(np.array([0, 0, 1, 1, 2, 2], np.int64)[:, None], 10, axis=1)
    valid = np.ones((6, 10), bool)
    seed = np.array([1, 2], np.int64)
    step = process.server_step(embeddings, keys, valid, seed, np.int64(0))
    used = np.asarray(step["used"])
    assert int(step["dropped_embeddings"]) == int((~used).sum())
    assert 0.15 < (~used).mean() < 0.45
    assert not np.any(np.asarray(step["derivatives"])[~used])
    # The same buffer with the dropped rows marked as padding: the same derivatives.
    plain = fdml.FdmlProcess(
        _backbone, IMAGE_SHAPE, dataclasses.replace(config, embedding_drop_rate=0.0)
    )
    again = plain.server_step(embeddings, keys, used, seed, np.int64(0))
    np.testing.assert_array_equal(step["derivatives"], again["derivatives"])
    # A NaN row counts as non-finite and as padding; nothing else becomes NaN.
    poisoned = embeddings.copy()
    poisoned[2, 3, 0] = np.nan
    step = plain.server_step(poisoned, keys, valid, seed, np.int64(0))
    assert int(step["non_finite_embeddings"]) == 1 and not np.asarray(step["used"])[2, 3]
    assert np.all(np.isfinite(step["derivatives"])) and np.isfinite(step["loss"])
    expected = valid.copy()
    expected[2, 3] = False
    reference = plain.server_step(embeddings, keys, expected, seed, np.int64(0))
    np.testing.assert_array_equal(step["derivatives"], reference["derivatives"])


def test_noise_std_is_z_times_clip(tff_runtime):
    """The std the accountant's sensitivities are divided into (tests/tff_algorithms/algorithms/fdml/test_fdml_privacy.py)."""
    shape = (16, 16, 1)
    config = round_config.FdmlConfig(
        samples_per_user=30,
        users_per_round=10,
        row_clip=0.1,
        derivative_noise_multiplier=3.0,
        gradient_clip=0.2,
        gradient_noise_multiplier=2.5,
        noise_seed=3,
    )
    process = fdml.FdmlProcess(lambda: _backbone(shape), shape, config)
    # An all-padding buffer has zero derivatives: what is released is the noise alone.
    step = process.server_step(
        np.zeros((10, 30, EMBEDDING), np.float32),
        np.zeros((10, 30), np.int64),
        np.zeros((10, 30), bool),
        np.array([3, 0], np.int64),
        np.int64(0),
    )
    assert np.std(step["derivatives"]) == pytest.approx(0.3, rel=0.1)
    # Participants with no examples backpropagate nothing: the aggregate is noise / n.
    empty = {
        "image": np.zeros((0, *shape), np.float32),
        "identity": np.zeros((0,), np.int64),
    }
    output = process.next(process.initialize(), [_dataset(empty)] * 10)
    noise = np.concatenate([g.ravel() for g in output.gradient]) * 10
    assert np.std(noise) == pytest.approx(0.5, rel=0.1)


def test_config_refuses_noise_without_clip_and_bad_rates():
    with pytest.raises(ValueError, match="row_clip"):
        round_config.FdmlConfig(
            samples_per_user=2, users_per_round=2, derivative_noise_multiplier=1.0
        )
    with pytest.raises(ValueError, match="gradient_clip"):
        round_config.FdmlConfig(
            samples_per_user=2, users_per_round=2, gradient_noise_multiplier=1.0
        )
    with pytest.raises(ValueError, match="response_rate"):
        round_config.FdmlConfig(samples_per_user=2, users_per_round=2, response_rate=0)
    with pytest.raises(ValueError, match="strategy"):
        round_config.FdmlConfig(samples_per_user=2, users_per_round=2, strategy="hardest")


def test_draw_failures_is_data_independent_and_disjoint():
    a, b = fdml_run.draw_failures(3, 7, 20, 0.3, 0.3)
    assert (a, b) == fdml_run.draw_failures(3, 7, 20, 0.3, 0.3)
    assert not set(a) & set(b)
    assert collections.Counter(a + b).most_common(1)[0][1] == 1


@pytest.mark.slow
def test_a_private_run_on_the_product_backbone_is_charged_per_release(tff_runtime):
    backbone = model_config.BackboneConfig(
        model_config.SMALL_CNN, (8, 8, 1), embedding_size=4, max_groups=4
    )
    config = round_config.FdmlConfig(
        samples_per_user=2,
        users_per_round=3,
        users_per_group=3,
        row_clip=0.1,
        derivative_noise_multiplier=4.0,
        gradient_clip=0.1,
        gradient_noise_multiplier=1.0,
        case_b_strategy=round_config.AS,
        server_learning_rate=0.01,
        noise_seed=5,
    )
    process = fdml.build_fdml_process(backbone, config, backbone_seed=2)
    rng = np.random.default_rng(0)
    users = [
        tf.data.Dataset.from_tensor_slices(
            {
                "image": rng.random((2, 8, 8, 1)).astype(np.float32),
                "identity": np.array([f"id{u % 2}"] * 2),
            }
        )
        for u in range(4)
    ]
    state = process.initialize()
    # (Case A failures, Case B failures) of each attempt; 4 selected for 3 slots.
    attempts = [([], []), ([], [2]), ([0, 1], []), ([3], [])]
    applied = abandoned = restarted = 0
    for case_a, case_b in attempts:
        output = process.next(state, users, case_a_failures=case_a, case_b_failures=case_b)
        applied += output.applied
        abandoned += output.abandoned
        restarted += output.restarted
        assert all(np.all(np.isfinite(w)) for w in fdml.backbone_weights(output.state).trainable)
        state = output.state
    assert (applied, abandoned, restarted) == (2, 1, 1)
    assert int(state["round_num"]) == 3  # every release advanced the noise stream

    spec = fdml_run.privacy_spec(
        config, population=100, selected_per_round=4, rounds=applied, abandoned_rounds=abandoned
    )
    assert (spec.users_per_group, spec.samples_per_user, spec.users_per_round) == (3, 2, 4)
    epsilon = fdml_privacy.compute_epsilon(spec, 1e-5)
    without_abandoned = fdml_privacy.compute_epsilon(
        dataclasses.replace(spec, abandoned_rounds=0), 1e-5
    )
    assert math.isfinite(epsilon) and epsilon > without_abandoned
    non_private = fdml_run.privacy_spec(
        round_config.FdmlConfig(samples_per_user=2, users_per_round=3),
        population=100,
        selected_per_round=3,
        rounds=1,
    )
    assert fdml_privacy.compute_epsilon(non_private, 1e-5) == math.inf


@pytest.mark.slow
def test_one_and_two_workers_give_the_same_round(tff_runtime):
    """Two workers return the uploads in the order they finish: the round must not care."""
    config = round_config.FdmlConfig(
        samples_per_user=3,
        users_per_round=4,
        users_per_group=2,
        margin=1.0,
        row_clip=0.5,
        derivative_noise_multiplier=0.1,
        gradient_clip=1.0,
        gradient_noise_multiplier=0.1,
        server_learning_rate=0.01,
        noise_seed=4,
    )
    data = [_dataset(u) for u in USERS]

    def one_round():
        process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
        return process.next(process.initialize(), data, case_a_failures=[1])

    one = one_round()
    with runtime.TffRuntime(runtime.RuntimeConfig(local_workers=2)):
        two = one_round()
    assert one.metrics == two.metrics
    for a, b in zip(one.gradient, two.gradient):
        # Float32 sums merged in another order.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_run_fdml_samples_uniformly_and_charges_every_release(tff_runtime):
    config = round_config.FdmlConfig(
        samples_per_user=2,
        users_per_round=3,
        margin=1.0,
        row_clip=0.5,
        derivative_noise_multiplier=5.0,
        gradient_clip=0.5,
        gradient_noise_multiplier=1.0,
        case_b_strategy=round_config.AS,
        server_learning_rate=0.01,
    )
    process = fdml.FdmlProcess(_backbone, IMAGE_SHAPE, config)
    population = [_user(10 + u, u % 4, 2) for u in range(8)]
    loaded = []

    def user_data(index, round_num):
        loaded.append(index)
        # The round's samples: a shuffle seeded by (user, round), the same on replay.
        return _dataset(population[index]).shuffle(
            4, seed=100 * round_num + index, reshuffle_each_iteration=False
        )

    run = fdml_run.run_fdml(
        process,
        process.initialize(),
        user_data,
        population=8,
        rounds=4,
        delta=1e-3,
        seed=1,
        over_selection=0.5,
        case_a_rate=0.2,
        case_b_rate=0.15,
        max_attempts=5,
    )
    selected = 5  # ceil(3 x 1.5)
    attempts = [loaded[i : i + selected] for i in range(0, len(loaded), selected)]
    assert all(len(set(a)) == selected for a in attempts)  # without replacement
    assert len(attempts) == 4 + run.restarts
    assert run.applied_rounds + run.abandoned_rounds == 4
    assert [r["attempts"] for r in run.history] and sum(r["attempts"] for r in run.history) == len(
        attempts
    )
    epsilons = [r["epsilon"] for r in run.history]
    assert epsilons == sorted(epsilons) and math.isfinite(epsilons[-1])
    spec = fdml_run.privacy_spec(
        config,
        population=8,
        selected_per_round=selected,
        rounds=run.applied_rounds,
        abandoned_rounds=run.abandoned_rounds,
    )
    assert run.spec == spec
    assert run.epsilon == fdml_privacy.compute_epsilon(spec, 1e-3)
    assert not any(name in r for r in run.history for name in fdml.UNPRIVATE_METRICS)

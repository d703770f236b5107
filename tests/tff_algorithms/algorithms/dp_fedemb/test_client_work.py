"""DP-FedEmb client work: local head, learning rates, remapping, losses, non-finite updates."""

import dataclasses
import math

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.algorithms.dp_fedemb import client_work, local_training
from tff_algorithms.config import client_config, model_config
from tff_algorithms.modeling import identity_heads, models

BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
CONFIG = client_config.ClientConfig(
    client_learning_rate=0.05,
    head_learning_rate_scale=10.0,
    head_capacity=4,
    batch_size=3,
    shuffle_buffer=1,  # keeps the loader's order, so the hand computation sees the same batches
    head_seed=5,
)
IDENTITIES = np.array(["b", "a", "c", "a", "b", "c"])
CLIENT_ID = "round0/vc0"


def _images(seed):
    return np.random.default_rng(seed).random((len(IDENTITIES), 28, 28, 1), dtype=np.float32)


def _client_dataset(images, identities, config=CONFIG, client_id=CLIENT_ID):
    examples = tf.data.Dataset.from_tensor_slices({"image": images, "identity": identities})
    return client_work.make_client_dataset(examples, client_id, config)


def _backbone_fn():
    return models.build_backbone(BACKBONE)


@pytest.fixture(scope="module")
def initial_weights():
    return models.backbone_weights(models.build_backbone(BACKBONE, seed=3))


def _client_work(config, identity_dtype=tf.string):
    return client_work.build_fedemb_client_work(
        _backbone_fn,
        models.backbone_weights_type(BACKBONE),
        client_work.client_element_spec(BACKBONE.image_shape, identity_dtype),
        config,
    )


def _assert_differs(updates, others):
    assert not all(
        np.allclose(got, other, rtol=1e-3, atol=1e-5) for got, other in zip(updates, others)
    )


@pytest.fixture(scope="module")
def fedemb_work(tff_runtime):
    return _client_work(CONFIG)


def _hand_computed_update(weights, images, identities, config, round_num=0):
    """Plain eager SGD on the backbone (β1) and local head (β2) over the same batches."""
    backbone = models.build_backbone(BACKBONE)
    models.assign_backbone_weights(backbone, weights)
    keys = identity_heads.identity_keys(tf.constant(identities))
    vocabulary = tf.sort(tf.unique(keys).y)
    if config.head_init == client_config.HEAD_INIT_CLASS_MEANS:
        # Row j: the mean unit embedding of local identity j, rescaled to the row norm.
        unit = tf.math.l2_normalize(backbone(images, training=False), axis=1).numpy()
        codes = np.searchsorted(vocabulary.numpy(), keys.numpy())
        head = np.zeros((BACKBONE.embedding_size, config.head_capacity), np.float32)
        for code in range(len(vocabulary)):
            mean = unit[codes == code].mean(axis=0)
            head[:, code] = config.class_means_norm * mean / np.linalg.norm(mean)
        head = tf.constant(head)
    else:
        seed = local_training.local_head_seed(
            config.head_seed, round_num, client_work.client_seed_from_id(tf.constant(CLIENT_ID))
        )
        head = models.initial_head_kernel(seed, BACKBONE.embedding_size, config.head_capacity)
    theta = [tf.constant(w) for w in weights.trainable]
    for start in range(0, len(identities), config.batch_size):
        batch_keys = keys[start : start + config.batch_size]
        labels, usable = identity_heads.labels_in_vocabulary(
            batch_keys, vocabulary, config.head_capacity
        )
        with tf.GradientTape() as tape:
            tape.watch(head)
            embeddings = backbone(images[start : start + config.batch_size], training=True)
            logits = identity_heads.head_logits(
                embeddings, head, labels, config.head_loss, tf.size(vocabulary)
            )
            loss = identity_heads.head_loss(logits, labels, usable)
        grads, head_grad = tape.gradient(loss, (backbone.trainable_weights, head))
        for variable, grad in zip(backbone.trainable_weights, grads):
            variable.assign_sub(config.client_learning_rate * grad)
        head = head - config.head_learning_rate * head_grad
    return [t.numpy() - v.numpy() for t, v in zip(theta, backbone.trainable_weights)]


def test_update_matches_hand_computed_sgd_with_head_lr_scale(fedemb_work, initial_weights):
    images = _images(0)
    output = fedemb_work.next(
        fedemb_work.initialize(), [initial_weights], [_client_dataset(images, IDENTITIES)]
    )
    (result,) = output.result
    expected = _hand_computed_update(initial_weights, images, IDENTITIES, CONFIG)
    for got, want in zip(result.update, expected):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
    # The head learning rate matters: the same steps with β2 = β1 give another update.
    unscaled = _hand_computed_update(
        initial_weights,
        images,
        IDENTITIES,
        client_config.ClientConfig(**{**CONFIG.__dict__, "head_learning_rate_scale": 1.0}),
    )
    _assert_differs(result.update, unscaled)
    assert result.update_weight == 1.0
    assert output.measurements["num_examples"] == len(IDENTITIES)
    assert output.measurements["non_finite_updates"] == 0
    assert output.state["round_num"] == 1


def test_update_carries_only_the_backbone(fedemb_work):
    backbone_type = models.backbone_weights_type(BACKBONE)
    update_type = fedemb_work.next.type_signature.result.result.member.update
    assert update_type.is_equivalent_to(backbone_type.trainable)
    head_shape = (BACKBONE.embedding_size, CONFIG.head_capacity)
    assert head_shape not in [tuple(t.shape) for t in backbone_type.trainable]
    # Nothing the client work keeps at the server can hold a head.
    state_type = fedemb_work.initialize.type_signature.result.member
    assert all(len(t.shape) == 0 for t in state_type)


def test_head_is_fresh_per_round_and_virtual_client(fedemb_work, initial_weights):
    images = _images(1)
    state = fedemb_work.initialize()
    first = fedemb_work.next(state, [initial_weights], [_client_dataset(images, IDENTITIES)])
    second = fedemb_work.next(first.state, [initial_weights], [_client_dataset(images, IDENTITIES)])
    assert not np.allclose(first.result[0].update[-1], second.result[0].update[-1])
    seed = local_training.local_head_seed
    kernel = models.initial_head_kernel
    assert np.array_equal(kernel(seed(5, 0, 1), 8, 4), kernel(seed(5, 0, 1), 8, 4))
    for other in (seed(5, 1, 1), seed(5, 0, 2), seed(6, 0, 1)):
        assert not np.allclose(kernel(seed(5, 0, 1), 8, 4), kernel(other, 8, 4))


def test_class_means_head_matches_hand_computed_sgd(tff_runtime, initial_weights):
    config = dataclasses.replace(
        CONFIG, head_init=client_config.HEAD_INIT_CLASS_MEANS, class_means_norm=3.0
    )
    work = _client_work(config)
    images = _images(4)
    state = work.initialize()
    first = work.next(state, [initial_weights], [_client_dataset(images, IDENTITIES, config)])
    expected = _hand_computed_update(initial_weights, images, IDENTITIES, config)
    for got, want in zip(first.result[0].update, expected):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
    # The initial head matters: the same steps from the random head give another update.
    random_start = _hand_computed_update(initial_weights, images, IDENTITIES, CONFIG)
    _assert_differs(first.result[0].update, random_start)
    # Fresh every round: nothing carries over, so the same data and backbone give the
    # same update in the next round.
    second = work.next(
        first.state, [initial_weights], [_client_dataset(images, IDENTITIES, config)]
    )
    for a, b in zip(first.result[0].update, second.result[0].update):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss", [client_config.COSFACE, client_config.ARCFACE])
def test_margin_loss_update_matches_hand_computed_sgd(tff_runtime, initial_weights, loss):
    config = dataclasses.replace(
        CONFIG,
        head_init=client_config.HEAD_INIT_CLASS_MEANS,
        head_loss=client_config.HeadLossConfig(loss, scale=16.0, margin=0.2),
    )
    work = _client_work(config)
    images = _images(5)
    output = work.next(
        work.initialize(), [initial_weights], [_client_dataset(images, IDENTITIES, config)]
    )
    expected = _hand_computed_update(initial_weights, images, IDENTITIES, config)
    for got, want in zip(output.result[0].update, expected):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
    # The loss matters: softmax from the same start gives another update.
    softmax = dataclasses.replace(config, head_loss=client_config.HeadLossConfig())
    other = _hand_computed_update(initial_weights, images, IDENTITIES, softmax)
    _assert_differs(output.result[0].update, other)


def test_non_finite_update_becomes_zero(fedemb_work, initial_weights):
    images = _images(2)
    images[0, 0, 0, 0] = np.nan
    output = fedemb_work.next(
        fedemb_work.initialize(), [initial_weights], [_client_dataset(images, IDENTITIES)]
    )
    assert output.measurements["non_finite_updates"] == 1
    assert all(not np.any(u) for u in output.result[0].update)
    assert output.result[0].update_weight == 1.0


def test_identities_beyond_head_capacity_are_dropped_and_counted(tff_runtime, initial_weights):
    config = client_config.ClientConfig(client_learning_rate=0.05, head_capacity=2, batch_size=4)
    work = _client_work(config, tf.int64)
    identities = np.array(
        [30, 10, 20, 10, 30, 30], np.int64
    )  # local ranks: 10 -> 0, 20 -> 1, 30 -> dropped
    output = work.next(
        work.initialize(), [initial_weights], [_client_dataset(_images(3), identities, config)]
    )
    assert output.measurements["examples_over_head_capacity"] == 3
    assert output.measurements["num_examples"] == 3


def test_labels_are_ranks_among_the_clients_identities():
    vocabulary = tf.constant([10, 20, 30], tf.int64)
    labels, usable = identity_heads.labels_in_vocabulary(
        tf.constant([30, 10, 25, 99, 20], tf.int64), vocabulary, 3
    )
    np.testing.assert_array_equal(usable, [True, True, False, False, True])
    np.testing.assert_array_equal(labels.numpy()[usable.numpy()], [2, 0, 1])


def test_masked_rows_get_zero_probability():
    embeddings = tf.random.stateless_normal([5, 8], seed=[1, 2])
    kernel = tf.random.stateless_normal([8, 6], seed=[3, 4])
    labels = tf.constant([0, 1, 2, 0, 1])
    for loss in client_config.HEAD_LOSSES:
        logits = identity_heads.head_logits(
            embeddings, kernel, labels, client_config.HeadLossConfig(loss), 3
        )
        probabilities = tf.nn.softmax(logits).numpy()
        assert np.all(probabilities[:, 3:] == 0.0)
        np.testing.assert_allclose(probabilities[:, :3].sum(axis=1), 1.0, rtol=1e-5)


def test_margin_logits_match_their_definitions():
    embeddings = tf.random.stateless_normal([4, 8], seed=[5, 6])
    kernel = tf.random.stateless_normal([8, 3], seed=[7, 8])
    labels = tf.constant([0, 2, 1, 2])
    e = tf.math.l2_normalize(embeddings, axis=1).numpy()
    w = tf.math.l2_normalize(kernel, axis=0).numpy()
    cosine = e @ w
    onehot = np.eye(3)[labels.numpy()] > 0
    scale, margin = 16.0, 0.3

    cosface = identity_heads.head_logits(
        embeddings, kernel, labels, client_config.HeadLossConfig("cosface", scale, margin)
    )
    np.testing.assert_allclose(
        cosface, scale * np.where(onehot, cosine - margin, cosine), rtol=1e-5, atol=1e-5
    )

    arcface = identity_heads.head_logits(
        embeddings, kernel, labels, client_config.HeadLossConfig("arcface", scale, margin)
    )
    theta = np.arccos(np.clip(cosine, -1, 1))
    target = np.where(
        theta + margin < math.pi,
        np.cos(theta + margin),
        cosine - math.sin(math.pi - margin) * margin,
    )
    np.testing.assert_allclose(
        arcface, scale * np.where(onehot, target, cosine), rtol=1e-4, atol=1e-4
    )

    softmax = identity_heads.head_logits(embeddings, kernel, labels, client_config.HeadLossConfig())
    np.testing.assert_allclose(softmax, embeddings.numpy() @ kernel.numpy(), rtol=1e-5, atol=1e-5)


def test_client_dataset_element_spec_and_cap():
    config = client_config.ClientConfig(client_learning_rate=0.1, batch_size=4, max_examples=5)
    dataset = _client_dataset(_images(4), IDENTITIES, config)
    assert dataset.element_spec == client_work.client_element_spec(BACKBONE.image_shape)
    batches = list(dataset)
    assert [len(b["identity"]) for b in batches] == [4, 1]
    seeds = {int(b["client_seed"]) for b in batches}
    assert seeds == {int(client_work.client_seed_from_id(tf.constant(CLIENT_ID)))}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(client_learning_rate=0.0),
        dict(client_learning_rate=0.1, head_capacity=0),
        dict(client_learning_rate=0.1, momentum=1.0),
    ],
)
def test_nonsense_client_config_is_rejected(kwargs):
    with pytest.raises(ValueError):
        client_config.ClientConfig(**kwargs)


def test_identity_vocabulary_is_sorted_and_distinct():
    vocabulary = identity_heads.identity_keys_vocabulary(["x", "y", "z", "x"])
    assert len(vocabulary) == 3 and np.all(np.diff(vocabulary) > 0)


# ---------------------------------------------------------------------------------------
# Shared negatives with PrivacyFace's cap margin (issue 42), against numpy written here.


def _numpy_margin_logits(embeddings, kernel, labels, loss, scale, margin):
    """CosFace / ArcFace logits of the local rows, by their definitions."""
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    cosine = unit @ (kernel / np.linalg.norm(kernel, axis=0, keepdims=True))
    onehot = np.eye(kernel.shape[1])[labels] > 0
    if loss == client_config.COSFACE:
        return scale * np.where(onehot, cosine - margin, cosine)
    theta = np.arccos(np.clip(cosine, -1, 1))
    target = np.where(
        theta + margin < math.pi,
        np.cos(theta + margin),
        cosine - math.sin(math.pi - margin) * margin,
    )
    return scale * np.where(onehot, target, cosine)


def _numpy_privacyface_loss(embeddings, kernel, labels, negatives, loss, scale, margin, rho):
    """The paper's consensus-aware loss (PrivacyFace Eq. 5, mean over the batch): each
    released center p̂ adds exp(μ) to the denominator, μ = s·cos(max(θ − ρ, 0))."""
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    directions = negatives / np.linalg.norm(negatives, axis=1, keepdims=True)
    theta = np.arccos(np.clip(unit @ directions.T, -1, 1))
    mu = scale * np.cos(np.maximum(theta - rho, 0.0))
    local = _numpy_margin_logits(embeddings, kernel, labels, loss, scale, margin)
    logits = np.concatenate([local, mu], axis=1)
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return float(np.mean(log_z - local[np.arange(len(labels)), labels])), mu


def _at_angles(directions, angles, rng):
    """Unit vectors at the given angles from the given unit directions."""
    out = []
    for p, angle in zip(directions, angles):
        u = rng.normal(size=p.shape)
        u -= (u @ p) * p
        out.append(math.cos(angle) * p + math.sin(angle) * u / np.linalg.norm(u))
    return np.asarray(out)


@pytest.mark.parametrize("loss", [client_config.COSFACE, client_config.ARCFACE])
def test_shared_negatives_take_the_cap_margin_of_privacyface(loss):
    rng = np.random.default_rng(7)
    rho, scale, margin, d = 1.0, 16.0, 0.3, 8
    negatives = rng.normal(size=(2, d)) * [[2.5], [0.7]]  # released rows need not be unit
    units = negatives / np.linalg.norm(negatives, axis=1, keepdims=True)
    # Examples 0-1 inside the cap of center 0 (θ 0.2, 0.9 < ρ), 2-3 outside it (1.4, 2.6),
    # at various lengths; their angles to center 1 are whatever they come out.
    embeddings = _at_angles(units[[0, 0, 0, 0]], [0.2, 0.9, 1.4, 2.6], rng) * [[3], [1], [2], [5]]
    kernel = rng.normal(size=(d, 3))
    labels = np.array([0, 2, 1, 2])
    config = client_config.HeadLossConfig(loss, scale, margin)

    def loss_of(f, cap):
        logits = identity_heads.head_logits(
            f, tf.constant(kernel, tf.float32), tf.constant(labels), config, 3,
            tf.constant(negatives, tf.float32), negative_cap=cap,
        )  # fmt: skip
        return logits, identity_heads.head_loss(logits, tf.constant(labels), tf.ones([4], tf.bool))

    f = tf.Variable(embeddings, dtype=tf.float32)
    with tf.GradientTape() as tape:
        logits, value = loss_of(f, rho)
    gradient = tape.gradient(value, f).numpy()
    expected, mu = _numpy_privacyface_loss(
        embeddings, kernel, labels, negatives, loss, scale, margin, rho
    )
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    np.testing.assert_allclose(logits[:, 3:], mu, rtol=1e-5, atol=1e-4)
    # Inside the cap the logit is s·cos 0 = s; outside it is s·cos(θ − ρ) < s.
    np.testing.assert_allclose(logits[:2, 3], scale, rtol=1e-6)
    np.testing.assert_allclose(logits[2:, 3], scale * np.cos(np.array([1.4, 2.6]) - rho), rtol=1e-5)
    # The gradient against central differences of the numpy loss (float64).
    step, numeric = 1e-5, np.zeros_like(embeddings)
    for index in np.ndindex(*embeddings.shape):
        shifted = [embeddings.copy(), embeddings.copy()]
        shifted[0][index] += step
        shifted[1][index] -= step
        up, down = (
            _numpy_privacyface_loss(x, kernel, labels, negatives, loss, scale, margin, rho)[0]
            for x in shifted
        )
        numeric[index] = (up - down) / (2 * step)
    np.testing.assert_allclose(gradient, numeric, rtol=2e-3, atol=2e-5)
    clear = np.abs(numeric) > 1e-3
    assert clear.sum() > embeddings.size // 2
    np.testing.assert_array_equal(np.sign(gradient[clear]), np.sign(numeric[clear]))
    # The cap is what changed: ρ = 0 is the plain head-row scoring, s·cos θ, and less loss.
    plain_logits, plain = loss_of(f, 0.0)
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    np.testing.assert_allclose(plain_logits[:, 3:], scale * unit @ units.T, rtol=1e-5, atol=1e-4)
    assert float(plain) < float(value)


def test_softmax_heads_cap_the_negatives_on_their_own_scale():
    """Softmax has no s: a negative scores ‖f‖·L·cos(max(θ − ρ, 0)), L the mean norm of
    the active head rows (the length a plain row had)."""
    rng = np.random.default_rng(3)
    rho = 0.8
    negatives = rng.normal(size=(2, 8))
    units = negatives / np.linalg.norm(negatives, axis=1, keepdims=True)
    embeddings = _at_angles(units[[0, 0, 1]], [0.3, 1.5, 2.9], rng) * [[2.0], [0.5], [4.0]]
    kernel = rng.normal(size=(8, 4))
    logits = identity_heads.head_logits(
        tf.constant(embeddings, tf.float32), tf.constant(kernel, tf.float32),
        tf.constant([0, 1, 2]), client_config.HeadLossConfig(), 3,
        tf.constant(negatives, tf.float32), negative_cap=rho,
    )  # fmt: skip
    lengths = np.linalg.norm(embeddings, axis=1, keepdims=True)
    theta = np.arccos(np.clip(embeddings / lengths @ units.T, -1, 1))
    row_length = np.linalg.norm(kernel[:, :3], axis=0).mean()
    expected = lengths * row_length * np.cos(np.maximum(theta - rho, 0.0))
    np.testing.assert_allclose(logits[:, 4:], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[0, 4], lengths[0, 0] * row_length, rtol=1e-5)


def test_client_loss_takes_the_cap_of_its_config(initial_weights):
    """`ClientConfig.shared_negative_cap` reaches a real client's loss: its first (only)
    batch's loss, before any step, against the numpy formula on the same embeddings."""
    rho, scale, margin = 1.0, 16.0, 0.2
    config = dataclasses.replace(
        CONFIG,
        batch_size=len(IDENTITIES),  # one batch: the measured loss is at the initial weights
        head_init=client_config.HEAD_INIT_CLASS_MEANS,
        head_loss=client_config.HeadLossConfig(client_config.ARCFACE, scale, margin),
        shared_negative_rows=2,
        shared_negative_cap=rho,
    )
    identities = np.array([1, 0, 2, 0, 1, 2])  # integer keys: local label = the integer
    images = _images(6)
    backbone = models.build_backbone(BACKBONE)
    models.assign_backbone_weights(backbone, initial_weights)
    embeddings = backbone(images, training=True).numpy().astype(np.float64)
    unit = backbone(images, training=False).numpy().astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    kernel = np.stack([unit[identities == k].mean(axis=0) for k in range(3)], axis=1)
    # Center 0 along the examples' mean direction (inside its cap), center 1 at random.
    negatives = np.stack([unit.mean(axis=0), np.random.default_rng(2).normal(size=8)])
    _, measurements = client_work.train_one_client(
        BACKBONE,
        config,
        initial_weights,
        _client_dataset(images, identities, config),
        shared_negatives=negatives.astype(np.float32),
    )
    expected, mu = _numpy_privacyface_loss(
        embeddings, kernel, identities, negatives, client_config.ARCFACE, scale, margin, rho
    )
    assert np.any(mu == scale) and np.any(mu < scale)  # both sides of a cap
    plain, _ = _numpy_privacyface_loss(
        embeddings, kernel, identities, negatives, client_config.ARCFACE, scale, margin, 0.0
    )
    assert abs(expected - plain) > 0.05
    np.testing.assert_allclose(measurements["loss"], expected, rtol=1e-4)


def _pass_identities(dataset):
    return [i for batch in dataset for i in batch["identity"].numpy().tolist()]


def _epoch_identities(passes, epochs=1):
    steps = epochs * int(passes.batches_per_epoch)
    return [i for step in range(steps) for i in passes.batch(step)["identity"].numpy().tolist()]


def test_each_pass_shuffles_on_its_own_the_same_orders_for_the_same_client():
    names = np.array([f"id{i}" for i in range(12)])
    config = dataclasses.replace(CONFIG, shuffle_buffer=64, batch_size=5)
    client = _client_dataset(np.zeros((12, 28, 28, 1), np.float32), names, config)
    # The client dataset keeps the loader's order; the passes shuffle it.
    assert _pass_identities(client) == [n.encode() for n in names]
    examples = local_training.read_client(client)
    assert examples.identity.numpy().tolist() == [n.encode() for n in names]
    assert int(examples.client_seed) == int(client_work.client_seed_from_id(tf.constant(CLIENT_ID)))
    assert int(examples.expected_examples) == -1  # no count given to make_client_dataset

    first = _epoch_identities(local_training.ClientPasses(examples, config, 1))
    training = _epoch_identities(local_training.ClientPasses(examples, config, 3), epochs=3)
    # The vocabulary pass and the first epoch see one order; later epochs reshuffle.
    assert first == training[:12] and sorted(first) == sorted(n.encode() for n in names)
    assert first != [n.encode() for n in names]
    assert training[12:24] != first and sorted(training[12:24]) == sorted(first)
    # The orders are tf.data's shuffle of the examples with the client's seed.
    shuffled = (
        tf.data.Dataset.from_tensor_slices(names)
        .shuffle(64, seed=examples.client_seed, reshuffle_each_iteration=True)
        .repeat(3)
    )
    assert training == list(shuffled.as_numpy_iterator())
    # Batches of 5 within an epoch: 5, 5 and the epoch's last 2.
    passes = local_training.ClientPasses(examples, config, 3)
    assert [int(tf.size(passes.batch(step)["identity"])) for step in range(6)] == [5, 5, 2] * 2
    # Another client's seed draws other orders.
    other = _client_dataset(np.zeros((12, 28, 28, 1), np.float32), names, config, "round0/vc1")
    other_examples = local_training.read_client(other)
    assert _epoch_identities(local_training.ClientPasses(other_examples, config, 1)) != first


def test_a_client_without_examples_has_no_seed_and_an_unknown_count():
    empty = _client_dataset(np.zeros((0, 28, 28, 1), np.float32), np.array([], str))
    examples = local_training.read_client(empty)
    assert (int(examples.client_seed), int(examples.expected_examples)) == (0, -1)
    passes = local_training.ClientPasses(examples, CONFIG, 3)
    assert int(passes.batches_per_epoch) == 0 and int(tf.size(passes.order)) == 0


def test_the_class_mean_pass_embeds_every_example_past_its_batch_of_64(initial_weights):
    # 150 examples: three batches of the first pass (64, 64, 22), identities in every one.
    config = dataclasses.replace(
        CONFIG, head_init=client_config.HEAD_INIT_CLASS_MEANS, class_means_norm=2.0
    )
    rng = np.random.default_rng(7)
    images = rng.random((150, 28, 28, 1), dtype=np.float32)
    identities = np.array(["a", "b", "c"])[rng.integers(0, 3, 150)]
    trainer = local_training.LocalTrainer(_backbone_fn, config, None)
    models.assign_backbone_weights(trainer.backbone, initial_weights)
    vocabulary, head = trainer._first_pass(
        local_training.read_client(_client_dataset(images, identities, config))
    )
    keys = identity_heads.identity_keys(tf.constant(identities)).numpy()
    assert vocabulary.numpy().tolist() == sorted(set(keys.tolist()))
    # The same means from one forward pass of all 150 at once, in numpy.
    unit = trainer.backbone(images, training=False).numpy().astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    for row, key in enumerate(vocabulary.numpy()):
        mean = unit[keys == key].mean(axis=0)
        np.testing.assert_allclose(head[:, row], 2.0 * mean / np.linalg.norm(mean), atol=1e-5)
    # Rows past the three identities stay zero.
    assert not np.any(head[:, 3:].numpy())

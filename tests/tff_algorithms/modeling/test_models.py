"""Backbones: GroupNorm only, seeded initialisation, unit-norm embeddings, pretrained loading."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.config import model_config
from tff_algorithms.modeling import models

SMALL = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=16)


def _assert_no_batch_norm(model):
    layers = models.all_layers(model)
    assert not any(isinstance(layer, tf.keras.layers.BatchNormalization) for layer in layers)
    assert not any("batch_norm" in type(layer).__name__.lower() for layer in layers)
    assert any(isinstance(layer, tf.keras.layers.GroupNormalization) for layer in layers)
    # GroupNorm keeps no running statistics.
    assert model.non_trainable_weights == []


def test_small_cnn_embeds_to_unit_norm():
    model = models.build_backbone(SMALL, seed=1)
    _assert_no_batch_norm(model)
    images = tf.random.stateless_uniform([3, 28, 28, 1], seed=[1, 1])
    embeddings = models.embed(model, images)
    assert embeddings.shape == (3, 16)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)


def test_embedding_of_an_image_does_not_depend_on_the_rest_of_the_batch():
    model = models.build_backbone(SMALL, seed=1)
    images = tf.random.stateless_uniform([4, 28, 28, 1], seed=[2, 2])
    alone = model(images[:1], training=True)
    together = model(images, training=True)[:1]
    np.testing.assert_allclose(alone, together, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", [model_config.MOBILENET_V2, model_config.RESNET50])
def test_large_backbones_use_group_norm_and_run_on_one_batch(architecture):
    config = model_config.BackboneConfig(architecture, (32, 32, 3), embedding_size=8)
    model = models.build_backbone(config, seed=0)
    _assert_no_batch_norm(model)
    embeddings = models.embed(model, tf.random.stateless_uniform([2, 32, 32, 3], seed=[3, 3]))
    assert embeddings.shape == (2, 8)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)


def test_initialisation_is_a_function_of_the_seed():
    a, b, c = (models.backbone_weights(models.build_backbone(SMALL, seed=s)) for s in (5, 5, 6))
    assert all(np.array_equal(x, y) for x, y in zip(a.trainable, b.trainable))
    kernels = [i for i, w in enumerate(a.trainable) if w.ndim > 1]
    assert all(not np.array_equal(a.trainable[i], c.trainable[i]) for i in kernels)


def test_initialisation_inside_tff_is_seeded_not_constant(tff_runtime):
    def initial_kernel(seed):
        @tff.tensorflow.computation
        def first_kernel():
            return models.build_backbone(SMALL, seed).trainable_weights[0].read_value()

        return first_kernel()

    eager = models.build_backbone(SMALL, seed=5).trainable_weights[0].numpy()
    np.testing.assert_array_equal(initial_kernel(5), eager)
    assert not np.array_equal(initial_kernel(5), initial_kernel(6))


def test_pretrained_weights_file_round_trip(tmp_path):
    source = models.build_backbone(SMALL, seed=8)
    path = str(tmp_path / "backbone.weights.h5")
    source.save_weights(path)
    loaded = models.load_pretrained_backbone(SMALL, path)
    for x, y in zip(source.trainable_weights, loaded.trainable_weights):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_pretrained_model_of_another_shape_is_rejected(tmp_path):
    other = models.build_backbone(
        model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=4)
    )
    path = str(tmp_path / "other_saved_model")
    other.save(path)
    with pytest.raises(ValueError, match="does not match"):
        models.load_pretrained_backbone(SMALL, path)


def test_backbone_weights_type_matches_the_model():
    weights_type = models.backbone_weights_type(SMALL)
    model = models.build_backbone(SMALL)
    assert [tuple(t.shape) for t in weights_type.trainable] == [
        tuple(w.shape) for w in model.trainable_weights
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(architecture="vgg"),
        dict(embedding_size=0),
        dict(architecture=model_config.RESNET50, image_shape=(28, 28, 3)),
    ],
)
def test_nonsense_backbone_configs_are_rejected(kwargs):
    with pytest.raises(ValueError):
        model_config.BackboneConfig(**kwargs)

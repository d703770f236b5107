"""Backbones (image -> embedding) and the identity head, as separate weight structures.

The backbone θ is a Keras model from float images in [0, 1] of shape
`model_config.BackboneConfig.image_shape` to an (unnormalised) embedding of size
`embedding_size`; `embed` L2-normalises it for inference. Every normalisation
layer is GroupNormalization: BatchNorm mixes examples (and users) inside a batch
and keeps running statistics, both of which break per-user sensitivity.

The head ω (one proxy row per identity, no bias) is never a Keras layer of the
backbone: it is a plain kernel built by `initial_head_kernel`, so no process
that carries backbone weights can carry it by accident.

Randomness is explicit: `build_backbone(config, seed)` seeds every random
initialiser (seeded Keras initialisers are stateless) (unseeded Keras initialisers inside a TFF
computation return the same values on every call, docs/design.md section 1).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.config.model_config import (
    ALL_LAYERS,
    MOBILENET_V2,
    RESNET50,
    SMALL_CNN,
    BackboneConfig,
    is_user_architecture,
)
from tff_algorithms.modeling import user_backbones


def _num_groups(channels: int, max_groups: int) -> int:
    return max(g for g in range(1, min(channels, max_groups) + 1) if channels % g == 0)


class _Seeder:
    """Hands out distinct seeds derived from one seed, one per initialiser."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._count = 0

    def next_seed(self) -> int:
        self._count += 1
        return (self._seed * 1_000_003 + self._count) % (2**31 - 1)

    def seed_layer_config(self, config: dict) -> dict:
        """Gives every seedable initialiser in a layer config its own seed."""
        config = dict(config)
        for key, value in config.items():
            if key.endswith("_initializer") and isinstance(value, dict):
                init_config = dict(value.get("config", {}))
                if "seed" in init_config:
                    init_config["seed"] = self.next_seed()
                    config[key] = {**value, "config": init_config}
        return config

    def glorot(self) -> tf.keras.initializers.Initializer:
        return tf.keras.initializers.GlorotUniform(seed=self.next_seed())


def _group_norm(channels: int, max_groups: int, name: str | None = None) -> tf.keras.layers.Layer:
    return tf.keras.layers.GroupNormalization(
        groups=_num_groups(channels, max_groups), epsilon=1e-3, name=name
    )


def _small_cnn(config: BackboneConfig, seeder: _Seeder) -> tf.keras.Model:
    """LeNet-like: two 5x5 conv blocks, then a dense embedding (paper, EMNIST)."""
    inputs = tf.keras.Input(shape=config.image_shape, name="image")
    x = inputs
    for i, filters in enumerate((32, 64)):
        x = tf.keras.layers.Conv2D(
            filters, 5, padding="same", kernel_initializer=seeder.glorot(), name=f"conv{i}"
        )(x)
        x = _group_norm(filters, config.max_groups, name=f"gn{i}")(x)
        x = tf.keras.layers.ReLU()(x)
        x = tf.keras.layers.MaxPool2D(2)(x)
    x = tf.keras.layers.Flatten()(x)
    outputs = tf.keras.layers.Dense(
        config.embedding_size, kernel_initializer=seeder.glorot(), name="embedding"
    )(x)
    return tf.keras.Model(inputs, outputs, name=SMALL_CNN)


def _clone_layer(
    layer: tf.keras.layers.Layer, config: BackboneConfig, seeder: _Seeder
) -> tf.keras.layers.Layer:
    """Clones with seeded initialisers, and GroupNorm in place of BatchNorm."""
    if isinstance(layer, tf.keras.layers.BatchNormalization):
        return _group_norm(int(layer.gamma.shape[0]), config.max_groups, name=layer.name)
    return layer.__class__.from_config(seeder.seed_layer_config(layer.get_config()))


def _application(config: BackboneConfig, seeder: _Seeder) -> tf.keras.Model:
    """A Keras application trunk with GroupNorm, global pooling and a dense embedding."""
    builders = {
        MOBILENET_V2: tf.keras.applications.MobileNetV2,
        RESNET50: tf.keras.applications.ResNet50,
    }
    # The application is only a template (its own initial values are discarded):
    # it is cloned layer by layer with seeded initialisers and GroupNorm.
    template = builders[config.architecture](
        include_top=False, weights=None, input_shape=config.image_shape, pooling="avg"
    )
    trunk = tf.keras.models.clone_model(
        template, clone_function=lambda layer: _clone_layer(layer, config, seeder)
    )
    inputs = tf.keras.Input(shape=config.image_shape, name="image")
    # Inputs are in [0, 1]; the trunks are designed for roughly zero-centred inputs.
    x = tf.keras.layers.Rescaling(2.0, offset=-1.0)(inputs)
    x = trunk(x)
    outputs = tf.keras.layers.Dense(
        config.embedding_size, kernel_initializer=seeder.glorot(), name="embedding"
    )(x)
    return tf.keras.Model(inputs, outputs, name=config.architecture)


def all_layers(model: tf.keras.Model) -> list[tf.keras.layers.Layer]:
    """Leaf layers of a model, descending into nested models."""
    layers = []
    for layer in model.layers:
        if isinstance(layer, tf.keras.Model):
            layers.extend(all_layers(layer))
        else:
            layers.append(layer)
    return layers


def build_backbone(config: BackboneConfig, seed: int = 0) -> tf.keras.Model:
    """Builds a backbone whose initial values depend only on `seed`.

    Every random initialiser is seeded (Keras seeded initialisers are stateless),
    so the same seed gives the same weights eagerly and inside TFF computations.
    """
    seeder = _Seeder(seed)
    if config.architecture == SMALL_CNN:
        model = _small_cnn(config, seeder)
    elif is_user_architecture(config.architecture):
        model = user_backbones.build(config, seeder, _group_norm)
    else:
        model = _application(config, seeder)
    _freeze_layers(model, config.trainable_layers)
    return model


def check_trainable_layers(config: BackboneConfig) -> None:
    """Unknown layer names, and a user's backbone that cannot be built or cannot train
    privately, are config errors found before anything runs; a config (with its model
    file's or factory's digest) is checked once (building a throwaway ResNet-50 takes
    seconds)."""
    _check_backbone(config, config.source_digest)


@functools.lru_cache(maxsize=32)
def _check_backbone(config: BackboneConfig, digest: str | None) -> None:
    del digest  # part of the cache key only
    if not is_user_architecture(config.architecture):
        with tf.Graph().as_default():
            build_backbone(config)
        return
    # Eagerly: the user's model is loaded once, and checked numerically (`dp_layers`).
    user_backbones.check(build_backbone(config), config)


def layer_names(model: tf.keras.Model) -> list[str]:
    """Names of the leaf layers that hold variables, in model order."""
    return [layer.name for layer in all_layers(model) if layer.weights]


def _freeze_layers(model: tf.keras.Model, trainable_layers: tuple[str, ...]) -> None:
    """Marks the leaf layers no pattern of `trainable_layers` matches as non-trainable."""
    names = layer_names(model)
    for pattern in trainable_layers:
        if not fnmatch.filter(names, pattern):
            raise ValueError(
                f"trainable_layers pattern {pattern!r} matches no layer of {model.name}; "
                f"layers: {', '.join(names)}"
            )
    for layer in all_layers(model):
        layer.trainable = any(fnmatch.fnmatchcase(layer.name, p) for p in trainable_layers)


def ordered_variables(model: tf.keras.Model) -> list[tf.Variable]:
    """The backbone's variables in layer order, whichever layers are frozen.

    Keras lists trainable variables before non-trainable ones, so its order changes
    with `trainable_layers`; files that store variables by position (the serving
    SavedModel's `backbone_variables`) use this order instead. With nothing frozen
    the two orders are the same.
    """
    return [variable for layer in all_layers(model) for variable in layer.weights]


def embed(model: tf.keras.Model, images: tf.Tensor) -> tf.Tensor:
    """Unit-norm embeddings for inference."""
    return tf.math.l2_normalize(model(images, training=False), axis=-1)


def backbone_weights(model: tf.keras.Model) -> tff.learning.models.ModelWeights:
    """The backbone's weights as (trainable, non_trainable) lists of numpy arrays."""
    return tff.learning.models.ModelWeights(
        trainable=[v.numpy() for v in model.trainable_weights],
        non_trainable=[v.numpy() for v in model.non_trainable_weights],
    )


def assign_backbone_weights(
    model: tf.keras.Model, weights: tff.learning.models.ModelWeights
) -> None:
    """Assigns (trainable, non_trainable) weights, e.g. from a TFF state, to a backbone."""
    variables = list(model.trainable_weights) + list(model.non_trainable_weights)
    values = list(weights.trainable) + list(weights.non_trainable)
    if len(variables) != len(values):
        raise ValueError(f"backbone has {len(variables)} variables, got {len(values)} values")
    for variable, value in zip(variables, values):
        variable.assign(value)


def backbone_weights_type(config: BackboneConfig) -> tff.Type:
    """TFF type of `ModelWeights(trainable=[...], non_trainable=[...])` of the backbone."""
    with tf.Graph().as_default():
        model = build_backbone(config)
        specs = tff.learning.models.ModelWeights(
            trainable=[tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_weights],
            non_trainable=[tf.TensorSpec(v.shape, v.dtype) for v in model.non_trainable_weights],
        )
    return tff.types.tensorflow_to_type(specs)


def load_pretrained_backbone(config: BackboneConfig, path: str) -> tf.keras.Model:
    """Builds a backbone and loads pretrained weights from `path`.

    `path` is a Keras weights file (`.h5`, `.weights.h5`), a TF checkpoint prefix,
    a Keras SavedModel directory of a backbone with the same variable shapes, or a
    serving SavedModel written by `tff_algorithms.modeling.export` (which keeps its backbone
    variables in order as `backbone_variables`).
    """
    # Loaded with every layer trainable, so positions mean what they meant when saved.
    model = build_backbone(dataclasses.replace(config, trainable_layers=ALL_LAYERS))
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "saved_model.pb")):
        loaded = tf.saved_model.load(path)
        if hasattr(loaded, "backbone_variables"):
            values = [v.numpy() for v in loaded.backbone_variables]
        else:
            keras_model = tf.keras.models.load_model(path, compile=False)
            values = [
                w.numpy() for w in keras_model.trainable_weights + keras_model.non_trainable_weights
            ]
        variables = ordered_variables(model)
        expected = [tuple(v.shape) for v in variables]
        found = [tuple(np.shape(v)) for v in values]
        if expected != found:
            raise ValueError(
                f"pretrained model at {path} does not match {config}: "
                f"{len(found)} variables {found[:3]}..., expected {len(expected)} {expected[:3]}..."
            )
        for variable, value in zip(variables, values):
            variable.assign(value)
    else:
        model.load_weights(path)
    _freeze_layers(model, config.trainable_layers)
    return model


def initial_head_kernel(seed: tf.Tensor, embedding_size: int, num_rows: int) -> tf.Tensor:
    """A fresh head kernel [embedding_size, num_rows] (Glorot uniform) from a stateless seed.

    `seed` is a shape-[2] integer tensor (a TF stateless seed).
    """
    limit = tf.sqrt(6.0 / float(embedding_size + num_rows))
    return tf.random.stateless_uniform(
        [embedding_size, num_rows], seed=seed, minval=-limit, maxval=limit, dtype=tf.float32
    )

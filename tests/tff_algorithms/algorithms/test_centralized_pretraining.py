"""The pretraining recipe on a Keras application trunk: MobileNetV2 (GroupNorm) must keep
images apart; unclipped its features collapse to one point within 50 steps
(BENCHMARKS.md, "The same arms on MobileNetV2")."""

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import synthetic
from tff_algorithms.algorithms.centralized import training as centralized_training
from tff_algorithms.config import job_config, model_config, recipes
from tff_algorithms.modeling import identity_heads

IDENTITIES = 100
ORACLE_BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)


def _sketches() -> tuple[np.ndarray, np.ndarray]:
    config = synthetic.SyntheticConfig(
        identities=IDENTITIES, images_per_identity=8, image_size=32, seed=1, style=synthetic.SKETCH
    )
    pairs = [
        (synthetic.render_image(config, i, j), i)
        for i in range(IDENTITIES)
        for j in range(config.images_per_identity)
    ]
    images = np.stack([p for p, _ in pairs]).astype(np.float32)[..., None] / 255.0
    return images, np.array([i for _, i in pairs], np.int64)


def _pooled_features(backbone: tf.keras.Model, images: np.ndarray) -> np.ndarray:
    """The trunk's globally pooled features, before the embedding layer."""
    layers = backbone.layers
    rescale = next(layer for layer in layers if isinstance(layer, tf.keras.layers.Rescaling))
    trunk = next(layer for layer in layers if isinstance(layer, tf.keras.Model))
    return trunk(rescale(images), training=False).numpy()


@pytest.mark.slow  # builds MobileNetV2 and takes 50 steps (about a minute on 2 cores)
def test_pretraining_recipe_keeps_mobilenet_v2_features_apart():
    train = {**recipes.DEFAULT, "architecture": model_config.MOBILENET_V2, "image_size": 32}
    config = job_config.TrainJobConfig(**recipes.job_fields(recipes.pretrain_values(train, {})))
    images, identities = _sketches()
    trainer = centralized_training.CentralizedTrainer(
        config.backbone_config,
        identity_heads.identity_keys_vocabulary(list(range(IDENTITIES))),
        learning_rate=config.server_learning_rate,
        batch_size=config.batch_size,
        momentum=config.server_momentum,
        head_loss=config.head_loss_config,
        seed=config.seed,
        gradient_clip_norm=config.gradient_clip_norm,
    )
    examples = tf.data.Dataset.from_tensor_slices({"image": images, "identity": identities})
    for epoch in range(2):  # 25 steps each
        trainer.train_epoch(examples, epoch)
    # The std over images of each pooled feature, averaged: 0.29 fresh, about 0.02 after
    # these steps clipped, 2e-5 unclipped (every image the same features).
    spread = _pooled_features(trainer.backbone, images[::4]).std(axis=0).mean()
    assert spread > 2e-3


def test_centralized_oracle_reduces_its_loss():
    rng = np.random.default_rng(6)
    identities = np.array(["a", "b", "c"] * 8)
    means = {"a": 0.2, "b": 0.5, "c": 0.8}
    images = np.stack(
        [np.clip(rng.normal(means[i], 0.05, (28, 28, 1)), 0, 1) for i in identities]
    ).astype(np.float32)
    examples = tf.data.Dataset.from_tensor_slices({"image": images, "identity": identities})
    trainer = centralized_training.CentralizedTrainer(
        ORACLE_BACKBONE,
        identity_heads.identity_keys_vocabulary(["a", "b", "c"]),
        learning_rate=0.05,
        batch_size=8,
    )
    losses = [trainer.train_epoch(examples, epoch) for epoch in range(4)]
    assert trainer.head.shape == (ORACLE_BACKBONE.embedding_size, 3)
    assert losses[-1] < losses[0]

"""Serving SavedModel: bytes in, unit-norm embeddings out, equal to the TFF state's backbone."""

import io

import numpy as np
import tensorflow as tf
from PIL import Image

from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
from tff_algorithms.config import client_config, model_config
from tff_algorithms.modeling import export, models

BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def test_exported_embeddings_equal_the_tff_state_embeddings(tff_runtime, tmp_path):
    config = client_config.ClientConfig(client_learning_rate=0.05, head_capacity=3, batch_size=4)
    process = processes.build_fedemb_process(
        BACKBONE,
        config,
        aggregators.gaussian_fixed(
            noise_multiplier=0.1, clip_norm=1.0, virtual_clients_per_round=1, noise_seed=2
        ),
        processes.server_sgdm(1.0, 0.9),
        backbone_seed=7,
    )
    rng = np.random.default_rng(0)
    examples = tf.data.Dataset.from_tensor_slices(
        {
            "image": rng.random((4, 28, 28, 1), dtype=np.float32),
            "identity": np.array(["a", "b", "a", "b"]),
        }
    )
    state = process.next(
        process.initialize(), [client_work.make_client_dataset(examples, "vc", config)]
    ).state
    weights = processes.backbone_model_weights(process.get_model_weights(state))

    export_dir = export.export_serving_model(BACKBONE, weights, str(tmp_path / "saved_model"))

    pixels = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    loaded = tf.saved_model.load(export_dir)
    served = loaded.signatures[export.SIGNATURE](images=tf.constant([_png(p) for p in pixels]))[
        export.OUTPUT_KEY
    ]

    reference = models.build_backbone(BACKBONE)
    models.assign_backbone_weights(reference, weights)
    expected = models.embed(reference, pixels[..., np.newaxis].astype(np.float32) / 255.0)
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, rtol=1e-5)

    # Backbone only: every exported variable has a backbone shape, none the head's.
    exported_shapes = sorted(tuple(v.shape) for v in loaded.backbone_variables)
    assert exported_shapes == sorted(
        tuple(w.shape) for w in weights.trainable + weights.non_trainable
    )
    saved_shapes = [
        tuple(shape) for _, shape in tf.train.list_variables(f"{export_dir}/variables/variables")
    ]
    assert (BACKBONE.embedding_size, config.head_capacity) not in saved_shapes

    # The export is also a pretrained backbone for the next training run.
    pretrained = models.load_pretrained_backbone(BACKBONE, export_dir)
    for variable, value in zip(pretrained.trainable_weights, weights.trainable):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_decode_image_resizes_and_scales_jpeg():
    pixels = np.full((40, 30, 3), 200, np.uint8)
    encoded = tf.io.encode_jpeg(pixels)
    image = export.decode_image(encoded, (28, 28, 1))
    assert image.shape == (28, 28, 1)
    np.testing.assert_allclose(image.numpy(), 200 / 255, atol=0.02)

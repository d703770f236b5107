"""Serving SavedModel: encoded image bytes -> unit-norm embeddings, backbone only.

Signature `serving_default`: input `images`, a string tensor [batch] of PNG or JPEG
bytes; output `embedding`, float32 [batch, embedding_size] with unit L2 norm.
Preprocessing (`decode_image`) is inside the model, and is the same function the
training data should be decoded with: decode, convert to float in [0, 1], resize
to the backbone's input size. It decodes every image ingest accepts
(`beam_jobs.schema.validate`), for one or three channels; bytes that are not a
decodable PNG or JPEG make the call fail with `tf.errors.InvalidArgumentError`, the
whole batch, as do images whose headers declare more pixels than the model's bounds
(`bounded_decode`, checked before anything is decoded). Only backbone weights go in;
there is no head.
"""

from __future__ import annotations

import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.config import model_config
from tff_algorithms.modeling import bounded_decode, models

SIGNATURE = "serving_default"
INPUT_KEY = "images"
OUTPUT_KEY = "embedding"
# Passes that repeat over the same images (held-out evaluation, the centralized oracle's
# epochs) keep them decoded in memory (float32) up to this size, else decode every pass.
DECODED_IN_MEMORY_BYTES = 256 * 2**20


def decoded_fit_in_memory(num_images: int, image_shape: tuple[int, int, int]) -> bool:
    """Whether `num_images` decoded float32 images of `image_shape` fit in
    `DECODED_IN_MEMORY_BYTES`."""
    height, width, channels = image_shape
    return num_images * height * width * channels * 4 <= DECODED_IN_MEMORY_BYTES


# Graph-first (explicit conds): AutoGraph would only re-trace it, in every dataset map
# and export that calls it.
@tf.autograph.experimental.do_not_convert
def decode_image(encoded: tf.Tensor, image_shape: tuple[int, int, int]) -> tf.Tensor:
    """PNG/JPEG bytes -> float32 [H, W, C] in [0, 1] at the backbone's input size."""
    height, width, channels = image_shape
    if channels == 1:
        image = tf.cond(
            _is_four_component_jpeg(encoded),
            # libjpeg converts CMYK and YCCK to colour only; grey is its luma.
            lambda: tf.image.rgb_to_grayscale(tf.io.decode_jpeg(encoded, channels=3)),
            lambda: tf.io.decode_image(encoded, channels=1, expand_animations=False),
        )
    else:
        image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    image = tf.image.convert_image_dtype(image, tf.float32)
    image = tf.image.resize(image, [height, width])
    return tf.ensure_shape(image, [height, width, channels])


def _is_four_component_jpeg(encoded: tf.Tensor) -> tf.Tensor:
    """Whether `encoded` is a CMYK or YCCK JPEG (from its header), which TensorFlow's JPEG
    decoder cannot turn into one channel directly."""
    return tf.cond(
        tf.io.is_jpeg(encoded),
        lambda: tf.io.extract_jpeg_shape(encoded)[2] == 4,
        lambda: tf.constant(False),
    )


class _EmbeddingServer(tf.Module):
    def __init__(self, backbone: tf.keras.Model, config: model_config.BackboneConfig) -> None:
        super().__init__()
        self.backbone = backbone
        # By position, for `models.load_pretrained_backbone`.
        self.backbone_variables = models.ordered_variables(backbone)
        self._image_shape = config.image_shape

    @tf.function(
        input_signature=[tf.TensorSpec([None], tf.string, name=INPUT_KEY)], autograph=False
    )
    def serve(self, images: tf.Tensor) -> dict[str, tf.Tensor]:
        images = bounded_decode.check_pixel_bounds(images)
        decoded = tf.map_fn(
            lambda encoded: decode_image(encoded, self._image_shape),
            images,
            fn_output_signature=tf.TensorSpec(self._image_shape, tf.float32),
        )
        return {OUTPUT_KEY: models.embed(self.backbone, decoded)}


def export_serving_model(
    backbone_config: model_config.BackboneConfig,
    backbone_weights: tff.learning.models.ModelWeights,
    export_dir: str,
) -> str:
    """Writes the serving SavedModel of a backbone to `export_dir` and returns it.

    `backbone_weights` is `processes.backbone_model_weights(process.get_model_weights(state))`
    or `models.backbone_weights(keras_backbone)`.
    """
    backbone = models.build_backbone(backbone_config)
    models.assign_backbone_weights(backbone, backbone_weights)
    server = _EmbeddingServer(backbone, backbone_config)
    tf.saved_model.save(server, export_dir, signatures={SIGNATURE: server.serve})
    return export_dir

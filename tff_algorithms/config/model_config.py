"""Which backbone to build: its architecture, input shape, embedding size and the layers
training updates. No TensorFlow at import (`models` builds the backbone)."""

from __future__ import annotations

import dataclasses

SMALL_CNN = "small_cnn"
MOBILENET_V2 = "mobilenet_v2"
RESNET50 = "resnet50"
ARCHITECTURES = (SMALL_CNN, MOBILENET_V2, RESNET50)
# The optimizers a private step loop applies its noised gradient with
# (`tff_algorithms.modeling.optimizers`): momentum SGD, Adam, LAMB.
SGD = "sgd"
ADAM = "adam"
LAMB = "lamb"
OPTIMIZERS = (SGD, ADAM, LAMB)
# `BackboneConfig.trainable_layers` that trains every layer.
ALL_LAYERS = ("*",)


@dataclasses.dataclass(frozen=True)
class BackboneConfig:
    """Which backbone to build.

    Attributes:
      architecture: one of `ARCHITECTURES`.
      image_shape: (height, width, channels) of the float [0, 1] input.
      embedding_size: size of the embedding vector.
      max_groups: GroupNormalization uses the largest divisor of the channel
        count that is at most this.
      trainable_layers: glob patterns (fnmatch) over leaf layer names
        (`layer_names`); the variables of the other layers are frozen: held in
        `ModelWeights.non_trainable`, never fine-tuned, aggregated or noised.
        Private training noises every trainable coordinate, so the noise norm on
        the averaged update grows with the square root of their number: freezing
        is the paper's "parameter freezing" for small populations.
    """

    architecture: str = SMALL_CNN
    image_shape: tuple[int, int, int] = (28, 28, 1)
    embedding_size: int = 128
    max_groups: int = 32
    trainable_layers: tuple[str, ...] = ALL_LAYERS

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        if len(self.image_shape) != 3 or min(self.image_shape) < 1:
            raise ValueError(
                f"image_shape must be (height, width, channels), got {self.image_shape}"
            )
        if self.embedding_size < 1:
            raise ValueError(f"embedding_size must be positive, got {self.embedding_size}")
        if self.architecture != SMALL_CNN and min(self.image_shape[:2]) < 32:
            raise ValueError(
                f"{self.architecture} needs images of at least 32x32, got {self.image_shape}"
            )
        if isinstance(self.trainable_layers, str) or not self.trainable_layers:
            raise ValueError(
                f"trainable_layers must be a non-empty list of layer-name patterns, "
                f"got {self.trainable_layers!r}"
            )
        # Tuples keep the config hashable (JSON gives lists).
        object.__setattr__(self, "image_shape", tuple(self.image_shape))
        object.__setattr__(self, "trainable_layers", tuple(self.trainable_layers))
        if self.trainable_layers != ALL_LAYERS:
            # Unknown layer names are found by building the backbone, which needs
            # TensorFlow: imported here so that reading a config does not import it.
            from tff_algorithms.modeling import models

            models.check_trainable_layers(self)

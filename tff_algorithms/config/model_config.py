"""Which backbone to build: its architecture, input shape, embedding size and the layers
training updates. No TensorFlow at import (`models` builds the backbone)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tff_algorithms.base import validation

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
# The keys a section with an `optimizer` key adds for Adam and LAMB, with their defaults
# (Kingma and Ba's; no weight decay).
ADAM_KEYS = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0}
# What `optimizer` and `ADAM_KEYS` mean (a section's --help lines).
OPTIMIZER_DESCRIBE = {
    "optimizer": "what applies the noised mean gradient: sgd (momentum server_momentum), "
    "adam or lamb",
    "adam_beta1": "Adam's and LAMB's first-moment decay",
    "adam_beta2": "Adam's and LAMB's second-moment decay",
    "adam_epsilon": "the epsilon added to Adam's and LAMB's sqrt of the second moment",
    "weight_decay": "Adam's and LAMB's decay lambda·w in the update",
}
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


def check_optimizer_settings(section: str, settings: Any) -> None:
    """One line naming `<section>.<key>` for a bad `optimizer` or Adam key of a
    section's settings (fields `optimizer` and `ADAM_KEYS`), or for an Adam key set
    while the optimizer is sgd (it would be ignored)."""
    if settings.optimizer not in OPTIMIZERS:
        raise ValueError(
            f"{section}.optimizer must be one of {', '.join(OPTIMIZERS)}, got "
            f"{settings.optimizer!r}"
        )
    for key in ("adam_beta1", "adam_beta2"):
        validation.check_number(f"{section}.{key}", getattr(settings, key), 0, 1, low_open=False)
    validation.check_number(f"{section}.adam_epsilon", settings.adam_epsilon, 0, 1, low_open=True)
    validation.check_number(
        f"{section}.weight_decay", settings.weight_decay, 0, math.inf, low_open=False
    )
    changed = [key for key, default in ADAM_KEYS.items() if getattr(settings, key) != default]
    if settings.optimizer == SGD and changed:
        raise ValueError(
            f"{section}.{changed[0]} applies to the adam and lamb optimizers: set "
            f"{section}.optimizer to adam or lamb, or leave it unset"
        )


def check_optimizer_momentum(section: str, settings: Any, server_momentum: float) -> None:
    """One line when a job's `server_momentum` is set with Adam or LAMB, whose momentum
    is `<section>.adam_beta1` (it would be ignored)."""
    if settings.optimizer != SGD and server_momentum:
        raise ValueError(
            f"server_momentum applies to the sgd optimizer, not to {settings.optimizer} "
            f"(its momentum is {section}.adam_beta1): set server_momentum to 0"
        )

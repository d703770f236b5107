"""Which backbone to build: its architecture, input shape, embedding size and the layers
training updates. No TensorFlow at import (`models` builds the backbone).

An architecture is a built-in name (`ARCHITECTURES`) or one the user brings
(`modeling/user_backbones.py` builds them):

- `keras:<Name>`: a `tf.keras.applications` constructor, without its top and with
  `weights=None`, then the product's pooling and embedding layer;
- `file:<path>`: a saved Keras model (`.keras`, `.h5`, a SavedModel folder) whose output
  is the embedding; its weights are the start;
- `python:<module>:<function>`: a factory `function(image_shape, embedding_size)` that
  returns an uncompiled Keras model (for custom layers), `<module>` a dotted name on the
  Python path or a `.py` file.

A file's bytes or a factory module's source are part of what a job is
(`source_digest`), so a changed model is a new job, never a silent resume.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
from typing import Any

from tff_algorithms.base import validation

SMALL_CNN = "small_cnn"
MOBILENET_V2 = "mobilenet_v2"
RESNET50 = "resnet50"
ARCHITECTURES = (SMALL_CNN, MOBILENET_V2, RESNET50)
# The prefixes of the architectures a user brings (module docstring).
KERAS_PREFIX = "keras:"
FILE_PREFIX = "file:"
PYTHON_PREFIX = "python:"
USER_PREFIXES = (KERAS_PREFIX, FILE_PREFIX, PYTHON_PREFIX)
# What a backbone's BatchNormalization layers become (no example's output may depend on
# another's inside a private step): `freeze` runs them with their stored statistics
# (inference mode; their scale and offset still train), `group_norm` replaces them with
# GroupNormalization. `auto`: freeze for a `file:` model (its statistics are trained),
# group_norm for every backbone built from scratch.
BATCH_NORM_AUTO = "auto"
BATCH_NORM_FREEZE = "freeze"
BATCH_NORM_GROUP_NORM = "group_norm"
BATCH_NORM_MODES = (BATCH_NORM_AUTO, BATCH_NORM_FREEZE, BATCH_NORM_GROUP_NORM)
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


def is_user_architecture(architecture: str) -> bool:
    """Whether `architecture` names a backbone the user brings (module docstring)."""
    return architecture.startswith(USER_PREFIXES)


def check_architecture(architecture: Any) -> None:
    """One line for an architecture that is neither built in nor a well-formed user form."""
    if not isinstance(architecture, str) or not (
        architecture in ARCHITECTURES or is_user_architecture(architecture)
    ):
        raise ValueError(
            f"architecture must be one of {', '.join(ARCHITECTURES)}, keras:<Name>, "
            f"file:<path> or python:<module>:<function>, got {architecture!r}"
        )
    rest = architecture.split(":", 1)[1] if is_user_architecture(architecture) else "x"
    if architecture.startswith(PYTHON_PREFIX):
        module, _, function = rest.rpartition(":")
        if not module or not function.isidentifier():
            raise ValueError(
                f"architecture {architecture!r} must be python:<module>:<function> "
                "(a dotted module on the Python path, or a .py file)"
            )
    elif not rest:
        raise ValueError(f"architecture {architecture!r} names nothing after its prefix")


def resolved_batch_norm(architecture: str, batch_norm: str) -> str:
    """`freeze` or `group_norm`: what `batch_norm` means for `architecture`."""
    if batch_norm != BATCH_NORM_AUTO:
        return batch_norm
    return BATCH_NORM_FREEZE if architecture.startswith(FILE_PREFIX) else BATCH_NORM_GROUP_NORM


def normalisation_text(architecture: str, batch_norm: str) -> str:
    """What the report and the model card say of a backbone's normalisation layers."""
    if not is_user_architecture(architecture):
        return "GroupNormalization (built in; no BatchNormalization)"
    if resolved_batch_norm(architecture, batch_norm) == BATCH_NORM_FREEZE:
        return (
            "BatchNormalization frozen (batch_norm freeze): inference mode with its stored "
            "statistics, its scale and offset trained"
        )
    return "BatchNormalization replaced by GroupNormalization (batch_norm group_norm)"


def python_module_source(module: str) -> str:
    """The source file of a factory's module (a dotted name or a .py path), found without
    importing it."""
    if module.endswith(".py"):
        path = os.path.abspath(module)
    else:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None and spec.origin not in (None, "built-in") else ""
    if not path or not os.path.isfile(path):
        raise ValueError(
            f"architecture python:{module}:...: module {module!r} is not found (run from its "
            "folder, add it to PYTHONPATH, or give the path of its .py file)"
        )
    return path


def source_digest(architecture: str) -> str | None:
    """SHA-256 of what a user's backbone is built from: a `file:` model's bytes (every file
    of a SavedModel folder, with its relative path), a `python:` factory module's source;
    None for built-ins and `keras:` (the locked Keras builds them)."""
    digest = hashlib.sha256()
    if architecture.startswith(FILE_PREFIX):
        path = architecture[len(FILE_PREFIX) :]
        if os.path.isdir(path):
            for folder, dirs, files in os.walk(path):
                dirs.sort()
                for name in sorted(files):
                    full = os.path.join(folder, name)
                    digest.update(os.path.relpath(full, path).encode() + b"\0")
                    digest.update(_file_digest(full) + b"\0")
        elif os.path.isfile(path):
            digest.update(_file_digest(path))
        else:
            raise ValueError(
                f"architecture {architecture}: no such file or folder (give a .keras or .h5 "
                "file or a SavedModel folder)"
            )
        return digest.hexdigest()
    if architecture.startswith(PYTHON_PREFIX):
        module = architecture[len(PYTHON_PREFIX) :].rpartition(":")[0]
        digest.update(_file_digest(python_module_source(module)))
        return digest.hexdigest()
    return None


def _file_digest(path: str) -> bytes:
    stat = os.stat(path)
    return _file_digest_of(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


# Keyed by size and modification time: a job reads its config's backbone many times.
@functools.lru_cache(maxsize=256)
def _file_digest_of(path: str, size: int, mtime_ns: int) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.digest()


@dataclasses.dataclass(frozen=True)
class BackboneConfig:
    """Which backbone to build.

    Attributes:
      architecture: one of `ARCHITECTURES`, or a user's (module docstring).
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
      batch_norm: one of `BATCH_NORM_MODES` (`resolved_batch_norm`); the built-in
        backbones always use GroupNormalization.
    """

    architecture: str = SMALL_CNN
    image_shape: tuple[int, int, int] = (28, 28, 1)
    embedding_size: int = 128
    max_groups: int = 32
    trainable_layers: tuple[str, ...] = ALL_LAYERS
    batch_norm: str = BATCH_NORM_AUTO

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.batch_norm not in BATCH_NORM_MODES:
            raise ValueError(
                f"batch_norm must be one of {', '.join(BATCH_NORM_MODES)}, got {self.batch_norm!r}"
            )
        if len(self.image_shape) != 3 or min(self.image_shape) < 1:
            raise ValueError(
                f"image_shape must be (height, width, channels), got {self.image_shape}"
            )
        if self.embedding_size < 1:
            raise ValueError(f"embedding_size must be positive, got {self.embedding_size}")
        if self.architecture in (MOBILENET_V2, RESNET50) and min(self.image_shape[:2]) < 32:
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
        if self.trainable_layers != ALL_LAYERS or is_user_architecture(self.architecture):
            # Unknown layer names, and a user's model that cannot train privately, are
            # found by building the backbone, which needs TensorFlow: imported here so
            # that reading a config of a built-in does not import it.
            from tff_algorithms.modeling import models

            models.check_trainable_layers(self)

    @property
    def source_digest(self) -> str | None:
        """`source_digest` of the architecture."""
        return source_digest(self.architecture)

    @property
    def resolved_batch_norm(self) -> str:
        return resolved_batch_norm(self.architecture, self.batch_norm)


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

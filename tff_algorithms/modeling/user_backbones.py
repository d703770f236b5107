"""The backbones a user brings: `keras:<Name>`, `file:<path>`, `python:<module>:<function>`
(`model_config`'s module docstring says what each names).

Each is first built (or loaded) once, eagerly, as a template; `build` then clones the
template layer by layer, the way `models` builds the built-in trunks, so a backbone is
the same wherever it is built (eagerly, in a `tf.Graph`, inside a TFF computation):

- every layer is classified by `dp_layers.classify`; BatchNormalization becomes
  `FrozenBatchNormalization` or GroupNormalization (`BackboneConfig.batch_norm`),
  Dropout becomes `SeededDropout`, and a layer that cannot be classified is refused;
- random initialisers get seeds from the job's seed (`models._Seeder`);
- a `file:` model's own weights are its start: each cloned layer's initialisers are
  constants holding them, so a backbone built anywhere starts from the file.

Nothing downloads: `keras:` builds with `weights=None`, and any call to Keras's
`get_file` while a model is made (a factory asking for ImageNet weights) is refused.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from tff_algorithms.config.model_config import (
    BATCH_NORM_FREEZE,
    FILE_PREFIX,
    KERAS_PREFIX,
    PYTHON_PREFIX,
    BackboneConfig,
    python_module_source,
)
from tff_algorithms.modeling import dp_layers

# Which weight of a layer each initialiser argument creates, where the weight's own name
# plus "_initializer" is not the argument's name.
_INITIALIZER_KEYS = {
    "depthwise_kernel": "depthwise_initializer",
    "pointwise_kernel": "pointwise_initializer",
}


class _Template:
    """A user's model as loaded once: the Keras model, and (for `file:`) its weights by
    leaf-layer name."""

    def __init__(self, model: tf.keras.Model, values: dict[str, list[np.ndarray]] | None):
        self.model = model
        self.values = values


class _DownloadRefused(ValueError):
    """A model asked Keras to download something (`_no_downloads`)."""


@contextlib.contextmanager
def _no_downloads(architecture: str) -> Iterator[None]:
    """Refuses Keras's downloads (pretrained weights) while a model is made."""
    from keras.src.utils import data_utils

    original = data_utils.get_file

    def refuse(fname: str | None = None, origin: str | None = None, *args: Any, **kwargs: Any):
        raise _DownloadRefused(
            f"architecture {architecture} would download {origin or fname}: nothing downloads "
            "here; build it with weights=None (a start comes from public pretraining or a "
            "file: model)"
        )

    data_utils.get_file = refuse
    try:
        yield
    finally:
        data_utils.get_file = original


def _keras_template(name: str, config: BackboneConfig) -> tf.keras.Model:
    constructor = getattr(tf.keras.applications, name, None)
    if name.startswith("_") or not callable(constructor) or not name[:1].isupper():
        known = [n for n in dir(tf.keras.applications) if n[:1].isupper()]
        raise ValueError(
            f"architecture keras:{name}: tf.keras.applications has no constructor {name!r} "
            f"(known: {', '.join(known)})"
        )
    kwargs: dict[str, Any] = {"include_top": False, "weights": None, "pooling": "avg"}
    if "include_preprocessing" in inspect.signature(constructor).parameters:
        kwargs["include_preprocessing"] = False  # inputs are rescaled to [-1, 1] here
    try:
        with tf.init_scope(), _no_downloads(f"keras:{name}"):
            inputs = tf.keras.Input(shape=config.image_shape, name="image")
            # keras.applications trunks expect roughly zero-centred inputs. Built on this
            # tensor, the trunk's layers are the template's own (no nested model), so
            # trainable_layers patterns and the feature cache see each of them.
            rescaled = tf.keras.layers.Rescaling(2.0, offset=-1.0, name="rescale")(inputs)
            trunk = constructor(input_tensor=rescaled, input_shape=config.image_shape, **kwargs)
            return tf.keras.Model(inputs, trunk.outputs[0], name=name)
    except _DownloadRefused:
        raise
    except ValueError as error:
        raise ValueError(
            f"architecture keras:{name} cannot take images of {_shape(config.image_shape)} "
            f"(train.image_size, train.channels): {_first_line(error)}"
        ) from None


def _file_template(path: str) -> _Template:
    if not os.path.exists(path):
        raise ValueError(
            f"architecture file:{path}: no such file or folder (give a .keras or .h5 file or "
            "a SavedModel folder)"
        )
    custom = _custom_classes(path)
    if custom:
        raise ValueError(
            f"architecture file:{path} uses custom layer class {custom[0]}: build it with a "
            "python:<module>:<function> factory, and start from the file's weights with "
            "pretrain.source import"
        )
    try:
        with tf.init_scope(), _no_downloads(f"file:{path}"):
            model = tf.keras.models.load_model(
                path, custom_objects=dp_layers.CUSTOM_OBJECTS, compile=False
            )
    except Exception as error:  # noqa: BLE001 - Keras raises anything on a file it cannot read
        raise ValueError(
            f"architecture file:{path} is not a Keras model (.keras, .h5 or a Keras "
            f"SavedModel folder): {type(error).__name__}: {_first_line(error)}"
        ) from None
    if not isinstance(model, tf.keras.Model):
        raise ValueError(
            f"architecture file:{path} is a SavedModel but not a Keras model: save it with "
            "model.save()"
        )
    values = {layer.name: layer.get_weights() for layer in _leaves(model)}
    return _Template(model, values)


def _custom_classes(path: str) -> list[str]:
    """Layer classes a saved model names that Keras does not know (a custom layer needs
    its code, which a file does not hold), read from the file's JSON config."""
    try:
        if zipfile.is_zipfile(path):  # .keras
            with zipfile.ZipFile(path) as archive:
                config = json.loads(archive.read("config.json"))
        elif os.path.isfile(path):  # .h5
            import h5py

            with h5py.File(path, "r") as file:
                text = file.attrs.get("model_config")
            config = json.loads(text.decode() if isinstance(text, bytes) else text)
        else:
            return []
    except (OSError, KeyError, ValueError, TypeError):
        return []  # not a model file: `load_model` says so
    unknown = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            name = node.get("class_name")
            if isinstance(name, str) and isinstance(node.get("config"), dict):
                known = name in _KERAS_MODEL_CLASSES or hasattr(tf.keras.layers, name)
                if not known and name not in dp_layers.CUSTOM_OBJECTS and name not in unknown:
                    unknown.append(name)
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return [name for name in unknown if not _is_keras_object(name)]


_KERAS_MODEL_CLASSES = ("Functional", "Sequential", "Model")


def _is_keras_object(name: str) -> bool:
    """Initialisers, regularisers, constraints and dtype policies are named in a config
    too; only unknown layers matter."""
    for module in (
        tf.keras.initializers,
        tf.keras.regularizers,
        tf.keras.constraints,
        tf.keras.mixed_precision,
        tf.keras.activations,
    ):
        if hasattr(module, name):
            return True
    return name in ("Policy", "DTypePolicy", "TFOpLambda", "SlicingOpLambda", "__tensor__")


def _python_template(spec: str, config: BackboneConfig) -> tf.keras.Model:
    module_name, _, function_name = spec.rpartition(":")
    source = python_module_source(module_name)
    architecture = f"python:{spec}"
    try:
        if module_name.endswith(".py"):
            unique = "dp_fedemb_factory_" + os.path.splitext(os.path.basename(source))[0]
            module_spec = importlib.util.spec_from_file_location(unique, source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # "the user's path": where the job runs
            module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any import failure of user code is one line
        raise ValueError(
            f"architecture {architecture}: importing {module_name} failed: "
            f"{type(error).__name__}: {_first_line(error)}"
        ) from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise ValueError(
            f"architecture {architecture}: {module_name} has no function {function_name}"
        )
    try:
        with tf.init_scope(), _no_downloads(architecture):
            model = factory(config.image_shape, config.embedding_size)
    except _DownloadRefused:
        raise
    except ValueError as error:
        raise ValueError(
            f"architecture {architecture}: the factory raised ValueError: {_first_line(error)}"
        ) from None
    except Exception as error:  # noqa: BLE001 - a user's factory may raise anything
        raise ValueError(
            f"architecture {architecture}: the factory raised {type(error).__name__}: "
            f"{_first_line(error)}"
        ) from None
    if not isinstance(model, tf.keras.Model):
        raise ValueError(
            f"architecture {architecture}: the factory returned {type(model).__name__}, not a "
            "Keras model"
        )
    return model


def _template(config: BackboneConfig) -> _Template:
    """The user's model as loaded or made once (`_template_of`), eagerly: a template
    first asked for while a graph is being built is made in a thread of its own, where
    TensorFlow executes eagerly."""
    if tf.executing_eagerly():
        return _template_of(config, config.source_digest)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_template_of, config, config.source_digest).result()


@functools.lru_cache(maxsize=16)
def _template_of(config: BackboneConfig, digest: str | None) -> _Template:
    """The digest makes an edited file or factory a new template."""
    del digest
    architecture = config.architecture
    if architecture.startswith(KERAS_PREFIX):
        model = _keras_template(architecture[len(KERAS_PREFIX) :], config)
        return _Template(model, None)
    if architecture.startswith(FILE_PREFIX):
        template = _file_template(architecture[len(FILE_PREFIX) :])
    else:
        template = _Template(_python_template(architecture[len(PYTHON_PREFIX) :], config), None)
    _check_signature(template.model, config)
    return template


def _check_signature(model: tf.keras.Model, config: BackboneConfig) -> None:
    """The model's input against the configured images, its output against the embedding."""
    name = config.architecture
    inputs = model.inputs or []
    if len(inputs) != 1:
        raise ValueError(f"architecture {name} takes {len(inputs)} inputs; it must take one image")
    given = tuple(inputs[0].shape[1:])
    if len(given) != 3 or any(
        size is not None and size != want for size, want in zip(given, config.image_shape)
    ):
        raise ValueError(
            f"architecture {name} takes inputs of shape {_shape(given)}, but the images are "
            f"{_shape(config.image_shape)}: set train.image_size and train.channels to the "
            "model's input (height = width)"
        )
    outputs = model.outputs or []
    shape = tuple(outputs[0].shape) if len(outputs) == 1 else ()
    if len(outputs) != 1 or len(shape) != 2:
        raise ValueError(
            f"architecture {name} outputs {[tuple(o.shape) for o in outputs]}: it must output "
            "one embedding per image (rank 2, [batch, size])"
        )
    if shape[1] != config.embedding_size:
        raise ValueError(
            f"architecture {name} outputs {shape[1]}-d embeddings, but train.embedding_size "
            f"is {config.embedding_size}: set it to {shape[1]}"
        )


def _leaves(model: tf.keras.Model) -> list[tf.keras.layers.Layer]:
    leaves = []
    for layer in model.layers:
        leaves.extend(_leaves(layer) if isinstance(layer, tf.keras.Model) else [layer])
    return leaves


def _constant_initializers(
    layer: tf.keras.layers.Layer, values: list[np.ndarray], layer_config: dict
) -> dict:
    """`layer_config` with each weight's initialiser a constant of its value in the file."""
    layer_config = dict(layer_config)
    for weight, value in zip(layer.weights, values):
        short = weight.name.split("/")[-1].split(":")[0]
        key = _INITIALIZER_KEYS.get(short, f"{short}_initializer")
        if key not in layer_config:
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) holds weight {short!r} that "
                "its config cannot restore: build the model with a python: factory and start "
                "from the file's weights with pretrain.source import"
            )
        layer_config[key] = tf.keras.initializers.Constant(value)
    return layer_config


def _clone_layer(
    layer: tf.keras.layers.Layer,
    config: BackboneConfig,
    seeder: Any,
    values: dict[str, list[np.ndarray]] | None,
    group_norm: Callable[[int, int, str], tf.keras.layers.Layer],
) -> tf.keras.layers.Layer:
    if isinstance(layer, tf.keras.Model):
        return tf.keras.models.clone_model(
            layer,
            clone_function=lambda inner: _clone_layer(inner, config, seeder, values, group_norm),
        )
    kind = dp_layers.classify(layer)
    own = values.get(layer.name) if values is not None else None
    layer_config = seeder.seed_layer_config(layer.get_config())
    if kind is dp_layers.Kind.BATCH_NORM and config.resolved_batch_norm != BATCH_NORM_FREEZE:
        channels = int(layer.gamma.shape[0] if layer.gamma is not None else layer.beta.shape[0])
        return group_norm(channels, config.max_groups, layer.name)
    if own and isinstance(layer, tf.keras.layers.Normalization):
        # Its statistics are constants of its config, not initialised weights.
        layer_config.update(mean=own[0], variance=own[1])
    elif own:
        layer_config = _constant_initializers(layer, own, layer_config)
    if kind is dp_layers.Kind.BATCH_NORM:
        return dp_layers.FrozenBatchNormalization.from_config(layer_config)
    if kind is dp_layers.Kind.DROPOUT:
        return dp_layers.SeededDropout(
            layer.rate, _noise_shape(layer), seed=seeder.next_seed(), name=layer.name
        )
    return layer.__class__.from_config(layer_config)


def _noise_shape(layer: tf.keras.layers.Dropout) -> tuple[int | None, ...] | None:
    """Keras's noise shape of a dropout layer; SpatialDropout drops whole channels."""
    spatial = {
        tf.keras.layers.SpatialDropout1D: 1,
        tf.keras.layers.SpatialDropout2D: 2,
        tf.keras.layers.SpatialDropout3D: 3,
    }
    for kind, dims in spatial.items():
        if isinstance(layer, kind):
            return (None, *([1] * dims), None)
    return None if layer.noise_shape is None else tuple(layer.noise_shape)


def build(
    config: BackboneConfig,
    seeder: Any,
    group_norm: Callable[[int, int, str], tf.keras.layers.Layer],
) -> tf.keras.Model:
    """The DP-safe backbone of a user's architecture (module docstring), float images in
    [0, 1] to an unnormalised embedding; `group_norm(channels, max_groups, name)` makes
    the GroupNormalization that replaces a BatchNormalization."""
    template = _template(config)

    def clone(layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer:
        return _clone_layer(layer, config, seeder, template.values, group_norm)

    trunk = tf.keras.models.clone_model(template.model, clone_function=clone)
    if not config.architecture.startswith(KERAS_PREFIX):
        return tf.keras.Model(trunk.inputs, trunk.outputs, name=_model_name(config.architecture))
    embedding = tf.keras.layers.Dense(
        config.embedding_size, kernel_initializer=seeder.glorot(), name="embedding"
    )(trunk.outputs[0])
    return tf.keras.Model(trunk.inputs, embedding, name=_model_name(config.architecture))


def check(model: tf.keras.Model, config: BackboneConfig) -> None:
    """The numerical per-example check of a built user backbone (`dp_layers`)."""
    dp_layers.check_per_example(model, f"architecture {config.architecture}")


def _model_name(architecture: str) -> str:
    tail = architecture.split(":", 1)[1]
    base = os.path.splitext(os.path.basename(tail.rstrip("/").split(":")[-1]))[0]
    return "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "backbone"


def _shape(shape: tuple) -> str:
    return "×".join("?" if size is None else str(size) for size in shape)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__

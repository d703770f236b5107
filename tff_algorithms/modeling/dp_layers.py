"""What makes a Keras layer safe inside a private step, and the layers that replace the
ones that are not.

User-level DP bounds one user's effect on a step through a per-user clip; that bound
holds only when no example's output (and so no example's gradient) depends on another
example in the batch. Every layer of a backbone is classified (`classify`):

- per example: a pure function of one example (convolutions, dense, activations,
  pooling, reshapes, per-example normalisations: LayerNorm, GroupNorm, Keras's
  `Normalization` with its stored statistics);
- batch norm: mixes the batch's statistics in training mode and updates running
  statistics; replaced by `FrozenBatchNormalization` (always inference mode) or by
  GroupNormalization (`model_config.BATCH_NORM_MODES`);
- dropout: draws stateful random numbers; replaced by `SeededDropout`, whose mask is a
  stateless function of the job's seed and the example's own input;
- anything else is refused, naming the layer, unless its class declares
  `dp_fedemb_per_example = True` (the user's statement that its output for an example
  depends on that example only and that it draws no random numbers; checked
  numerically on the built backbone, `check_per_example`).
"""

from __future__ import annotations

import enum

import numpy as np
import tensorflow as tf

# A user's custom layer class sets this attribute to True to state that it is per example.
PER_EXAMPLE_ATTRIBUTE = "dp_fedemb_per_example"


class Kind(enum.Enum):
    PER_EXAMPLE = "per_example"
    BATCH_NORM = "batch_norm"
    DROPOUT = "dropout"


_L = tf.keras.layers
_PER_EXAMPLE_CLASSES = (
    _L.InputLayer,
    _L.Conv1D,
    _L.Conv2D,
    _L.Conv3D,
    _L.Conv2DTranspose,
    _L.DepthwiseConv2D,
    _L.SeparableConv2D,
    _L.Dense,
    _L.Activation,
    _L.ReLU,
    _L.LeakyReLU,
    _L.PReLU,
    _L.ELU,
    _L.Softmax,
    _L.Add,
    _L.Subtract,
    _L.Multiply,
    _L.Average,
    _L.Maximum,
    _L.Minimum,
    _L.Concatenate,
    _L.ZeroPadding2D,
    _L.Cropping2D,
    _L.UpSampling2D,
    _L.MaxPooling2D,
    _L.AveragePooling2D,
    _L.GlobalAveragePooling2D,
    _L.GlobalMaxPooling2D,
    _L.Flatten,
    _L.Reshape,
    _L.Permute,
    _L.Rescaling,
    _L.Resizing,
    _L.CenterCrop,
    _L.Normalization,
    _L.LayerNormalization,
    _L.GroupNormalization,
    _L.UnitNormalization,
    _L.Identity,
)
_DROPOUT_CLASSES = (_L.Dropout,)  # SpatialDropout1D/2D/3D are subclasses
# Element-wise TensorFlow ops Keras wraps as TFOpLambda layers in functional models (x + 3,
# x * (1 / 6) in MobileNetV3's hard sigmoid): per example whatever their operands' shapes.
_ELEMENTWISE_OPS = frozenset(
    {
        "__operators__.add",
        "math.add",
        "math.subtract",
        "math.multiply",
        "math.truediv",
        "math.divide",
        "math.negative",
        "math.square",
        "math.sqrt",
        "math.maximum",
        "math.minimum",
        "math.sigmoid",
        "math.tanh",
        "nn.relu",
        "nn.relu6",
        "nn.silu",
        "nn.swish",
        "nn.gelu",
    }
)


def classify(layer: tf.keras.layers.Layer) -> Kind:
    """The layer's `Kind`; raises ValueError naming a layer that cannot be classified."""
    if getattr(type(layer), PER_EXAMPLE_ATTRIBUTE, False) is True:
        return Kind.PER_EXAMPLE
    if isinstance(layer, _L.BatchNormalization):
        axis = layer.axis if isinstance(layer.axis, int) else tuple(layer.axis)
        if axis not in (-1, 3, [3], (3,), [-1], (-1,)):
            raise ValueError(
                f"layer {layer.name!r} (BatchNormalization) normalises axis {layer.axis}, "
                "not the channels of a channels-last image: build the model channels-last"
            )
        return Kind.BATCH_NORM
    if isinstance(layer, _DROPOUT_CLASSES):
        return Kind.DROPOUT
    if type(layer).__name__ == "TFOpLambda":
        symbol = getattr(layer, "symbol", "?")
        if symbol in _ELEMENTWISE_OPS:
            return Kind.PER_EXAMPLE
        raise ValueError(
            f"layer {layer.name!r} applies tf.{symbol}, which may mix the examples of a "
            "batch: use a Keras layer, or a custom layer class that sets "
            f"{PER_EXAMPLE_ATTRIBUTE} = True, in a python: factory"
        )
    if isinstance(layer, _PER_EXAMPLE_CLASSES) and type(layer).__name__ != "Lambda":
        return Kind.PER_EXAMPLE
    raise ValueError(
        f"layer {layer.name!r} ({type(layer).__name__}) cannot be shown to treat each example "
        "on its own: remove it, or build it in a python: factory with a layer class that "
        f"sets {PER_EXAMPLE_ATTRIBUTE} = True when its output for an example depends on that "
        "example only and it draws no random numbers"
    )


class FrozenBatchNormalization(tf.keras.layers.BatchNormalization):
    """BatchNormalization that always normalises with its stored statistics: a per-channel
    affine map of each example, whatever `training` says; the statistics never update."""

    def call(self, inputs: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        del training
        return super().call(inputs, training=False)


class SeededDropout(tf.keras.layers.Layer):
    """Dropout whose mask is a stateless function of (`seed`, the example's own input).

    Keras's Dropout draws from a stateful generator, which a TFF computation replays
    identically on every call and which makes runs irreproducible. Here each example's
    mask comes from `tf.random.stateless_uniform` seeded by the layer's seed (from the
    job's public seed) and a fingerprint of that example's input alone, so it never
    depends on the batch around it. `noise_shape` is Keras's (None for the batch axis).
    """

    def __init__(
        self,
        rate: float,
        noise_shape: tuple[int | None, ...] | None = None,
        seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.rate = float(rate)
        self.noise_shape = None if noise_shape is None else tuple(noise_shape)
        self.seed = int(seed)

    def get_config(self) -> dict:
        return {
            **super().get_config(),
            "rate": self.rate,
            "noise_shape": self.noise_shape,
            "seed": self.seed,
        }

    def call(self, inputs: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        if not self.rate:
            return inputs
        return tf.__internal__.smart_cond.smart_cond(
            training if training is not None else False,
            lambda: self._dropped(inputs),
            lambda: tf.identity(inputs),
        )

    def _mask_shape(self, inputs: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(inputs)[1:]
        if self.noise_shape is None:
            return shape
        return tf.stack(
            [shape[i] if size is None else size for i, size in enumerate(self.noise_shape[1:])]
        )

    def _dropped(self, inputs: tf.Tensor) -> tf.Tensor:
        mask_shape = self._mask_shape(inputs)
        flat = tf.reshape(tf.cast(inputs, tf.float32), [tf.shape(inputs)[0], -1])
        # The example's fingerprint: its values' bits, weighted by position (int64 wraps).
        bits = tf.cast(tf.bitcast(flat, tf.int32), tf.int64)
        weights = tf.range(tf.shape(flat, out_type=tf.int64)[1]) * 2 + 1
        fingerprints = tf.reduce_sum(bits * weights, axis=1)

        def one(fingerprint: tf.Tensor) -> tf.Tensor:
            seed = tf.stack([tf.constant(self.seed, tf.int64), fingerprint])
            return tf.random.stateless_uniform(mask_shape, seed=seed)

        noise = tf.map_fn(one, fingerprints, fn_output_signature=tf.float32)
        keep = tf.cast(noise >= self.rate, inputs.dtype)
        return inputs * keep / (1.0 - self.rate)


CUSTOM_OBJECTS = {
    "FrozenBatchNormalization": FrozenBatchNormalization,
    "SeededDropout": SeededDropout,
}


def check_per_example(model: tf.keras.Model, name: str) -> None:
    """Raises ValueError when, in training mode, one example's output changes with the
    examples beside it in the batch: the numerical check of every classification (and of
    every user's statement), on two batches that share their first example."""
    shape = [int(d) for d in model.input_shape[1:]]
    first = tf.random.stateless_uniform([1, *shape], seed=[7, 0])
    outputs = []
    for companions in (1, 2):
        others = tf.random.stateless_uniform([2, *shape], seed=[7, companions])
        outputs.append(model(tf.concat([first, others], axis=0), training=True)[0].numpy())
    scale = max(float(np.max(np.abs(outputs[0]))), 1.0)
    if not np.allclose(outputs[0], outputs[1], rtol=0, atol=1e-4 * scale):
        raise ValueError(
            f"{name}: one example's embedding changes with the other examples of its batch "
            "(a layer mixes the batch in training mode); it cannot train privately"
        )

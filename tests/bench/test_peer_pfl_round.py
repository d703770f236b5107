"""The peer benchmark's mapping of our small CNN into PyTorch's layout
(`bench/peer_pfl_round.py`, `torch_layout`), checked without PyTorch: each layer with
weights, written here in float64 NumPy with PyTorch's semantics (NCHW, OIHW kernels,
GroupNorm over channel groups and space, flatten in C, H, W order, `x @ W.T + b`) on
the exported arrays and on Keras' own float32 input to that layer, must give Keras'
float32 output of the layer within a bound derived from float32 rounding (`_Bounded`:
gamma_n times the sum of the terms' magnitudes). A wrong transpose or flatten order
moves most outputs past their bounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import peer_pfl_round

# float32's unit roundoff.
UNIT = 2.0**-24


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term float sum of
    products (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1)."""
    return n * UNIT / (1 - n * UNIT)


class _Bounded:
    """Values (float64, NCHW) and a bound on how far a float32 evaluation of the same
    network may be from them, element by element."""

    def __init__(self, value: np.ndarray, error: np.ndarray) -> None:
        self.value, self.error = value, error

    def conv_same(self, weight: np.ndarray, bias: np.ndarray) -> _Bounded:
        """Stride-1 'same' convolution, OIHW weight, odd square kernel."""
        k = weight.shape[-1]
        pad = k // 2
        n, c, h, w = self.value.shape
        padded = np.pad(self.value, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        padded_error = np.pad(self.error, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
        out = np.zeros((n, weight.shape[0], h, w))
        magnitude = np.zeros_like(out)
        carried = np.zeros_like(out)
        for dy in range(k):
            for dx in range(k):
                window = padded[:, :, dy : dy + h, dx : dx + w]
                window_error = padded_error[:, :, dy : dy + h, dx : dx + w]
                tap = weight[:, :, dy, dx]
                out += np.einsum("nchw,oc->nohw", window, tap)
                magnitude += np.einsum("nchw,oc->nohw", np.abs(window), np.abs(tap))
                carried += np.einsum("nchw,oc->nohw", window_error, np.abs(tap))
        terms = c * k * k + 1
        out += bias[None, :, None, None]
        magnitude += np.abs(bias)[None, :, None, None]
        return _Bounded(out, carried + _gamma(terms) * (magnitude + carried))

    def group_norm(self, groups: int, epsilon: float, gamma: np.ndarray, beta: np.ndarray):  # noqa: ANN201
        n, c, h, w = self.value.shape
        x = self.value.reshape(n, groups, -1)
        e = self.error.reshape(n, groups, -1)
        size = x.shape[-1]
        centred = x - x.mean(-1, keepdims=True)
        scale = np.sqrt((centred**2).mean(-1, keepdims=True) + epsilon)
        # First order in the input's error: the mean moves by at most mean(e), each
        # centred value by e + mean(e), the variance by 2 mean(|x - mu| (e + mean e)).
        centred_error = e + e.mean(-1, keepdims=True)
        variance_error = 2 * (np.abs(centred) * centred_error).mean(-1, keepdims=True)
        normalised = centred / scale
        normalised_error = centred_error / scale + np.abs(centred) * variance_error / (2 * scale**3)
        # Its own float32 arithmetic: the two means (size terms each) and a few
        # elementwise operations.
        normalised_error += (2 * _gamma(size) + 8 * UNIT) * (
            np.abs(normalised) + np.abs(x).mean(-1, keepdims=True) / scale
        )
        shape = (1, c, 1, 1)
        g, b = gamma.reshape(shape), beta.reshape(shape)
        out = normalised.reshape(n, c, h, w) * g + b
        error = normalised_error.reshape(n, c, h, w) * np.abs(g) + 2 * UNIT * (
            np.abs(out) + np.abs(b)
        )
        return _Bounded(out, error)

    def relu(self) -> _Bounded:
        return _Bounded(np.maximum(self.value, 0), self.error)

    def max_pool(self) -> _Bounded:
        n, c, h, w = self.value.shape
        blocks = self.value[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2)
        errors = self.error[:, :, : h // 2 * 2, : w // 2 * 2].reshape(n, c, h // 2, 2, w // 2, 2)
        return _Bounded(blocks.max((3, 5)), errors.max((3, 5)))

    def flatten(self) -> _Bounded:
        return _Bounded(
            self.value.reshape(len(self.value), -1), self.error.reshape(len(self.value), -1)
        )

    def linear(self, weight: np.ndarray, bias: np.ndarray) -> _Bounded:
        out = self.value @ weight.T + bias
        magnitude = np.abs(self.value) @ np.abs(weight).T + np.abs(bias)
        carried = self.error @ np.abs(weight).T
        terms = weight.shape[1] + 1
        return _Bounded(out, carried + _gamma(terms) * (magnitude + carried))


def _layer_by_layer(params: dict, inputs: dict, groups, epsilon) -> dict:  # noqa: ANN001
    """Each parametrised layer in PyTorch's layout, in float64, on Keras' own float32 input
    to that layer (NHWC -> NCHW), so each bound covers that layer's rounding alone."""
    p = {k: v.astype(np.float64) for k, v in params.items()}

    def nchw(name: str) -> _Bounded:
        value = inputs[name].astype(np.float64).transpose(0, 3, 1, 2)
        return _Bounded(value, np.zeros(value.shape))

    out = {}
    for i in range(2):
        out[f"conv{i}"] = nchw(f"conv{i}").conv_same(p[f"conv{i}.weight"], p[f"conv{i}.bias"])
        out[f"gn{i}"] = nchw(f"gn{i}").group_norm(
            groups[i], epsilon, p[f"gn{i}.weight"], p[f"gn{i}.bias"]
        )
    # The pooled map before Keras' Flatten, flattened in PyTorch's (C, H, W) order.
    out["embedding"] = nchw("flatten").flatten().linear(p["embedding.weight"], p["embedding.bias"])
    return out


def _keras_layers(backbone, images: np.ndarray) -> tuple[dict, dict]:  # noqa: ANN001
    """(input, output) of every layer of the small CNN on `images`, float32 NHWC."""
    import tensorflow as tf

    layers = backbone.layers[1:]
    probe = tf.keras.Model(backbone.inputs, [layer.output for layer in layers])
    outputs = [o.numpy() for o in probe(tf.constant(images), training=False)]
    inputs = [images, *outputs[:-1]]
    names = [
        layer.name.split("_")[0] if layer.name.startswith("flatten") else layer.name
        for layer in layers
    ]
    return dict(zip(names, inputs)), dict(zip(names, outputs))


@pytest.mark.parametrize("groups", [32, 4])
def test_torch_layout_of_the_small_cnn_gives_keras_outputs(groups):
    from tff_algorithms.config import model_config
    from tff_algorithms.modeling import models

    config = model_config.BackboneConfig(
        architecture=model_config.SMALL_CNN,
        embedding_size=16,
        image_shape=(12, 12, 3),
        max_groups=groups,
    )
    backbone = models.build_backbone(config, seed=3)
    # GroupNorm's gamma and beta start at 1 and 0: give them values, so a swapped or
    # misplaced one shows.
    rng = np.random.default_rng(0)
    for layer in backbone.layers:
        if layer.name.startswith("gn"):
            for variable in layer.weights:
                variable.assign(rng.uniform(0.5, 1.5, variable.shape).astype(np.float32))
    images = rng.uniform(0, 1, (5, 12, 12, 3)).astype(np.float32)
    inputs, outputs = _keras_layers(backbone, images)

    params = peer_pfl_round.backbone_in_torch_layout(backbone)
    assert set(params) == {
        f"{name}.{part}"
        for name in ("conv0", "gn0", "conv1", "gn1", "embedding")
        for part in ("weight", "bias")
    }
    assert params["conv1.weight"].shape == (64, 32, 5, 5)
    assert params["embedding.weight"].shape == (16, 64 * 3 * 3)
    gn = [layer for layer in backbone.layers if layer.name.startswith("gn")]
    groups_of = [layer.groups for layer in gn]
    ours = _layer_by_layer(params, inputs, groups_of, gn[0].epsilon)
    assert set(ours) == {"conv0", "gn0", "conv1", "gn1", "embedding"}
    for name, bounded in ours.items():
        keras = outputs[name].astype(np.float64)
        if keras.ndim == 4:
            keras = keras.transpose(0, 3, 1, 2)
        difference = np.abs(bounded.value - keras)
        assert (difference <= bounded.error).all(), (name, difference.max(), bounded.error.min())

    # The bounds are tight enough to see a layout mistake: flattening in Keras' order
    # (H, W, C), or a conv kernel transposed in space, moves outputs past them.
    for name, mistake in (
        (
            "embedding",
            params["embedding.weight"].reshape(16, 64, 3, 3).transpose(0, 2, 3, 1).reshape(16, -1),
        ),
        ("conv1", params["conv1.weight"].transpose(0, 1, 3, 2)),
    ):
        wrong = {**params, f"{name}.weight": mistake}
        moved = _layer_by_layer(wrong, inputs, groups_of, gn[0].epsilon)[name]
        keras = outputs[name].astype(np.float64)
        keras = keras.transpose(0, 3, 1, 2) if keras.ndim == 4 else keras
        assert (np.abs(moved.value - keras) > moved.error).mean() > 0.5, name


def test_torch_layout_refuses_a_variable_it_does_not_know():
    with pytest.raises(ValueError, match="no PyTorch parameter for Keras variable dense/moving"):
        peer_pfl_round.torch_layout(["dense/moving_mean:0"], [np.zeros(3)], (1, 1, 1))

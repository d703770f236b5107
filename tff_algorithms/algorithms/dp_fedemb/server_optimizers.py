"""The server optimizers DP-FedEmb and DP-FedAvg apply the noised aggregate with
(issue 42): momentum SGD, Adam and LAMB (`TrainJobConfig.server_optimizer`).

The aggregator releases one clipped, noised mean update a round; what the server does
with it is post-processing, so the choice leaves the accounting unchanged (the seed
paper dp-transfer-learning-image-classification, appendix A, Algorithm 1: the noised
gradient is the optimizer's input; here the round's aggregated update plays the
gradient, as in `tff.learning.templates.build_apply_optimizer_finalizer`).

`ServerAdamLamb` is the TFF counterpart of the step loops' Keras
`tff_algorithms.modeling.optimizers.AdamLamb`, with the same rule per weight tensor
(module docstring there): bias-corrected moments m̂, v̂, r = m̂ / (√v̂ + ε), Adam
steps by lr·r, LAMB by lr·(‖w‖ / ‖r‖)·r (ratio 1 when either norm is 0). ε is added
after bias correction, as the step loops do; `tff.learning.optimizers.build_adam`
adds it to the uncorrected √v instead (its learning rate carries the correction), a
different step wherever √v̂ is not far above ε, so it is not used. No weight decay:
the server step applies the released update only.
"""

from __future__ import annotations

import collections
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.config.model_config import ADAM_KEYS

_STEP = "step"
_FIRST_MOMENTS = "first_moments"
_SECOND_MOMENTS = "second_moments"
_HPARAMS = ("learning_rate", "beta_1", "beta_2", "epsilon")


class ServerAdamLamb(tff.learning.optimizers.Optimizer):
    """Adam, or LAMB with `layerwise=True` (module docstring), as a TFF optimizer: its
    state holds the hyperparameters, the step count and both moments of every weight."""

    def __init__(
        self,
        learning_rate: float,
        *,
        beta1: float = ADAM_KEYS["adam_beta1"],
        beta2: float = ADAM_KEYS["adam_beta2"],
        epsilon: float = ADAM_KEYS["adam_epsilon"],
        layerwise: bool = False,
    ) -> None:
        self._hparams = dict(
            learning_rate=float(learning_rate),
            beta_1=float(beta1),
            beta_2=float(beta2),
            epsilon=float(epsilon),
        )
        self.layerwise = bool(layerwise)

    def initialize(self, specs: Any) -> collections.OrderedDict:
        def zeros() -> Any:
            return tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), specs)

        return collections.OrderedDict(
            **self._hparams, **{_STEP: 0, _FIRST_MOMENTS: zeros(), _SECOND_MOMENTS: zeros()}
        )

    def next(
        self, state: collections.OrderedDict, weights: Any, gradients: Any
    ) -> tuple[collections.OrderedDict, Any]:
        gradients = tff.learning.optimizers.handle_indexed_slices_gradients(gradients)
        tff.learning.optimizers.check_weights_gradients_match(weights, gradients)
        step = state[_STEP] + 1
        lr, beta1, beta2, epsilon = (state[name] for name in _HPARAMS)

        def update(w: tf.Tensor, m: tf.Tensor, v: tf.Tensor, g: tf.Tensor) -> tuple:
            dtype = w.dtype
            b1, b2, t = tf.cast(beta1, dtype), tf.cast(beta2, dtype), tf.cast(step, dtype)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * tf.square(g)
            m_hat = m / (1 - tf.pow(b1, t))
            v_hat = v / (1 - tf.pow(b2, t))
            r = m_hat / (tf.sqrt(v_hat) + tf.cast(epsilon, dtype))
            if self.layerwise:
                weight_norm, update_norm = tf.norm(w), tf.norm(r)
                r *= tf.where(
                    (weight_norm > 0) & (update_norm > 0),
                    weight_norm / tf.maximum(update_norm, 1e-30),
                    tf.ones([], dtype),
                )
            return w - tf.cast(lr, dtype) * r, m, v

        leaves = zip(
            *(
                tf.nest.flatten(structure)
                for structure in (weights, state[_FIRST_MOMENTS], state[_SECOND_MOMENTS], gradients)
            )
        )
        updated = [update(*leaf) for leaf in leaves]
        new_weights, first, second = (
            tf.nest.pack_sequence_as(weights, [leaf[i] for leaf in updated]) for i in range(3)
        )
        new_state = collections.OrderedDict(
            **{name: state[name] for name in _HPARAMS},
            **{_STEP: step, _FIRST_MOMENTS: first, _SECOND_MOMENTS: second},
        )
        return new_state, new_weights

    def get_hparams(self, state: collections.OrderedDict) -> collections.OrderedDict:
        return collections.OrderedDict((name, state[name]) for name in _HPARAMS)

    def set_hparams(
        self, state: collections.OrderedDict, hparams: collections.OrderedDict
    ) -> collections.OrderedDict:
        return collections.OrderedDict({**state, **hparams})

"""The first-order optimizers the private step loops apply their noised gradient with
(issue 42): momentum SGD, Adam and LAMB.

A private step releases one noised, clipped, averaged gradient; what an optimizer does
with it is post-processing, so the choice leaves the accounting unchanged (the
generalised DP-SGD of the seed paper dp-transfer-learning-image-classification,
appendix A, Algorithm 1: the noised gradient is the optimizer's input).

`AdamLamb` is Adam (Kingma and Ba 2014) and, with `layerwise=True`, LAMB (You et al.
2019), written once because the installed Keras (2.14) has no LAMB. Per variable w with
gradient g at step t (1-based):

    m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
    m̂ = m / (1 − β1^t)             v̂ = v / (1 − β2^t)
    r = m̂ / (√v̂ + ε) + λ·w
    Adam: w ← w − lr·r             (λ > 0 is AdamW's decoupled decay)
    LAMB: w ← w − lr·(‖w‖ / ‖r‖)·r, the trust ratio taken as 1 when ‖w‖ or ‖r‖ is 0

with φ the identity (the paper's φ(z) = z). ε is added to √v̂ after bias correction,
as the textbook and optax (the paper's library) do, not to the uncorrected √v as
Keras's Adam does: then at the first step from zero moments both reduce to
lr·g/(|g| + ε) for a variable that starts at zero, which is the paper's remark that
DP-Adam and DP-LAMB coincide there (appendix D.3; for a variable that does not start at
zero, such as a bias at −10, LAMB scales its step by ‖w‖/‖r‖).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tff_algorithms.config.model_config import ADAM, LAMB, OPTIMIZERS, SGD

__all__ = ["ADAM", "LAMB", "OPTIMIZERS", "SGD", "AdamLamb", "build_optimizer", "from_settings"]


class AdamLamb(tf.keras.optimizers.Optimizer):
    """Adam, or LAMB with `layerwise=True` (module docstring); `weight_decay` is λ in r
    (before LAMB's trust ratio), not Keras's own weight decay, which is left off."""

    def __init__(
        self,
        learning_rate: float,
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        weight_decay: float = 0.0,
        layerwise: bool = False,
        name: str = "AdamLamb",
    ) -> None:
        super().__init__(name=name, jit_compile=False)
        self._learning_rate = self._build_learning_rate(learning_rate)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.epsilon = float(epsilon)
        self.lamb_weight_decay = float(weight_decay)
        self.layerwise = bool(layerwise)

    def build(self, var_list: Sequence[tf.Variable]) -> None:
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self._built = True
        self._first_moments = [self.add_variable_from_reference(v, "m") for v in var_list]
        self._second_moments = [self.add_variable_from_reference(v, "v") for v in var_list]

    def update_step(self, gradient: tf.Tensor, variable: tf.Variable) -> None:
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        index = self._index_dict[self._var_key(variable)]
        m, v = self._first_moments[index], self._second_moments[index]
        gradient = tf.convert_to_tensor(gradient, dtype)
        m.assign(self.beta1 * m + (1 - self.beta1) * gradient)
        v.assign(self.beta2 * v + (1 - self.beta2) * tf.square(gradient))
        m_hat = m / (1 - tf.pow(tf.constant(self.beta1, dtype), step))
        v_hat = v / (1 - tf.pow(tf.constant(self.beta2, dtype), step))
        update = m_hat / (tf.sqrt(v_hat) + self.epsilon) + self.lamb_weight_decay * variable
        if self.layerwise:
            weight_norm, update_norm = tf.norm(variable), tf.norm(update)
            ratio = tf.where(
                (weight_norm > 0) & (update_norm > 0),
                weight_norm / tf.maximum(update_norm, 1e-30),
                tf.ones([], dtype),
            )
            update = ratio * update
        variable.assign_sub(tf.cast(self.learning_rate, dtype) * update)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(
            learning_rate=self._serialize_hyperparameter(self._learning_rate),
            beta1=self.beta1,
            beta2=self.beta2,
            epsilon=self.epsilon,
            weight_decay=self.lamb_weight_decay,
            layerwise=self.layerwise,
        )
        return config


def build_optimizer(
    name: str,
    learning_rate: float,
    *,
    momentum: float = 0.0,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    weight_decay: float = 0.0,
) -> tf.keras.optimizers.Optimizer:
    """The optimizer `name` (`OPTIMIZERS`): momentum SGD (`momentum`), Adam or LAMB
    (`beta1`, `beta2`, `epsilon`, λ `weight_decay`)."""
    if name == SGD:
        return tf.keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum)
    if name not in (ADAM, LAMB):
        raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")
    return AdamLamb(
        learning_rate,
        beta1=beta1,
        beta2=beta2,
        epsilon=epsilon,
        weight_decay=weight_decay,
        layerwise=name == LAMB,
    )


def from_settings(
    settings: Any, learning_rate: float, momentum: float
) -> tf.keras.optimizers.Optimizer:
    """`build_optimizer` from a section's settings (`optimizer` and the Adam keys,
    `tff_algorithms.config.model_config.ADAM_KEYS`)."""
    return build_optimizer(
        settings.optimizer,
        learning_rate,
        momentum=momentum,
        beta1=settings.adam_beta1,
        beta2=settings.adam_beta2,
        epsilon=settings.adam_epsilon,
        weight_decay=settings.weight_decay,
    )

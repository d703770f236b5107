"""FDML (seed paper federated-deep-metric-learning-robust): a server-side triplet loss,
derivatives sent back, and a strict user-level privacy claim (issue 27, items 1-2).

A round (the paper's Fig. 2 and Alg. 3), two federated computations with the trusted
server's step between them:

1. `embed` (federated): the server broadcasts the backbone; each participant embeds its
   first `samples_per_user` examples, in dataset order, and uploads the embeddings, their
   identity keys and how many rows are real (fewer examples: padded rows).
2. The server (the paper's enclave; this Python orchestrator and `server_step`) places the
   first `users_per_round` participants that uploaded (Case A failures upload nothing;
   over-selection passes more participants than that) into a masked buffer, one slot each,
   drops embeddings at rate r (Alg. 2, line 1), computes the triplet loss and Alg. 1's
   derivatives (`triplet`), clips each derivative row and adds Gaussian noise
   (`privatize_derivatives`). Fewer than `users_per_round` uploads: the round restarts
   (Alg. 3, line 5) and nothing is released.
3. `backprop` (federated): each participant receives only its own rows, replays exactly
   the same forward pass (the same examples, in the same order, with the same broadcast
   weights) and backpropagates them, g_v = J_v^T D~_v. Its gradient is clipped to L2 norm
   `gradient_clip`; the server sums, adds Gaussian noise, divides by the planned number of
   participants and applies Adam. That is Eq. 2 when every participant holds s rows
   (|d_i| / |D| = 1/n). With fewer rows Eq. 2 would down-weight a participant's gradient,
   which is no longer the chain rule: the sum of the participants' gradients is exactly
   the gradient of the round's loss, so it is kept, and the denominator stays the planned
   n (fixed: a missing gradient does not change the noise scale).

Case B (a participant in the buffer does not deliver its gradient) is counted apart from
Case A. Strategy UC aggregates the first ceil(rate_p * users_per_round) gradients that
arrive (Alg. 3, lines 9-12; all that arrive if fewer). Strategy AS abandons the round when
any Case B failure happens: the model does not change, but the derivatives were released,
so the accountant charges the round's derivative release (`fdml_privacy`). Which
participants fail and the arrival order are the simulation's, passed to `next` (or drawn
from a seed by `fdml_run.draw_failures`), and independent of the users' data, as the
accounting assumes (`dropouts` states the same assumption for DP-FedEmb).

Threat model, sensitivities and accounting: `fdml_privacy`. The driver loop (`run_fdml`:
rounds sampled as the accountant assumes, restarts, every release charged) is `fdml_run`;
this module builds the process. The server's loss and triplet counts are computed on
training users without privacy: monitoring only, never released.

Client data: a sequence of per-example `{"image": float32[H, W, C], "identity": int64 or
string}`; it must yield the same elements in the same order each time it is iterated (no
unseeded shuffle), since the replay of step 3 iterates it again.

Several workers (`runtime`): TFF's multi-worker context returns CLIENTS-placed values in
the order the workers finish, not the order sent, so each upload carries its position and
the server restores arrival order before filling the buffer (otherwise derivatives would go
to the wrong participants). The backprop computation zips each participant's data with its
own derivative rows and only sums the result; tests/tff_algorithms/algorithms/fdml/test_fdml.py checks that one and two
workers give the same round.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.algorithms.fdml import triplet
from tff_algorithms.algorithms.fdml.round_config import AS, FdmlConfig
from tff_algorithms.config import model_config
from tff_algorithms.modeling import identity_heads, models


def clip_rows(derivatives: tf.Tensor, row_clip: float | None) -> tf.Tensor:
    """Each row (last axis) scaled to L2 norm at most `row_clip`; None: unchanged."""
    if row_clip is None:
        return derivatives
    return tf.clip_by_norm(derivatives, row_clip, axes=[-1])


def privatize_derivatives(
    derivatives: tf.Tensor,
    row_clip: float | None,
    noise_multiplier: float,
    seed: tf.Tensor,
) -> tf.Tensor:
    """R1 of `fdml_privacy`: every row clipped to `row_clip`, plus N(0, (z C_r)^2) per
    coordinate of every row (padding included: the noise does not depend on the data)."""
    clipped = clip_rows(derivatives, row_clip)
    if noise_multiplier == 0:
        return clipped
    stddev = noise_multiplier * row_clip
    return clipped + tf.random.stateless_normal(
        tf.shape(clipped), seed=seed, stddev=stddev, dtype=clipped.dtype
    )


def _seed(base: tf.Tensor, round_num: tf.Tensor, purpose: int) -> tf.Tensor:
    # One stream per (round, purpose): reusing a round's noise in another release would
    # let their difference cancel it.
    fold = tf.random.experimental.stateless_fold_in
    return fold(fold(base, round_num), purpose)


_DROP, _DERIVATIVE_NOISE, _GRADIENT_NOISE = 0, 1, 2

# `FdmlRoundOutput.metrics` that depend on the training users' data and carry no privacy:
# for monitoring, never to be released. The others (selected, case_a_failures,
# case_b_failures, aggregated) count the data-independent schedule and failures.
UNPRIVATE_METRICS = (
    "server_loss",
    "active_triplets",
    "dropped_embeddings",
    "non_finite_embeddings",
    "padded_rows",
    "non_finite_gradients",
)


class _ClientModel:
    """The participant's forward pass, used identically by both computations."""

    def __init__(
        self, backbone_fn: Callable[[], tf.keras.Model], image_shape: Sequence[int], samples: int
    ) -> None:
        self._model = backbone_fn()
        self._image_shape = tuple(image_shape)
        self._samples = samples

    def _assign(self, weights: tff.learning.models.ModelWeights) -> None:
        variables = list(self._model.trainable_weights) + list(self._model.non_trainable_weights)
        values = list(weights.trainable) + list(weights.non_trainable)
        for variable, value in zip(variables, values):
            variable.assign(value)

    def rows(self, dataset: tf.data.Dataset) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(images[s, ...], keys[s], count): the first s examples in order, zero-padded."""
        s = self._samples
        initial = (
            tf.zeros([s, *self._image_shape], tf.float32),
            tf.zeros([s], tf.int64),
            tf.constant(0, tf.int32),
        )

        def put(state, example):  # noqa: ANN001, ANN202 - tf.data reduce function
            images, keys, count = state
            key = identity_heads.identity_keys(tf.reshape(example["identity"], [1]))
            images = tf.tensor_scatter_nd_update(images, [[count]], [example["image"]])
            keys = tf.tensor_scatter_nd_update(keys, [[count]], key)
            return images, keys, count + 1

        return dataset.take(s).reduce(initial, put)

    def embed(self, weights, dataset):  # noqa: ANN001, ANN201 - traced inside TFF
        self._assign(weights)
        images, keys, count = self.rows(dataset)
        return collections.OrderedDict(
            embeddings=self._model(images, training=False), keys=keys, count=count
        )

    def gradient(self, weights, dataset, derivatives, gradient_clip):  # noqa: ANN001, ANN201
        self._assign(weights)
        images, _, count = self.rows(dataset)
        # Only the participant's real rows are backpropagated (its own knowledge).
        real = tf.cast(tf.range(self._samples) < count, derivatives.dtype)[:, None]
        variables = self._model.trainable_weights
        with tf.GradientTape() as tape:
            embeddings = self._model(images, training=False)
        gradient = tape.gradient(embeddings, variables, output_gradients=derivatives * real)
        gradient = [tf.zeros_like(v) if g is None else g for g, v in zip(gradient, variables)]
        norm = tf.linalg.global_norm(gradient)
        finite = tf.math.is_finite(norm)
        if gradient_clip is not None:
            gradient, _ = tf.clip_by_global_norm(gradient, gradient_clip, use_norm=norm)
        # A non-finite gradient contributes zero (as in DP-FedEmb) and is counted.
        gradient = [tf.where(finite, g, tf.zeros_like(g)) for g in gradient]
        return gradient, tf.cast(tf.logical_not(finite), tf.int32)


@dataclasses.dataclass(frozen=True)
class FdmlRoundOutput:
    """One call of `FdmlProcess.next`.

    Attributes:
      state: the server state after the round (unchanged but for its round counter when
        the round was not applied).
      applied: the aggregate was applied to the model (R1 and R2 released).
      abandoned: derivatives were released but the round was abandoned (AS, or no
        gradient arrived): the accountant charges R1.
      restarted: too few embeddings (Case A): nothing released, not charged.
      gradient: the released aggregate (noised sum / n) when applied, else None.
      metrics: counts (Case A and Case B apart) and the server's monitoring values
        (`UNPRIVATE_METRICS`: never release them).
    """

    state: Any
    applied: bool
    abandoned: bool
    restarted: bool
    gradient: list[np.ndarray] | None
    metrics: dict[str, float]


class FdmlProcess:
    """FDML's round (module docstring) as TFF computations and the trusted server's loop.

    Args:
      backbone_fn: no-argument function building a fresh backbone (image -> embedding);
        its own initial values are replaced by the broadcast weights.
      image_shape: (H, W, C) of one example's image.
      config: `FdmlConfig`.
      initial_weights: the starting backbone (e.g. pretrained); None: `backbone_fn()`'s.
      identity_dtype: tf.int64 or tf.string, the dtype of the examples' `identity`.
    """

    def __init__(
        self,
        backbone_fn: Callable[[], tf.keras.Model],
        image_shape: Sequence[int],
        config: FdmlConfig,
        *,
        initial_weights: tff.learning.models.ModelWeights | None = None,
        identity_dtype: tf.DType = tf.int64,
    ) -> None:
        self.config = config
        if initial_weights is None:
            model = backbone_fn()
            initial_weights = tff.learning.models.ModelWeights(
                trainable=[v.numpy() for v in model.trainable_weights],
                non_trainable=[v.numpy() for v in model.non_trainable_weights],
            )
        trainable = [np.asarray(w, np.float32) for w in initial_weights.trainable]
        non_trainable = [np.asarray(w, np.float32) for w in initial_weights.non_trainable]
        optimizer = tff.learning.optimizers.build_adam(
            learning_rate=float(config.server_learning_rate)
        )
        s = config.samples_per_user
        n = config.users_per_round

        @tff.tensorflow.computation
        def initialize():
            specs = [tf.TensorSpec(w.shape, tf.float32) for w in trainable]
            return collections.OrderedDict(
                weights=tff.learning.models.ModelWeights(
                    trainable=[tf.constant(w) for w in trainable],
                    non_trainable=[tf.constant(w) for w in non_trainable],
                ),
                optimizer_state=optimizer.initialize(specs),
                round_num=tf.constant(0, tf.int64),
                noise_seed=tf.constant([config.noise_seed, 0], tf.int64),
            )

        state_type = initialize.type_signature.result
        weights_type = state_type.weights
        # Sorted names: datasets of plain dicts serialize unambiguously (TFF's rule).
        element_spec = collections.OrderedDict(
            identity=tf.TensorSpec([], identity_dtype),
            image=tf.TensorSpec(list(image_shape), tf.float32),
        )
        data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))

        @tff.tensorflow.computation(state_type)
        def state_weights(state):
            return state["weights"]

        @tff.tensorflow.computation(weights_type, data_type, np.int32)
        def client_embed(weights, dataset, position):
            client = _ClientModel(backbone_fn, image_shape, s)
            upload = tf.function(client.embed)(weights, dataset)
            # Echoed so the server can put uploads back in arrival order: with several
            # workers, TFF returns CLIENTS values in the order the workers finish.
            upload["position"] = position
            return upload

        embedding_size = client_embed.type_signature.result.embeddings.shape[-1]
        derivatives_type = tff.TensorType(np.float32, [s, embedding_size])

        @tff.tensorflow.computation(weights_type, data_type, derivatives_type)
        def client_gradient(weights, dataset, derivatives):
            client = _ClientModel(backbone_fn, image_shape, s)
            gradient, non_finite = tf.function(client.gradient)(
                weights, dataset, derivatives, config.gradient_clip
            )
            return collections.OrderedDict(gradient=gradient, non_finite=non_finite)

        gradient_type = client_gradient.type_signature.result.gradient

        @tff.tensorflow.computation(state_type, gradient_type)
        def server_update(state, gradient_sum):
            seeds = tf.random.experimental.stateless_split(
                _seed(state["noise_seed"], state["round_num"], _GRADIENT_NOISE), len(gradient_sum)
            )
            if config.gradient_noise_multiplier > 0:
                stddev = config.gradient_noise_multiplier * config.gradient_clip
                gradient_sum = [
                    g + tf.random.stateless_normal(tf.shape(g), seed=seeds[i], stddev=stddev)
                    for i, g in enumerate(gradient_sum)
                ]
            # Eq. 2 with |d_i| = s for each of the n planned participants: a fixed
            # denominator (post-processing of the noised sum).
            gradient = [g / float(n) for g in gradient_sum]
            optimizer_state, new_trainable = optimizer.next(
                state["optimizer_state"], list(state["weights"].trainable), gradient
            )
            new_state = collections.OrderedDict(
                weights=tff.learning.models.ModelWeights(
                    trainable=new_trainable, non_trainable=state["weights"].non_trainable
                ),
                optimizer_state=optimizer_state,
                round_num=state["round_num"] + 1,
                noise_seed=state["noise_seed"],
            )
            return new_state, gradient

        @tff.tensorflow.computation(state_type)
        def skip_round(state):
            # An abandoned round released derivatives under this round's seed: the next
            # round must draw fresh noise.
            return collections.OrderedDict(
                weights=state["weights"],
                optimizer_state=state["optimizer_state"],
                round_num=state["round_num"] + 1,
                noise_seed=state["noise_seed"],
            )

        buffer_type = tff.TensorType(np.float32, [n, s, embedding_size])

        @tff.tensorflow.computation(
            buffer_type,
            tff.TensorType(np.int64, [n, s]),
            tff.TensorType(np.bool_, [n, s]),
            tff.TensorType(np.int64, [2]),
            np.int64,
        )
        def server_step(embeddings, keys, valid, noise_seed, round_num):
            # A non-finite upload is treated as padding (only its own slot's rows are
            # affected), so it can neither poison its group nor show in the release.
            finite = tf.reduce_all(tf.math.is_finite(embeddings), axis=-1)
            non_finite = tf.logical_and(valid, tf.logical_not(finite))
            valid = tf.logical_and(valid, finite)
            dropped = tf.zeros_like(valid)
            if config.embedding_drop_rate > 0:
                uniform = tf.random.stateless_uniform(
                    tf.shape(valid), seed=_seed(noise_seed, round_num, _DROP)
                )
                dropped = tf.logical_and(valid, uniform < config.embedding_drop_rate)
            used = tf.logical_and(valid, tf.logical_not(dropped))
            derivatives, active = triplet.buffer_derivatives(
                embeddings, keys, used, config.group_size, config.strategy, config.margin
            )
            loss = triplet.buffer_loss(
                embeddings, keys, used, config.group_size, config.strategy, config.margin
            )
            noised = privatize_derivatives(
                derivatives,
                config.row_clip,
                config.derivative_noise_multiplier,
                _seed(noise_seed, round_num, _DERIVATIVE_NOISE),
            )
            return collections.OrderedDict(
                derivatives=noised,
                # Rows outside the loss (dropped by the server's coin, padding, non-finite)
                # are not backpropagated: zeroing them uses the participant's own rows only.
                used=used,
                loss=loss,
                active_triplets=active,
                dropped_embeddings=tf.reduce_sum(tf.cast(dropped, tf.int32)),
                non_finite_embeddings=tf.reduce_sum(tf.cast(non_finite, tf.int32)),
            )

        @tff.federated_computation(
            tff.FederatedType(state_type, tff.SERVER),
            tff.FederatedType(data_type, tff.CLIENTS),
            tff.FederatedType(np.int32, tff.CLIENTS),
        )
        def embed(state, data, positions):
            weights = tff.federated_broadcast(tff.federated_map(state_weights, state))
            return tff.federated_map(client_embed, (weights, data, positions))

        @tff.federated_computation(
            tff.FederatedType(state_type, tff.SERVER),
            tff.FederatedType(data_type, tff.CLIENTS),
            tff.FederatedType(derivatives_type, tff.CLIENTS),
        )
        def backprop(state, data, derivatives):
            weights = tff.federated_broadcast(tff.federated_map(state_weights, state))
            result = tff.federated_map(client_gradient, (weights, data, derivatives))
            total = tff.federated_sum(result.gradient)
            new_state, gradient = tff.federated_map(server_update, (state, total))
            return new_state, gradient, tff.federated_sum(result.non_finite)

        self.initialize = initialize
        self.embed = embed
        self.server_step = server_step
        self.backprop = backprop
        self.skip_round = skip_round
        self.embedding_size = int(embedding_size)

    def next(
        self,
        state: Any,
        client_data: Sequence[tf.data.Dataset],
        *,
        case_a_failures: Collection[int] = (),
        case_b_failures: Collection[int] = (),
    ) -> FdmlRoundOutput:
        """One round over the selected participants, in arrival order.

        Args:
          state: the server state (`initialize()` or a previous round's).
          client_data: the selected participants' datasets, in the order their uploads
            arrive (over-selection: more than `users_per_round`).
          case_a_failures: indices into `client_data` of participants that never upload
            their embeddings.
          case_b_failures: indices of participants that upload embeddings but never
            deliver their gradient.
        """
        config = self.config
        n, s = config.users_per_round, config.samples_per_user
        for name, indices in (
            ("case_a_failures", case_a_failures),
            ("case_b_failures", case_b_failures),
        ):
            if any(not 0 <= int(i) < len(client_data) for i in indices):
                raise ValueError(f"{name} must index the {len(client_data)} participants")
        # TFF serializes datasets of OrderedDicts only; the map keeps order and content.
        client_data = [
            dataset.map(lambda e: collections.OrderedDict(identity=e["identity"], image=e["image"]))
            for dataset in client_data
        ]
        uploading = [i for i in range(len(client_data)) if i not in set(case_a_failures)]
        metrics: dict[str, float] = {
            "selected": len(client_data),
            "case_a_failures": len(client_data) - len(uploading),
        }
        if len(uploading) < n:
            # Alg. 3, line 5: too few embeddings; nothing was released.
            metrics["case_b_failures"] = 0
            return FdmlRoundOutput(state, False, False, True, None, metrics)
        uploaded = self.embed(
            state, [client_data[i] for i in uploading], list(range(len(uploading)))
        )
        uploaded = sorted(uploaded, key=lambda upload: int(upload["position"]))
        if [int(u["position"]) for u in uploaded] != list(range(len(uploading))):
            raise RuntimeError("the embedding uploads do not match the participants sent")
        # The first n uploads fill the buffer; later ones are not used (over-selection).
        in_buffer = uploading[:n]
        uploads = uploaded[:n]
        embeddings = np.stack([np.asarray(u["embeddings"], np.float32) for u in uploads])
        keys = np.stack([np.asarray(u["keys"], np.int64) for u in uploads])
        counts = np.array([int(u["count"]) for u in uploads])
        valid = np.arange(s)[None, :] < counts[:, None]
        step = self.server_step(
            embeddings, keys, valid, np.asarray(state["noise_seed"]), np.int64(state["round_num"])
        )
        derivatives = np.asarray(step["derivatives"]) * np.asarray(step["used"])[..., None]
        metrics.update(
            server_loss=float(step["loss"]),
            active_triplets=float(step["active_triplets"]),
            dropped_embeddings=int(step["dropped_embeddings"]),
            non_finite_embeddings=int(step["non_finite_embeddings"]),
            padded_rows=int((~valid).sum()),
        )
        failed_b = set(case_b_failures)
        delivered = [slot for slot, i in enumerate(in_buffer) if i not in failed_b]
        metrics["case_b_failures"] = n - len(delivered)
        if (config.case_b_strategy == AS and len(delivered) < n) or not delivered:
            metrics["aggregated"] = 0
            return FdmlRoundOutput(self.skip_round(state), False, True, False, None, metrics)
        # Alg. 3, lines 9-12: the first rate_p * n gradients to arrive are aggregated.
        aggregated = delivered[: config.gradients_needed]
        metrics["aggregated"] = len(aggregated)
        new_state, gradient, non_finite = self.backprop(
            state,
            [client_data[in_buffer[slot]] for slot in aggregated],
            [derivatives[slot] for slot in aggregated],
        )
        metrics["non_finite_gradients"] = int(non_finite)
        return FdmlRoundOutput(
            new_state, True, False, False, [np.asarray(g) for g in gradient], metrics
        )


def normalized_backbone_fn(
    backbone_config: model_config.BackboneConfig, seed: int = 0
) -> Callable[[], tf.keras.Model]:
    """The product's backbone with unit-norm embeddings (as `models.embed` serves them, and
    FaceNet's setting for the triplet loss); no extra weights, the backbone's order."""

    def build() -> tf.keras.Model:
        backbone = models.build_backbone(backbone_config, seed)
        outputs = tf.keras.layers.UnitNormalization(axis=-1)(backbone.output)
        return tf.keras.Model(backbone.input, outputs)

    return build


def build_fdml_process(
    backbone_config: model_config.BackboneConfig,
    config: FdmlConfig,
    *,
    backbone_seed: int = 0,
    initial_weights: tff.learning.models.ModelWeights | None = None,
    identity_dtype: tf.DType = tf.string,
) -> FdmlProcess:
    """FDML on the product's backbone (`normalized_backbone_fn`), from `backbone_seed`'s
    weights or `initial_weights` (e.g. `models.backbone_weights` of a pretrained one)."""
    if initial_weights is None:
        initial_weights = models.backbone_weights(
            models.build_backbone(backbone_config, backbone_seed)
        )
    return FdmlProcess(
        normalized_backbone_fn(backbone_config, backbone_seed),
        backbone_config.image_shape,
        config,
        initial_weights=initial_weights,
        identity_dtype=identity_dtype,
    )


def backbone_weights(state: Any) -> tff.learning.models.ModelWeights:
    """The backbone weights of a server state."""
    weights = state["weights"]
    return tff.learning.models.ModelWeights(
        trainable=[np.asarray(w) for w in weights.trainable],
        non_trainable=[np.asarray(w) for w in weights.non_trainable],
    )

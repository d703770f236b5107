"""User-level DP-SGD without virtual clients: the `dp-sgd-centralized` and
`dp-last-layer` baselines (issue 21, item 2).

`train_job.run_train_job` calls `train_user_dp_sgd` for both algorithms; everything
around the loop (budget charge, evaluation, export, metrics.json, ledger.json) is the
job's, as for the other algorithms. The privacy unit is the user. Each step t:

1. The job's schedule (`job_plan.schedule_for`, sampled mode, one user per virtual
   client) draws n = `virtual_clients_per_round` users uniformly without replacement,
   the sampling DP-FedEmb's rounds use; with `dp_sgd.full_batch` the step takes every
   training user instead (n = all of them, no sampling; issue 42).
2. Each sampled user's examples (at most `max_examples_per_client`, a subset drawn from
   the secret schedule seed and the step when it holds more) give one gradient: of the
   mean head loss over them, with respect to every trained variable (the trained
   model's trainable variables and the global head, one row per training identity, as
   DP-FedAvg's and the oracle's). It is clipped to L2 norm `clip_norm` over all of them
   together; a gradient that is not finite counts as zero.
3. The clipped sum plus N(0, (z·clip_norm)²) on every coordinate, divided by n, is the
   gradient of one step of `dp_sgd.optimizer` at `server_learning_rate`: momentum SGD
   (`server_momentum`), Adam or LAMB (`tff_algorithms.modeling.optimizers`; the seed
   paper's Algorithm 1). Post-processing: the accounting is the same for each.

Accounting: a user is in at most one row of a step, and its whole part in the step is
one clipped gradient, so the sum is DP-FedEmb's with one user per virtual client:
`accounting_spec.Mechanism.DPSGD`, uniform sampling without replacement, substitute-one,
sensitivity 2·clip_norm under the strict convention (dp_accounting is given z/2;
`job_plan.accounting_spec_for`, the same spec `dp-fedemb privacy --mechanism dpsgd`
accounts).
Full batch (`dp_sgd.full_batch`): every user in every step, so no amplification:
`accounting_spec.Sampling.FULL`, the Gaussian mechanism composed over the steps, same
sensitivity (docs/privacy.md, "Full-batch steps").
The global head's rows are the training identities, listed from the data: the caveat of
DP-FedAvg's global head (which rows exist, and in which order, is not privatised; the
head is never exported), which the accounting above does not cover.

What a user's examples are and which model trains is pluggable (`UserExamples`):

- `dp-sgd-centralized`: the partition's canonical records (decoded images), the whole
  backbone with its trainable layers (`train.trainable_layers`).
- `dp-last-layer`: the records of a feature cache (`feature_cache.ensure_cache`: the
  frozen prefix's outputs, same users and byte-range index), and the suffix model (the
  embedding layer alone), zero-initialised. The paper's recipe (seed
  dp-transfer-learning-image-classification): a zero last layer, large batches, many
  steps. Zero init needs a head loss that is defined at a zero embedding: `softmax`
  (logits e·ω). At e = 0 every logit is 0, the softmax uniform, and the gradient
  with respect to the embedding layer's kernel, f·(ω(p − y))ᵀ for features f, is
  not zero because the head ω starts random. The cosine losses (CosFace, ArcFace)
  normalise e first: ‖e‖ = 0 has no direction (TF's l2_normalize returns 0 there with
  a Jacobian of 1/sqrt(1e-12)), so `job_config` refuses them with dp-last-layer.
  The exported model is the prefix and the trained suffix: bytes → unit embedding.

Seeds: which users and which of their examples from the schedule seed (kept in
train_job.json), the noise from the noise seed (in the checkpoint) and the step, so a
resumed job redraws the same steps and ends where an uninterrupted run ends.
Checkpoints, ledger and history: the training loop (`jobs/loop.py`; the history holds epsilon,
wall time and held-out evaluation only: a training loss would be an unaccounted
release).

Per-user gradients (`UserDpSgd.clipped_sum`): a `tf.while_loop` over the step's users
inside one `tf.function`, one tape per user, its clipped gradient added to running sums.
Measured against `tf.vectorized_map` over the users (padded to the step's largest
example count) on the small CNN, 2 shared CPU cores: 32 users x 8 images 0.42 s (loop)
vs 0.38 s a step, 64 x 16 3.15 s vs 3.45 s; no clear winner, and the vectorised form
holds n copies of the gradient at once, so the loop stays. dp-last-layer's model is one
dense layer, whose per-example gradients are outer products: `dense_clipped_sum` gets
each user's norm from its examples' Gram matrices and the clipped sum from one batched
backward pass (1,024 users x 4 examples of 3,136 features, 3,000 identities: 0.85 s a
step against the loop's 3.7 s).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from beam_jobs import partition
from tff_algorithms.algorithms.user_dp_sgd.config import EMBEDDING_LAYER, DpSgdSettings
from tff_algorithms.config.client_config import SOFTMAX, HeadLossConfig
from tff_algorithms.config.job_plan import schedule_for
from tff_algorithms.federated import client_data, feature_cache
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.modeling import identity_heads, models, optimizers

if TYPE_CHECKING:
    from tff_algorithms.jobs.job_inputs import JobInputs

# Stream of the example-subset draws, apart from the schedule's own streams of the seed.
_EXAMPLE_STREAM = 0x5D65


@dataclasses.dataclass(frozen=True)
class UserExamples:
    """Where a step's users' examples come from.

    partition_dir: a partition (`beam_jobs.partition`) holding the training users.
    parse: one serialized record -> {"image": float32 [*example_shape], "identity": string}.
    example_shape: the shape of "image": the backbone's input, or cached features.
    """

    partition_dir: str
    parse: Callable[[tf.Tensor], Mapping[str, tf.Tensor]]
    example_shape: tuple[int, ...]


def image_examples(partition_dir: str, image_shape: tuple[int, int, int]) -> UserExamples:
    """The canonical records of a partition, decoded to images."""
    return UserExamples(
        partition_dir, lambda s: client_data.parse_example(s, image_shape), tuple(image_shape)
    )


def _example_subsets(
    counts: Sequence[int], limit: int, schedule_seed: int, step: int
) -> list[np.ndarray]:
    """The record indices each user trains on: all of them, or `limit` drawn at random."""
    rng = np.random.default_rng([schedule_seed, _EXAMPLE_STREAM, step])
    return [
        np.arange(count) if count <= limit else np.sort(rng.choice(count, limit, replace=False))
        for count in counts
    ]


class StepSource:
    """The users and examples of each step (module docstring, steps 1-2): a user's
    records come from its byte range of the partition (the reader's shard index).
    `full_batch`: every user of `user_ids` each step."""

    def __init__(
        self,
        config: Any,
        examples: UserExamples,
        user_ids: Sequence[str],
        schedule_seed: int,
        *,
        full_batch: bool = False,
    ) -> None:
        self._plan = None if full_batch else schedule_for(config, len(user_ids), schedule_seed)
        self._reader = partition.PartitionReader(examples.partition_dir)
        self._user_ids = list(user_ids)
        self._seed = schedule_seed
        self._limit = int(config.max_examples_per_client)
        shape = examples.example_shape
        parse = examples.parse

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string)])
        def decode(serialized: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            parsed = tf.map_fn(
                lambda s: (lambda p: (p["image"], p["identity"]))(parse(s)),
                serialized,
                fn_output_signature=(
                    tf.TensorSpec(shape, tf.float32),
                    tf.TensorSpec([], tf.string),
                ),
            )
            return parsed

        self._decode = decode

    def users(self, step: int) -> list[str]:
        """The step's sampled users (the schedule's round `step`, one user per group), or
        every user in full batch."""
        if self._plan is None:
            return list(self._user_ids)
        return [self._user_ids[int(i)] for i in np.ravel(self._plan.round_user_indices(step))]

    def batch(self, step: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(examples [n, m, ...], identities [n, m], real [n, m]): row k holds the k-th
        sampled user's examples, padded with zeros (and b"", real False) to the step's
        largest count m."""
        records = [self._reader.user_examples(user) for user in self.users(step)]
        subsets = _example_subsets([len(r) for r in records], self._limit, self._seed, step)
        chosen = [[r[i] for i in s] for r, s in zip(records, subsets, strict=True)]
        counts = [len(c) for c in chosen]
        n, m = len(chosen), max(counts)
        flat = [record for user in chosen for record in user]
        images, identities = self._decode(tf.constant(flat, tf.string))
        positions = np.concatenate([k * m + np.arange(c) for k, c in enumerate(counts)])
        index = tf.constant(positions[:, None], tf.int64)
        shape = images.shape[1:]
        padded = tf.scatter_nd(index, images, [n * m, *shape])
        padded_ids = tf.scatter_nd(index, identities, [n * m])
        real = np.zeros(n * m, bool)
        real[positions] = True
        return (
            tf.reshape(padded, [n, m, *shape]),
            tf.reshape(padded_ids, [n, m]),
            tf.constant(real.reshape(n, m)),
        )


def clip_by_global_norm(gradients: Sequence[tf.Tensor], clip_norm: float) -> list[tf.Tensor]:
    """`gradients` scaled by min(1, clip_norm / their joint L2 norm)."""
    norm = tf.linalg.global_norm(list(gradients))
    factor = tf.minimum(1.0, clip_norm / tf.maximum(norm, 1e-30))
    return [g * factor for g in gradients]


def gaussian_noise(
    variables: Sequence[tf.Variable], stddev: float, seed: tf.Tensor
) -> list[tf.Tensor]:
    """N(0, stddev²) for every coordinate of `variables`, from a stateless seed [2]."""
    return [
        stddev
        * tf.random.stateless_normal(
            v.shape, tf.random.experimental.stateless_fold_in(seed, i), dtype=v.dtype
        )
        for i, v in enumerate(variables)
    ]


class UserDpSgd:
    """The step of user-level DP-SGD (module docstring, steps 2-3) on one trained model.

    model: image (or features) -> embedding; its trainable variables train.
    head: the global head kernel [embedding_size, identities].
    vocabulary: `identity_heads.training_identity_vocabulary`.
    settings: the `dp_sgd` section: which optimizer applies the noised gradient, and
      the sigmoid head (None: its defaults, momentum SGD and softmax).

    With `settings.sigmoid_head` the logits are eᵀω + b, b a trained per-identity bias
    (`head_bias`, starting at `settings.head_bias`), each scored by sigmoid
    cross-entropy against its one-hot label and summed over identities.
    """

    def __init__(
        self,
        model: tf.keras.Model,
        head: tf.Variable,
        vocabulary: np.ndarray,
        loss: HeadLossConfig,
        *,
        clip_norm: float,
        noise_multiplier: float,
        users_per_step: int,
        learning_rate: float,
        momentum: float,
        settings: DpSgdSettings | None = None,
    ) -> None:
        settings = settings if settings is not None else DpSgdSettings()
        self.model = model
        self.head = head
        self.head_bias = (
            tf.Variable(tf.fill([len(vocabulary)], float(settings.head_bias)))
            if settings.sigmoid_head
            else None
        )
        self.variables = [*model.trainable_variables, head]
        if self.head_bias is not None:
            self.variables.append(self.head_bias)
        self.optimizer = optimizers.from_settings(settings, learning_rate, momentum)
        self.optimizer.build(self.variables)
        self._vocabulary = tf.constant(vocabulary, tf.int64)
        self._rows = len(vocabulary)
        self._loss = loss
        self._clip = float(clip_norm)
        self._stddev = float(noise_multiplier) * float(clip_norm)
        self._n = int(users_per_step)
        self._dense = _single_dense_layer(model) if loss.loss == SOFTMAX else None
        self.step = tf.function(self._step)

    def user_gradient(self, x: tf.Tensor, identity: tf.Tensor, real: tf.Tensor) -> list[tf.Tensor]:
        """The clipped gradient of one user's mean loss over its real examples."""
        labels, usable = identity_heads.labels_in_vocabulary(
            identity_heads.identity_keys(identity), self._vocabulary, self._rows
        )
        with tf.GradientTape() as tape:
            embeddings = self.model(x, training=False)  # per example: no batch statistics
            weights = tf.cast(tf.logical_and(real, usable), tf.float32)
            per_example = self._example_loss(labels, self._logits(embeddings, labels))
            loss = tf.reduce_sum(per_example * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
        gradients = tape.gradient(
            loss, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        gradients, _ = identity_heads.zero_if_not_finite(gradients)
        return clip_by_global_norm(gradients, self._clip)

    def _logits(self, embeddings: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        logits = identity_heads.head_logits(embeddings, self.head, labels, self._loss)
        return logits if self.head_bias is None else logits + self.head_bias

    def _example_loss(self, labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        """Each example's loss: softmax cross-entropy, or the sigmoid head's summed
        one-vs-all sigmoid cross-entropy."""
        if self.head_bias is None:
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
        targets = tf.one_hot(labels, self._rows, dtype=logits.dtype)
        return tf.reduce_sum(tf.nn.sigmoid_cross_entropy_with_logits(targets, logits), 1)

    def clipped_sum(self, x: tf.Tensor, identity: tf.Tensor, real: tf.Tensor) -> list[tf.Tensor]:
        """Σ_users clip(∇ user loss): one tape per user in a while loop, or for a
        single dense layer under the softmax head `dense_clipped_sum`."""
        if self._dense is not None:
            return self.dense_clipped_sum(x, identity, real)
        sums = [tf.zeros_like(v) for v in self.variables]
        for k in tf.range(tf.shape(x)[0]):
            tf.autograph.experimental.set_loop_options(parallel_iterations=1)
            own = real[k]  # the padding is not computed; a user without examples adds 0
            if tf.reduce_any(own):
                gradient = self.user_gradient(
                    tf.boolean_mask(x[k], own),
                    tf.boolean_mask(identity[k], own),
                    tf.boolean_mask(own, own),
                )
                sums = [s + g for s, g in zip(sums, gradient, strict=True)]
        return sums

    def dense_clipped_sum(
        self, x: tf.Tensor, identity: tf.Tensor, real: tf.Tensor
    ) -> list[tf.Tensor]:
        """`clipped_sum` of a model that is one dense layer e = Wᵀf + b under the softmax
        head (logits eᵀH, plus the sigmoid head's bias c), from one batched backward pass.

        Per example i the gradients are rank one: f_i δ_iᵀ (W), δ_i (b) and e_i g_iᵀ (H),
        with δ_i = ∂L/∂e_i and g_i = ∂L/∂logits_i of the user's mean loss, and g_i (c). A
        user's squared norm is then Σ_ij (f_i·f_j)(δ_i·δ_j) + ‖Σ_i δ_i‖² + Σ_ij (e_i·e_j)
        (g_i·g_j) + ‖Σ_i g_i‖² (its examples' Gram matrices), and the sum of the clipped gradients is those
        outer products with each user's rows scaled by its clip factor: no per-user
        gradient is materialised (dp-last-layer's steps of a thousand users).
        """
        dense = self._dense
        n, m = tf.shape(x)[0], tf.shape(x)[1]
        features = tf.reshape(x, [n * m, -1])
        labels, usable = identity_heads.labels_in_vocabulary(
            identity_heads.identity_keys(tf.reshape(identity, [-1])), self._vocabulary, self._rows
        )
        weight = tf.reshape(
            tf.cast(tf.logical_and(tf.reshape(real, [-1]), usable), tf.float32), [n, m]
        )
        # Each user's loss is the mean over its real examples (`identity_heads.head_loss`).
        weight = tf.reshape(weight / tf.maximum(tf.reduce_sum(weight, 1, keepdims=True), 1.0), [-1])
        with tf.GradientTape() as tape:
            embeddings = dense(features)
            logits = self._logits(embeddings, labels)
            total = tf.reduce_sum(weight * self._example_loss(labels, logits))
        delta, g = tape.gradient(total, [embeddings, logits])

        def per_user(t: tf.Tensor) -> tf.Tensor:
            return tf.reshape(t, [n, m, -1])

        def gram(t: tf.Tensor) -> tf.Tensor:
            return tf.einsum("uik,ujk->uij", per_user(t), per_user(t))

        squared = tf.reduce_sum(gram(features) * gram(delta), [1, 2]) + tf.reduce_sum(
            gram(embeddings) * gram(g), [1, 2]
        )
        if dense.use_bias:
            squared += tf.reduce_sum(tf.square(tf.reduce_sum(per_user(delta), 1)), 1)
        if self.head_bias is not None:
            squared += tf.reduce_sum(tf.square(tf.reduce_sum(per_user(g), 1)), 1)
        norm = tf.sqrt(squared)
        finite = tf.math.is_finite(norm)
        scale = tf.where(finite, tf.minimum(1.0, self._clip / tf.maximum(norm, 1e-30)), 0.0)
        row_scale = tf.repeat(scale, m)[:, tf.newaxis]
        row_finite = tf.repeat(finite, m)[:, tf.newaxis]

        def clean(t: tf.Tensor) -> tf.Tensor:  # a user whose gradient is not finite adds 0
            return tf.where(row_finite, t, 0.0)

        delta, g = clean(delta) * row_scale, clean(g) * row_scale
        sums = {
            id(dense.kernel): tf.matmul(clean(features), delta, transpose_a=True),
            id(self.head): tf.matmul(clean(embeddings), g, transpose_a=True),
        }
        if dense.use_bias:
            sums[id(dense.bias)] = tf.reduce_sum(delta, 0)
        if self.head_bias is not None:
            sums[id(self.head_bias)] = tf.reduce_sum(g, 0)
        return [sums[id(v)] for v in self.variables]

    def _step(self, x: tf.Tensor, identity: tf.Tensor, real: tf.Tensor, seed: tf.Tensor) -> None:
        sums = self.clipped_sum(x, identity, real)
        noise = gaussian_noise(self.variables, self._stddev, seed)
        update = [(s + z) / self._n for s, z in zip(sums, noise, strict=True)]
        self.optimizer.apply_gradients(zip(update, self.variables, strict=True))


def _single_dense_layer(model: tf.keras.Model) -> tf.keras.layers.Dense | None:
    """The model's one layer when it is a linear dense layer on its input whose
    variables all train (dp-last-layer's suffix), else None."""
    layers = [layer for layer in model.layers if not isinstance(layer, tf.keras.layers.InputLayer)]
    if len(layers) != 1 or not isinstance(layers[0], tf.keras.layers.Dense):
        return None
    dense = layers[0]
    linear = dense.activation in (None, tf.keras.activations.linear)
    trains_all = [id(v) for v in model.trainable_variables] == [id(v) for v in dense.weights]
    return dense if linear and trains_all and len(model.inputs[0].shape) == 2 else None


def _initial_model(inputs: JobInputs, last_layer: bool) -> tf.keras.Model:
    config = inputs.config
    backbone = models.build_backbone(config.backbone_config, seed=config.seed)
    if inputs.pretrained is not None:
        models.assign_backbone_weights(backbone, inputs.pretrained)
    if last_layer:
        # The paper's zero last layer (module docstring): kernel and bias start at 0.
        for variable in backbone.get_layer(EMBEDDING_LAYER).weights:
            variable.assign(tf.zeros_like(variable))
    return backbone


def _cached_source(
    inputs: JobInputs, backbone: tf.keras.Model
) -> tuple[UserExamples, tf.keras.Model, dict[str, Any]]:
    """dp-last-layer's examples (the feature cache of the frozen prefix), trained model
    (the suffix) and the cache's facts for metrics.json (as a federated job's)."""
    config = inputs.config
    decision = feature_cache.cut_for(config.backbone_config)
    if decision.cut is None:
        raise ValueError(f"dp-last-layer trains on cached features: {decision.reason}")
    _, suffix = decision.cut.split(backbone)
    began = time.perf_counter()
    cached = feature_cache.ensure_cache(
        inputs.partition_dir,
        inputs.feature_cache_dir,
        config.backbone_config,
        backbone,
        decision.cut,
    )
    shape = tuple(cached.feature_shape)
    return (
        UserExamples(
            cached.partition_dir,
            lambda s: feature_cache.parse_cached_example(s, shape),
            shape,
        ),
        suffix,
        feature_cache.cache_facts(decision, cached, time.perf_counter() - began),
    )


def train_user_dp_sgd(inputs: JobInputs, schedule_seed: int, *, last_layer: bool) -> JobOutcome:
    """Trains for `config.rounds` steps (module docstring); `last_layer`: dp-last-layer."""
    config = inputs.config
    backbone = _initial_model(inputs, last_layer)
    if last_layer:
        examples, trained, cache_facts = _cached_source(inputs, backbone)
    else:
        examples, trained = image_examples(inputs.partition_dir, config.image_shape), backbone
        cache_facts = {"used": False, "reason": "dp-sgd-centralized trains on images"}
    vocabulary = identity_heads.training_identity_vocabulary(inputs.reader, inputs.user_ids)
    head = tf.Variable(
        models.initial_head_kernel(
            tf.constant([config.seed, -1], tf.int64), config.embedding_size, len(vocabulary)
        )
    )
    trainer = UserDpSgd(
        trained,
        head,
        vocabulary,
        config.head_loss_config,
        clip_norm=config.clip_norm,
        noise_multiplier=config.noise_multiplier,
        users_per_step=config.virtual_clients_per_round,
        learning_rate=config.server_learning_rate,
        momentum=config.server_momentum,
        settings=config.settings,
    )
    full_batch = config.settings.full_batch
    if full_batch and config.virtual_clients_per_round != len(inputs.user_ids):
        # `calibrated_for` resolves auto to every user; anything else is a planning bug.
        raise ValueError(
            f"dp_sgd.full_batch: {config.virtual_clients_per_round} users a step planned, "
            f"{len(inputs.user_ids)} training users"
        )
    source = StepSource(config, examples, inputs.user_ids, schedule_seed, full_batch=full_batch)

    def step(t: int, seed: tf.Tensor) -> None:
        trainer.step(*source.batch(t), seed)

    trained_state = {"model": backbone, "head": head, "optimizer": trainer.optimizer}
    if trainer.head_bias is not None:
        trained_state["head_bias"] = trainer.head_bias
    outcome = loop.run(
        inputs, loop.Round(step, trained_state, lambda: models.backbone_weights(backbone))
    )
    return dataclasses.replace(outcome, feature_cache=cache_facts)

"""Client work of DP-FedEmb (paper Alg. 1) and of the DP-FedAvg baseline (Alg. 2).

A virtual client (k users' data) starts from the broadcast backbone θ and, for
DP-FedEmb, a freshly initialised LOCAL head: `head_capacity` bias-free rows, one
per local identity. It fine-tunes the backbone with learning rate β1 and the head
with β2 = head_learning_rate_scale·β1 (SGD, optional momentum), and returns only
the backbone update. The local head never leaves the client computation.

Client dataset: one element is one batch of one virtual client::

    OrderedDict(
        image=float32[None, H, W, C],       # values in [0, 1]
        identity=int64[None] | string[None], # the raw identity: a name or a global id
        client_seed=int64[],                 # the same in every batch of a virtual client
        expected_examples=int64[],           # examples the loader should yield (capped at
                                             # max_examples); -1 when it cannot say
    )

`make_client_dataset(examples, virtual_client_id, config)` builds it from per-example
elements `{"image": float32[H, W, C], "identity": string or int64 scalar}` (what a
data loader produces for the users of one virtual client): it caps the examples,
shuffles, batches and attaches `client_seed`, a hash of the virtual-client id.
Virtual-client ids are expected to be unique per round (the schedule regroups users
every round), so seeds differ across rounds; the round number is folded in as well.

Identity remapping happens inside the client: identities become int64 keys (the
integer itself, or a 62-bit hash of the string), a first pass over the virtual
client's data collects the sorted distinct keys, and an identity's local label is
its rank among them. Head rows at or beyond the number of local identities are
masked out of the softmax. Examples of identities beyond `head_capacity` are
dropped from the loss and counted in `examples_over_head_capacity` (the training
program should treat a non-zero count as a configuration error). For DP-FedAvg the
head is global: keys are looked up in the sorted keys of all training identities,
and unknown identities are dropped and counted the same way.

Update convention (TFF's): the update is `initial - final` weights, so the server
optimizer SGD with learning rate 1 reproduces plain averaging.

Dropped virtual clients (stragglers and failures). A TFF simulation cannot lose a
client the way a device fleet does, so failures are modelled inside the computation,
and a dropped client returns an all-zero update and is counted, never stops the round:
- a failed read: `make_client_dataset` skips elements whose reading raises
  (`ignore_errors`; the loader must raise per element, see
  `processes.compose_with_client_loader`), and a client that yields fewer examples
  than `expected_examples`, or none at all, is dropped (`failed_reads`);
- a timeout: `max_local_steps` (deterministic) and `max_seconds` (wall clock, measured
  with `tf.timestamp` inside the client) bound the local work; a client that needs
  more is dropped (`timed_out_clients`);
- a non-finite update (`non_finite_updates`);
- `failure_injection_rate` makes that fraction of virtual clients fail their read
  (a real op error), for tests and benchmarks.
Over-selection: with `max_reports` M, the round selects more than M virtual clients
and keeps the first M that report, in an arrival order modelled by the client seed (a
hash of the virtual-client id); the others' updates are zeroed (`kept_clients` counts
the rest). Every dropped or unkept client still counts in the aggregator's fixed
denominator M, so the noise stays calibrated to the planned round.

Client measurements (losses, counts) are computed on training users WITHOUT
privacy; they are for monitoring only and must not be released.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms import model_config, models
from tff_algorithms.client_config import (
    COSFACE,
    HEAD_INIT_CLASS_MEANS,
    SOFTMAX,
    ClientConfig,
    HeadLossConfig,
)

_KEY_BUCKETS = 2**62
# Logit for masked head rows: exp() underflows to exactly 0 without producing NaNs.
_MASKED_LOGIT = -1e9


def client_element_spec(
    image_shape: Sequence[int], identity_dtype: tf.DType = tf.string
) -> collections.OrderedDict:
    """The `tf.TensorSpec`s of one client batch (see module docstring)."""
    return collections.OrderedDict(
        image=tf.TensorSpec([None, *image_shape], tf.float32),
        identity=tf.TensorSpec([None], identity_dtype),
        client_seed=tf.TensorSpec([], tf.int64),
        expected_examples=tf.TensorSpec([], tf.int64),
    )


def client_seed_from_id(virtual_client_id: tf.Tensor) -> tf.Tensor:
    """int64 seed of a virtual client, from its string id."""
    return tf.strings.to_hash_bucket_fast(virtual_client_id, _KEY_BUCKETS)


def _injected_failure(virtual_client_id: tf.Tensor, rate: float) -> tf.Tensor:
    """Whether fault injection fails this virtual client: a hash of its id below `rate`."""
    bucket = tf.strings.to_hash_bucket_fast(
        tf.strings.join(["failure-injection/", virtual_client_id]), 1_000_000
    )
    return tf.cast(bucket, tf.float64) < rate * 1_000_000


def make_client_dataset(
    examples: tf.data.Dataset,
    virtual_client_id: tf.Tensor | str,
    config: ClientConfig,
    expected_examples: tf.Tensor | int | None = None,
) -> tf.data.Dataset:
    """Per-example `{image, identity}` of one virtual client -> its client batches.

    Skips examples whose reading raises, takes the first `max_examples` (the loader
    decides their order), shuffles them with a seed derived from the virtual-client id
    (reshuffled in every local epoch) and batches them. `expected_examples` is how many
    examples the loader should yield (None: unknown); the client work drops a client
    that yields fewer. Usable inside a TFF dataset computation.
    """
    virtual_client_id = tf.convert_to_tensor(virtual_client_id, tf.string)
    seed = client_seed_from_id(virtual_client_id)
    expected = (
        tf.constant(-1, tf.int64)
        if expected_examples is None
        else tf.minimum(tf.cast(expected_examples, tf.int64), config.max_examples)
    )
    examples = examples.map(
        lambda e: collections.OrderedDict(image=e["image"], identity=e["identity"])
    )
    if config.failure_injection_rate > 0:
        failing = _injected_failure(virtual_client_id, config.failure_injection_rate)

        def fail_if_injected(example: collections.OrderedDict) -> collections.OrderedDict:
            check = tf.debugging.Assert(tf.logical_not(failing), ["injected client failure"])
            with tf.control_dependencies([check]):
                return tf.nest.map_structure(tf.identity, example)

        examples = examples.map(fail_if_injected)
    return (
        examples.ignore_errors()
        .take(config.max_examples)
        .shuffle(config.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        .batch(config.batch_size)
        .map(
            lambda b: collections.OrderedDict(
                image=b["image"],
                identity=b["identity"],
                client_seed=seed,
                expected_examples=expected,
            )
        )
    )


def local_head_seed(
    head_seed: tf.Tensor, round_num: tf.Tensor, client_seed: tf.Tensor
) -> tf.Tensor:
    """Stateless seed of a local head, from (base seed, round, virtual client)."""
    base = tf.stack([tf.cast(head_seed, tf.int64), tf.cast(round_num, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(client_seed, tf.int64))


def identity_keys(identity: tf.Tensor) -> tf.Tensor:
    """int64 keys of identities: integers as they are, strings as 62-bit hashes."""
    if identity.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(identity, _KEY_BUCKETS)
    return tf.cast(identity, tf.int64)


def identity_keys_vocabulary(identities: Sequence[str] | Sequence[int]) -> np.ndarray:
    """Sorted distinct int64 keys of all training identities (the global head's rows)."""
    keys = identity_keys(tf.constant(list(identities))).numpy()
    vocabulary = np.unique(keys)
    if len(vocabulary) != len(set(identities)):
        raise ValueError("identity hashes collide; rename identities or use integer ids")
    return vocabulary


def labels_in_vocabulary(
    keys: tf.Tensor, vocabulary: tf.Tensor, num_rows: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """(row index, usable) of each key in a sorted vocabulary; unusable = unknown or row >= num_rows."""
    index = tf.searchsorted(vocabulary, keys, side="left", out_type=tf.int32)
    safe_index = tf.minimum(index, tf.maximum(tf.size(vocabulary) - 1, 0))
    known = tf.logical_and(
        index < tf.size(vocabulary), tf.equal(tf.gather(vocabulary, safe_index), keys)
    )
    usable = tf.logical_and(known, index < num_rows)
    return tf.where(usable, index, 0), usable


def head_logits(
    embeddings: tf.Tensor,
    kernel: tf.Tensor,
    labels: tf.Tensor,
    loss_config: HeadLossConfig,
    num_active_rows: tf.Tensor | int | None = None,
) -> tf.Tensor:
    """Logits [B, rows] of the head loss; rows >= `num_active_rows` are masked out."""
    if loss_config.loss == SOFTMAX:
        logits = tf.matmul(embeddings, kernel)
    else:
        cosine = tf.matmul(
            tf.math.l2_normalize(embeddings, axis=1), tf.math.l2_normalize(kernel, axis=0)
        )
        is_label = tf.one_hot(labels, tf.shape(kernel)[1], dtype=cosine.dtype) > 0
        margin = loss_config.margin
        if loss_config.loss == COSFACE:
            target = cosine - margin
        else:
            # cos(θ + m) is only decreasing in θ up to π − m; beyond that use the
            # CosFace-like linear continuation so the target logit stays monotonic.
            sine = tf.sqrt(tf.maximum(1.0 - tf.square(cosine), 0.0))
            shifted = cosine * math.cos(margin) - sine * math.sin(margin)
            target = tf.where(
                cosine > math.cos(math.pi - margin),
                shifted,
                cosine - math.sin(math.pi - margin) * margin,
            )
        logits = loss_config.scale * tf.where(is_label, target, cosine)
    if num_active_rows is not None:
        active = tf.range(tf.shape(kernel)[1]) < tf.cast(num_active_rows, tf.int32)
        logits = tf.where(active[tf.newaxis, :], logits, _MASKED_LOGIT)
    return logits


def head_loss(logits: tf.Tensor, labels: tf.Tensor, example_mask: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy over the examples where `example_mask` is true (0 if none)."""
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    weights = tf.cast(example_mask, per_example.dtype)
    return tf.reduce_sum(per_example * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


def zero_if_not_finite(structure: object) -> tuple[object, tf.Tensor]:
    """(structure, 0) if all finite, else (zeros of the same structure, 1)."""
    flat = tf.nest.flatten(structure)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in flat])
    zeroed = [tf.where(finite, t, tf.zeros_like(t)) for t in flat]
    return tf.nest.pack_sequence_as(structure, zeroed), tf.cast(tf.logical_not(finite), tf.int32)


def _client_state_type() -> tff.Type:
    return tff.StructWithPythonType(
        [("round_num", np.int64), ("head_seed", np.int64)], collections.OrderedDict
    )


def _fold_batches(
    dataset: tf.data.Dataset,
    initial_state: object,
    step: Callable[[object, object], object],
    shape_invariants: object = None,
) -> object:
    """`dataset.reduce(initial_state, step)`, as a while loop over an explicit iterator.

    `Dataset.reduce` runs `step` as a separate function that TensorFlow instantiates
    when the reduce op runs; called from Python (`tf.function`, as `train_one_client`
    and the benchmarks' plain loop do) that cost more than the local steps themselves.
    A while loop's body is part of the enclosing graph. Same results, bit for bit, in
    TFF rounds (BENCHMARKS.md). One iteration at a time (`parallel_iterations=1`): the
    steps assign variables that the next step reads. `shape_invariants` (the state's
    structure of `tf.TensorShape`s) for states whose shapes change across steps.
    """
    iterator = iter(dataset)

    def body(has_next, state):  # noqa: ANN001, ANN202 - loop variables
        del has_next
        batch = iterator.get_next_as_optional()
        state = tf.cond(batch.has_value(), lambda: step(state, batch.get_value()), lambda: state)
        return batch.has_value(), state

    invariants = None if shape_invariants is None else (tf.TensorShape([]), shape_invariants)
    _, state = tf.while_loop(
        lambda has_next, state: has_next,
        body,
        (tf.constant(True), initial_state),
        shape_invariants=invariants,
        parallel_iterations=1,
    )
    return state


class _LocalTrainer:
    """The per-virtual-client training loop (built inside a TFF computation).

    With `global_head_vocabulary` None the head is local (DP-FedEmb); otherwise
    the head is the broadcast global head with one row per vocabulary key.
    """

    def __init__(
        self,
        backbone_fn: Callable[[], tf.keras.Model],
        config: ClientConfig,
        global_head_vocabulary: np.ndarray | None,
    ) -> None:
        self.backbone = backbone_fn()
        self.config = config
        self.embedding_size = int(self.backbone.output_shape[-1])
        self.vocabulary = global_head_vocabulary
        self.num_head_rows = (
            config.head_capacity if global_head_vocabulary is None else len(global_head_vocabulary)
        )
        self.head = tf.Variable(
            tf.zeros([self.embedding_size, self.num_head_rows]), name="head_kernel"
        )
        self.backbone_optimizer = tff.learning.optimizers.build_sgdm(
            learning_rate=config.backbone_learning_rate, momentum=config.momentum or None
        )
        self.head_optimizer = tff.learning.optimizers.build_sgdm(
            learning_rate=config.head_learning_rate, momentum=config.momentum or None
        )

    def _first_pass(
        self, dataset: tf.data.Dataset
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
        """First pass: sorted distinct identity keys, the client seed, and with
        `class_means` the initial head (each row its identity's mean unit embedding)."""
        with_means = self.config.head_init == HEAD_INIT_CLASS_MEANS

        def collect(state, batch):
            keys, _, embeddings = state
            keys = tf.concat([keys, identity_keys(batch["identity"])], 0)
            if with_means:
                batch_embeddings = self.backbone(batch["image"], training=False)
                embeddings = tf.concat(
                    [embeddings, tf.math.l2_normalize(batch_embeddings, axis=1)], 0
                )
            return keys, batch["client_seed"], embeddings

        keys, client_seed, embeddings = _fold_batches(
            dataset,
            (
                tf.zeros([0], tf.int64),
                tf.constant(0, tf.int64),
                tf.zeros([0, self.embedding_size]),
            ),
            collect,
            shape_invariants=(
                tf.TensorShape([None]),
                tf.TensorShape([]),
                tf.TensorShape([None, self.embedding_size]),
            ),
        )
        vocabulary = tf.sort(tf.unique(keys).y)
        if not with_means:
            return vocabulary, client_seed, None
        labels, usable = labels_in_vocabulary(keys, vocabulary, self.num_head_rows)
        sums = tf.math.unsorted_segment_sum(
            tf.boolean_mask(embeddings, usable),
            tf.boolean_mask(labels, usable),
            self.num_head_rows,
        )
        # Rows of absent identities stay zero (they are masked out of the loss anyway).
        head = self.config.class_means_norm * tf.math.l2_normalize(sums, axis=1)
        return vocabulary, client_seed, tf.transpose(head)

    def train(self, initial_weights, dataset, client_state):  # noqa: ANN001, ANN201 - TFF structures
        backbone_variables = list(self.backbone.trainable_weights)
        for variable, value in zip(
            backbone_variables + list(self.backbone.non_trainable_weights),
            _backbone_trainable(initial_weights) + _backbone_non_trainable(initial_weights),
        ):
            variable.assign(value)
        if self.vocabulary is None:
            vocabulary, client_seed, class_means = self._first_pass(dataset)
            if class_means is None:
                seed = local_head_seed(
                    client_state["head_seed"], client_state["round_num"], client_seed
                )
                self.head.assign(
                    models.initial_head_kernel(seed, self.embedding_size, self.num_head_rows)
                )
            else:
                self.head.assign(class_means)
            num_active_rows = tf.minimum(tf.size(vocabulary), self.num_head_rows)
        else:
            vocabulary = tf.constant(self.vocabulary, tf.int64)
            self.head.assign(initial_weights.trainable["head"][0])
            num_active_rows = self.num_head_rows

        def train_step(state, batch):
            backbone_opt_state, head_opt_state, num_examples, num_dropped, loss_sum, num_batches = (
                state
            )
            labels, usable = labels_in_vocabulary(
                identity_keys(batch["identity"]), vocabulary, self.num_head_rows
            )
            with tf.GradientTape() as tape:
                embeddings = self.backbone(batch["image"], training=True)
                logits = head_logits(
                    embeddings, self.head, labels, self.config.head_loss, num_active_rows
                )
                loss = head_loss(logits, labels, usable)
            backbone_grads, head_grad = tape.gradient(loss, (backbone_variables, self.head))
            backbone_opt_state, new_backbone = self.backbone_optimizer.next(
                backbone_opt_state, tuple(backbone_variables), tuple(backbone_grads)
            )
            head_opt_state, new_head = self.head_optimizer.next(
                head_opt_state, tf.identity(self.head), head_grad
            )
            assignments = [
                variable.assign(value) for variable, value in zip(backbone_variables, new_backbone)
            ]
            assignments.append(self.head.assign(new_head))
            num_usable = tf.reduce_sum(tf.cast(usable, tf.int64))
            # The next step (a loop iteration) starts from this state, so it reads the
            # variables only after these assignments.
            with tf.control_dependencies(assignments):
                return tf.nest.map_structure(
                    tf.identity,
                    (
                        backbone_opt_state,
                        head_opt_state,
                        num_examples + num_usable,
                        num_dropped + tf.size(usable, out_type=tf.int64) - num_usable,
                        loss_sum + loss,
                        num_batches + 1,
                    ),
                )

        max_steps, max_seconds = self.config.max_local_steps, self.config.max_seconds
        started = tf.timestamp()

        def within_budget(steps_done: tf.Tensor) -> tf.Tensor:
            within = tf.constant(True)
            if max_steps is not None:
                within = tf.logical_and(within, steps_done < max_steps)
            if max_seconds is not None:
                within = tf.logical_and(within, tf.timestamp() - started < max_seconds)
            return within

        def step(state, batch):
            training_state, rows_read, timed_out, _, _ = state
            if max_steps is None and max_seconds is None:
                training_state = train_step(training_state, batch)
            else:
                # A straggler: past its budget it stops training (the rest of its data
                # is still read, up to one batch past max_local_steps) and is dropped.
                within = within_budget(training_state[-1])
                training_state = tf.cond(
                    within, lambda: train_step(training_state, batch), lambda: training_state
                )
                timed_out = tf.logical_or(timed_out, tf.logical_not(within))
            return (
                training_state,
                rows_read + tf.size(batch["identity"], out_type=tf.int64),
                timed_out,
                batch["client_seed"],
                batch["expected_examples"],
            )

        initial_training_state = (
            self.backbone_optimizer.initialize(
                tuple(tf.TensorSpec(v.shape, v.dtype) for v in backbone_variables)
            ),
            self.head_optimizer.initialize(tf.TensorSpec(self.head.shape, self.head.dtype)),
            tf.constant(0, tf.int64),
            tf.constant(0, tf.int64),
            tf.constant(0.0),
            tf.constant(0.0),
        )
        batches = dataset.repeat(self.config.epochs)
        if max_steps is not None:
            batches = batches.take(max_steps + 1)
        # The training pass's iterator is created after the vocabulary pass's: each new
        # iterator draws the next reshuffle of the client dataset, so without this order
        # the two passes could swap shuffles from run to run.
        with tf.control_dependencies([vocabulary]):
            training_state, rows_read, timed_out, client_seed, expected = _fold_batches(
                batches,
                (
                    initial_training_state,
                    tf.constant(0, tf.int64),
                    tf.constant(False),
                    tf.constant(0, tf.int64),
                    tf.constant(-1, tf.int64),
                ),
                step,
            )
        _, _, num_examples, num_dropped, loss_sum, num_batches = training_state
        backbone_update = [
            a - b for a, b in zip(_backbone_trainable(initial_weights), backbone_variables)
        ]
        if self.vocabulary is None:
            update = backbone_update
        else:
            update = collections.OrderedDict(
                backbone=backbone_update, head=[initial_weights.trainable["head"][0] - self.head]
            )
        update, non_finite = zero_if_not_finite(update)
        # Every epoch must read every expected example; a client with nothing to read
        # failed too. A timed-out client's short read is counted as the timeout.
        short_read = tf.logical_or(
            # tf.equal: inside TFF's graph tracing `==` compares tensor identity.
            tf.equal(rows_read, 0),
            tf.logical_and(expected >= 0, rows_read < expected * self.config.epochs),
        )
        failed_read = tf.logical_and(short_read, tf.logical_not(timed_out))
        dropped = tf.logical_or(tf.logical_or(failed_read, timed_out), non_finite > 0)
        update = tf.nest.map_structure(lambda t: tf.where(dropped, tf.zeros_like(t), t), update)
        measurements = collections.OrderedDict(
            num_examples=num_examples,
            examples_over_head_capacity=num_dropped,
            non_finite_updates=non_finite,
            failed_reads=tf.cast(failed_read, tf.int32),
            timed_out_clients=tf.cast(timed_out, tf.int32),
            reported=tf.cast(tf.logical_not(dropped), tf.int32),
            arrival_key=client_seed,
            loss=loss_sum / tf.maximum(num_batches, 1.0),
        )
        return tff.learning.templates.ClientResult(
            update=update, update_weight=tf.constant(1.0)
        ), measurements


def _backbone_trainable(weights) -> list:  # noqa: ANN001 - ModelWeights of either layout
    trainable = weights.trainable
    return list(
        trainable["backbone"] if isinstance(trainable, collections.abc.Mapping) else trainable
    )


def _backbone_non_trainable(weights) -> list:  # noqa: ANN001
    non_trainable = weights.non_trainable
    return list(
        non_trainable["backbone"]
        if isinstance(non_trainable, collections.abc.Mapping)
        else non_trainable
    )


_NOT_REPORTED = np.iinfo(np.int64).max


def _first_reports(max_reports: int) -> Callable:
    """A federated computation: (reported, arrival key) at CLIENTS -> kept, at CLIENTS.

    Keeps the `max_reports` reporting clients with the smallest arrival keys: the
    server collects the `max_reports` smallest keys of reporting clients (a fixed-size
    aggregate, so no client list leaves TFF) and broadcasts the largest of them.
    """
    key_type = tff.TensorType(np.int64)
    smallest_type = tff.TensorType(np.int64, [max_reports])

    @tff.tensorflow.computation(np.int32, np.int64)
    def report_key(reported, arrival_key):
        return tf.where(reported > 0, arrival_key, tf.constant(_NOT_REPORTED, tf.int64))

    @tff.tensorflow.computation(smallest_type, key_type)
    def accumulate(smallest, key):
        return tf.sort(tf.concat([smallest, [key]], 0))[:max_reports]

    @tff.tensorflow.computation(smallest_type, smallest_type)
    def merge(first, second):
        return tf.sort(tf.concat([first, second], 0))[:max_reports]

    @tff.tensorflow.computation(smallest_type)
    def last_kept_key(smallest):
        return smallest[-1]

    @tff.tensorflow.computation(np.int32, np.int64, np.int64)
    def is_kept(reported, arrival_key, threshold):
        # Fewer than max_reports reporters: the threshold stays _NOT_REPORTED, all kept.
        return tf.cast(tf.logical_and(reported > 0, arrival_key <= threshold), tf.int32)

    @tff.federated_computation(
        tff.FederatedType(np.int32, tff.CLIENTS), tff.FederatedType(np.int64, tff.CLIENTS)
    )
    def first_reports(reported, arrival_key):
        keys = tff.federated_map(report_key, (reported, arrival_key))
        threshold = tff.federated_aggregate(
            keys,
            np.full([max_reports], _NOT_REPORTED, np.int64),
            accumulate,
            merge,
            last_kept_key,
        )
        return tff.federated_map(
            is_kept, (reported, arrival_key, tff.federated_broadcast(threshold))
        )

    return first_reports


def train_one_client(
    backbone_config: model_config.BackboneConfig,
    config: ClientConfig,
    initial_weights: tff.learning.models.ModelWeights,
    dataset: tf.data.Dataset,
    round_num: int = 0,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """One DP-FedEmb virtual client's local training outside TFF, run eagerly.

    The same `_LocalTrainer` as the federated client work, for checking one client's
    behaviour (its budgets, its drop decision) without building a TFF process.
    Returns the unclipped backbone update (initial - final; zeros when the client is
    dropped) and the client's measurements.
    """
    trainer = _LocalTrainer(lambda: models.build_backbone(backbone_config), config, None)
    client_state = collections.OrderedDict(
        round_num=tf.constant(round_num, tf.int64),
        head_seed=tf.constant(config.head_seed, tf.int64),
    )
    result, measurements = tf.function(trainer.train)(initial_weights, dataset, client_state)
    return [t.numpy() for t in result.update], {
        name: value.numpy().item() for name, value in measurements.items()
    }


def _build_client_work(
    backbone_fn: Callable[[], tf.keras.Model],
    weights_type: tff.Type,
    element_spec: collections.OrderedDict,
    config: ClientConfig,
    global_head_vocabulary: np.ndarray | None,
    max_reports: int | None,
) -> tff.learning.templates.ClientWorkProcess:
    if max_reports is not None and max_reports < 1:
        raise ValueError(f"max_reports must be >= 1, got {max_reports}")
    data_type = tff.SequenceType(tff.types.tensorflow_to_type(element_spec))
    state_type = _client_state_type()

    @tff.tensorflow.computation(weights_type, data_type, state_type)
    def client_update(initial_weights, dataset, client_state):
        trainer = _LocalTrainer(backbone_fn, config, global_head_vocabulary)
        return tf.function(trainer.train)(initial_weights, dataset, client_state)

    @tff.tensorflow.computation
    def initial_state():
        return collections.OrderedDict(
            round_num=tf.constant(0, tf.int64), head_seed=tf.constant(config.head_seed, tf.int64)
        )

    @tff.tensorflow.computation(state_type)
    def advance_round(state):
        return collections.OrderedDict(
            round_num=state["round_num"] + 1, head_seed=state["head_seed"]
        )

    @tff.tensorflow.computation(np.int32)
    def not_reported(reported):
        return 1 - reported

    if max_reports is not None:
        first_reports = _first_reports(max_reports)
        result_type = client_update.type_signature.result[0]

        @tff.tensorflow.computation(result_type, np.int32)
        def zero_unless_kept(client_result, kept):
            return tff.learning.templates.ClientResult(
                update=tf.nest.map_structure(
                    lambda t: tf.where(kept > 0, t, tf.zeros_like(t)), client_result.update
                ),
                update_weight=client_result.update_weight,
            )

    @tff.federated_computation
    def init_fn():
        return tff.federated_eval(initial_state, tff.SERVER)

    @tff.federated_computation(
        tff.FederatedType(state_type, tff.SERVER),
        tff.FederatedType(weights_type, tff.CLIENTS),
        tff.FederatedType(data_type, tff.CLIENTS),
    )
    def next_fn(state, weights, client_data):
        client_result, client_measurements = tff.federated_map(
            client_update, (weights, client_data, tff.federated_broadcast(state))
        )
        reported = client_measurements.reported
        if max_reports is None:
            kept = reported
        else:
            kept = first_reports(reported, client_measurements.arrival_key)
            client_result = tff.federated_map(zero_unless_kept, (client_result, kept))
        measurements = collections.OrderedDict(
            num_examples=tff.federated_sum(client_measurements.num_examples),
            examples_over_head_capacity=tff.federated_sum(
                client_measurements.examples_over_head_capacity
            ),
            non_finite_updates=tff.federated_sum(client_measurements.non_finite_updates),
            failed_reads=tff.federated_sum(client_measurements.failed_reads),
            timed_out_clients=tff.federated_sum(client_measurements.timed_out_clients),
            dropped_clients=tff.federated_sum(
                tff.federated_map(not_reported, client_measurements.reported)
            ),
            reported_clients=tff.federated_sum(reported),
            kept_clients=tff.federated_sum(kept),
            mean_client_loss=tff.federated_mean(client_measurements.loss),
        )
        return tff.templates.MeasuredProcessOutput(
            tff.federated_map(advance_round, state), client_result, tff.federated_zip(measurements)
        )

    return tff.learning.templates.ClientWorkProcess(init_fn, next_fn)


def build_fedemb_client_work(
    backbone_fn: Callable[[], tf.keras.Model],
    backbone_weights_type: tff.Type,
    element_spec: collections.OrderedDict,
    config: ClientConfig,
    max_reports: int | None = None,
) -> tff.learning.templates.ClientWorkProcess:
    """DP-FedEmb client work: local head, backbone-only update.

    Args:
      backbone_fn: no-arg function building a fresh backbone (its initial values
        are overwritten by the broadcast weights).
      backbone_weights_type: `ModelWeights(trainable=[...], non_trainable=[...])`
        type of the backbone (`models.backbone_weights_type`).
      element_spec: client batch spec (`client_element_spec`).
      config: local training configuration.
      max_reports: keep at most this many reporting clients per round (over-selection:
        the round selects more); None keeps every client that reports.
    """
    return _build_client_work(
        backbone_fn, backbone_weights_type, element_spec, config, None, max_reports
    )


def build_fedavg_client_work(
    backbone_fn: Callable[[], tf.keras.Model],
    model_weights_type: tff.Type,
    element_spec: collections.OrderedDict,
    config: ClientConfig,
    identity_vocabulary: np.ndarray,
    max_reports: int | None = None,
) -> tff.learning.templates.ClientWorkProcess:
    """DP-FedAvg client work: the broadcast global head is trained and its update returned.

    `model_weights_type` is `ModelWeights(trainable=OrderedDict(backbone=[...],
    head=[kernel]), non_trainable=OrderedDict(backbone=[...]))`; the update has the
    `trainable` structure. `identity_vocabulary` is `identity_keys_vocabulary` of
    all training identities (one head row each, in that order). `max_reports` as in
    `build_fedemb_client_work`.
    """
    return _build_client_work(
        backbone_fn,
        model_weights_type,
        element_spec,
        config,
        np.asarray(identity_vocabulary),
        max_reports,
    )

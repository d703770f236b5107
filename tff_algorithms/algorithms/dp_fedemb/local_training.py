"""Local training of one DP-FedEmb (or DP-FedAvg) virtual client: the loop
(`LocalTrainer`) that `client_work` runs inside a TFF computation for every virtual
client, over the identity head of `modeling/identity_heads.py`.

The client's dataset is read once, by one op (`read_client`), and every pass gathers its
batches from those tensors in seeded shuffle orders (`ClientPasses`): no tf.data iterator
is made in the loop, since each one costs a function-library clone.

Identity remapping happens inside the client: identities become int64 keys
(`identity_heads.identity_keys`), a first pass over the virtual
client's data collects the sorted distinct keys, and an identity's local label is
its rank among them. Head rows at or beyond the number of local identities are
masked out of the softmax. Examples of identities beyond `head_capacity` are
dropped from the loss and counted in `examples_over_head_capacity` (the training
program should treat a non-zero count as a configuration error). For DP-FedAvg the
head is global: keys are looked up in the sorted keys of all training identities,
and unknown identities are dropped and counted the same way.

Shared negatives (issue 22): with `ClientConfig.shared_negative_rows` Q > 0 the client
state carries the server's released cluster centers ([Q, d], `shared_negatives`), and
`identity_heads.head_logits` appends one logit per center after the local rows: fixed negatives (no
label points at them), built from constants, so no gradient reaches them and they are
neither trained nor part of the update. All-zero rows (nothing released yet) are masked.
Each center's logit has PrivacyFace's cap margin (issue 42): with θ the angle between
the embedding and the center and ρ = `ClientConfig.shared_negative_cap`, the cosine
becomes cos(max(θ − ρ, 0)), so the whole cap of angle ρ around a released center (the
region its cluster covered) scores as if it were the center itself.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.config.client_config import HEAD_INIT_CLASS_MEANS, ClientConfig
from tff_algorithms.federated import client_data
from tff_algorithms.modeling import models
from tff_algorithms.modeling.identity_heads import (
    head_logits,
    head_loss,
    identity_keys,
    labels_in_vocabulary,
    zero_if_not_finite,
)

# More examples than any client holds: one batch of them all.
_ALL_EXAMPLES = 2**62
# Examples a class-mean first pass embeds at once.
_FIRST_PASS_BATCH = 64


def local_head_seed(
    head_seed: tf.Tensor, round_num: tf.Tensor, client_seed: tf.Tensor
) -> tf.Tensor:
    """Stateless seed of a local head, from (base seed, round, virtual client)."""
    base = tf.stack([tf.cast(head_seed, tf.int64), tf.cast(round_num, tf.int64)])
    return tf.random.experimental.stateless_fold_in(base, tf.cast(client_seed, tf.int64))


def _one_batch_of_all(dataset: tf.data.Dataset, empty: object) -> object:
    """Every element of `dataset` as one batch, by one `get_single_element` (no iterator
    in the graph); `empty`, zero-length tensors of the batch's structure, when there is
    no element."""
    return (
        dataset.batch(_ALL_EXAMPLES)
        .concatenate(tf.data.Dataset.from_tensors(empty))
        .take(1)
        .with_options(client_data.client_dataset_options())
        .get_single_element()
    )


class ClientExamples(NamedTuple):
    """A virtual client's examples in memory, in the loader's order, and its constants."""

    image: tf.Tensor  # float32 [N, ...]
    identity: tf.Tensor  # string or int64 [N]
    client_seed: tf.Tensor  # int64 []: 0 for a client with no example
    expected_examples: tf.Tensor  # int64 []: -1 when unknown or no example


def read_client(dataset: tf.data.Dataset) -> ClientExamples:
    """Every example of a client dataset, read in one op (the only read of it).

    Each pass of the local work then iterates these tensors. The read is one
    `get_single_element` rather than an iterator: an iterator made inside a graph clones
    the function library and instantiates every function of the pipeline (the reader's
    and decoder's maps and conds) anew, about 30 ms a virtual client, where this op reuses
    the instantiations of earlier calls in the same graph (BENCHMARKS.md, "Where a round's
    time goes"). A dataset that crosses a TFF computation boundary is rebuilt from its
    serialized graph in the receiving call, which instantiates its functions once a
    client again; training jobs therefore build it inside the client computation
    (`client_work.ClientLoader`).
    """
    spec = dataset.element_spec

    def per_example(batch):  # noqa: ANN001, ANN202 - a client batch
        size = tf.shape(batch["identity"])[:1]
        return (
            batch["image"],
            batch["identity"],
            tf.fill(size, batch["client_seed"]),
            tf.fill(size, batch["expected_examples"]),
        )

    # No example: zero-length tensors, so the client has no seed and an unknown count.
    nothing = (
        tf.zeros([0, *spec["image"].shape[1:]], spec["image"].dtype),
        tf.zeros([0], spec["identity"].dtype),
        tf.zeros([0], tf.int64),
        tf.zeros([0], tf.int64),
    )
    images, identities, seeds, expected = _one_batch_of_all(
        dataset.map(per_example).unbatch(), nothing
    )
    # Every batch carries the same constants; max() of none is the int64 minimum.
    any_example = tf.size(seeds) > 0
    return ClientExamples(
        images,
        identities,
        tf.where(any_example, tf.reduce_max(seeds), tf.constant(0, tf.int64)),
        tf.where(any_example, tf.reduce_max(expected), tf.constant(-1, tf.int64)),
    )


class ClientPasses:
    """The local work's passes over a client's examples, batch by batch, in the orders
    of a seeded shuffle (`tf.data`'s, with the client's seed, reshuffled every epoch).

    Every epoch's order comes from one `get_single_element` over the shuffled example
    indices, and a pass gathers its batches from the examples in memory: no iterator,
    so no function-library clone per pass (BENCHMARKS.md, "Where a round's time goes").
    Each epoch reshuffles (a shuffle's draws depend on its seed and length, not on its
    elements, so these are the orders the shuffled examples had).
    """

    def __init__(self, client: ClientExamples, config: ClientConfig, epochs: int) -> None:
        self.client = client
        self.batch_size = config.batch_size
        self.examples = tf.shape(client.identity, out_type=tf.int64)[0]
        self.batches_per_epoch = (self.examples + self.batch_size - 1) // self.batch_size
        # [epochs * examples]: epoch e's order is [e * examples, (e + 1) * examples).
        self.order = _one_batch_of_all(
            tf.data.Dataset.range(self.examples)
            .shuffle(config.shuffle_buffer, seed=client.client_seed, reshuffle_each_iteration=True)
            .repeat(epochs),
            tf.zeros([0], tf.int64),
        )

    def batch(self, step: tf.Tensor) -> collections.OrderedDict:
        """`{"image", "identity"}` of batch `step`, counted across epochs."""
        epoch = step // self.batches_per_epoch
        start = step % self.batches_per_epoch * self.batch_size
        end = tf.minimum(start + self.batch_size, self.examples)
        indices = self.order[epoch * self.examples + start : epoch * self.examples + end]
        return collections.OrderedDict(
            image=tf.gather(self.client.image, indices),
            identity=tf.gather(self.client.identity, indices),
        )

    def fold(
        self,
        steps: tf.Tensor,
        initial_state: object,
        step: Callable[[object, collections.OrderedDict], object],
        shape_invariants: object = None,
    ) -> object:
        """`step` over batches 0 .. `steps` - 1, as a while loop in the enclosing graph.

        One iteration at a time (`parallel_iterations=1`): the steps assign variables
        that the next step reads. `shape_invariants` (the state's structure of
        `tf.TensorShape`s) for states whose shapes change across steps.
        """

        def body(index, state):  # noqa: ANN001, ANN202 - loop variables
            return index + 1, step(state, self.batch(index))

        invariants = None if shape_invariants is None else (tf.TensorShape([]), shape_invariants)
        _, state = tf.while_loop(
            lambda index, state: index < steps,
            body,
            (tf.constant(0, tf.int64), initial_state),
            shape_invariants=invariants,
            parallel_iterations=1,
        )
        return state


class LocalTrainer:
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
            learning_rate=config.client_learning_rate, momentum=config.momentum or None
        )
        self.head_optimizer = tff.learning.optimizers.build_sgdm(
            learning_rate=config.head_learning_rate, momentum=config.momentum or None
        )

    def _first_pass(self, client: ClientExamples) -> tuple[tf.Tensor, tf.Tensor | None]:
        """First pass: sorted distinct identity keys and, with `class_means`, the initial
        head (each row its identity's mean unit embedding). Neither depends on the order
        of the examples, so it runs over them as read, in large batches."""
        with_means = self.config.head_init == HEAD_INIT_CLASS_MEANS
        keys = identity_keys(client.identity)
        vocabulary = tf.sort(tf.unique(keys).y)
        if not with_means:
            return vocabulary, None
        embeddings = self._unit_embeddings(client.image)
        labels, usable = labels_in_vocabulary(keys, vocabulary, self.num_head_rows)
        sums = tf.math.unsorted_segment_sum(
            tf.boolean_mask(embeddings, usable),
            tf.boolean_mask(labels, usable),
            self.num_head_rows,
        )
        # Rows of absent identities stay zero (they are masked out of the loss anyway).
        head = self.config.class_means_norm * tf.math.l2_normalize(sums, axis=1)
        return vocabulary, tf.transpose(head)

    def _unit_embeddings(self, images: tf.Tensor) -> tf.Tensor:
        """Unit-length inference embeddings [N, d] of `images`, `_FIRST_PASS_BATCH` at a
        time (larger kernels than the local steps' batches; GroupNorm normalises each
        example alone, so an embedding does not depend on its batch)."""
        size = max(self.config.batch_size, _FIRST_PASS_BATCH)
        count = tf.shape(images)[0]

        def body(start, embeddings):  # noqa: ANN001, ANN202 - loop variables
            batch = self.backbone(images[start : start + size], training=False)
            return start + size, tf.concat([embeddings, tf.math.l2_normalize(batch, axis=1)], 0)

        _, embeddings = tf.while_loop(
            lambda start, _: start < count,
            body,
            (tf.constant(0), tf.zeros([0, self.embedding_size])),
            shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, self.embedding_size])),
        )
        return embeddings

    # Written graph-first (explicit while loops and conds, `tf.equal`), so AutoGraph has
    # nothing to convert; left on, it rewrote this method and every function it calls
    # in every process that traces it (BENCHMARKS.md, "The test suite and CI").
    @tf.autograph.experimental.do_not_convert
    def train(self, initial_weights, dataset, client_state):  # noqa: ANN001, ANN201 - TFF structures
        backbone_variables = list(self.backbone.trainable_weights)
        for variable, value in zip(
            backbone_variables + list(self.backbone.non_trainable_weights),
            _backbone_trainable(initial_weights) + _backbone_non_trainable(initial_weights),
        ):
            variable.assign(value)
        client = read_client(dataset)
        passes = ClientPasses(client, self.config, self.config.local_epochs)

        negatives = None
        if self.config.shared_negative_rows:
            # Broadcast with the client state; read only, never returned.
            negatives = tf.convert_to_tensor(client_state["shared_negatives"], tf.float32)
        if self.vocabulary is None:
            vocabulary, class_means = self._first_pass(client)
            if class_means is None:
                seed = local_head_seed(
                    client_state["head_seed"], client_state["round_num"], client.client_seed
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
                    embeddings,
                    self.head,
                    labels,
                    self.config.head_loss,
                    num_active_rows,
                    negatives=negatives,
                    negative_cap=self.config.shared_negative_cap,
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
            training_state, rows_read, timed_out = state
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
        steps = self.config.local_epochs * passes.batches_per_epoch
        if max_steps is not None:
            steps = tf.minimum(steps, max_steps + 1)
        training_state, rows_read, timed_out = passes.fold(
            steps, (initial_training_state, tf.constant(0, tf.int64), tf.constant(False)), step
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
            tf.logical_and(
                client.expected_examples >= 0,
                rows_read < client.expected_examples * self.config.local_epochs,
            ),
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
            arrival_key=client.client_seed,
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

"""Client work of DP-FedEmb (paper Alg. 1) and of the DP-FedAvg baseline (Alg. 2).

A virtual client (k users' data) starts from the broadcast backbone θ and, for
DP-FedEmb, a freshly initialised LOCAL head: `head_capacity` bias-free rows, one
per local identity. It fine-tunes the backbone with learning rate β1 and the head
with β2 = head_learning_rate_scale·β1 (SGD, optional momentum), and returns only
the backbone update. The local head never leaves the client computation.

Client dataset: one element is one batch of one virtual client::

    OrderedDict(
        image=float32[None, H, W, C],       # values in [0, 1]; with cached features
                                             # the frozen prefix's outputs (`feature_cache`)
        identity=int64[None] | string[None], # the raw identity: a name or a global id
        client_seed=int64[],                 # the same in every batch of a virtual client
        expected_examples=int64[],           # examples the loader should yield (capped at
                                             # max_examples); -1 when it cannot say
    )

`make_client_dataset(examples, virtual_client_id, config)` builds it from per-example
elements `{"image": float32[H, W, C], "identity": string or int64 scalar}` (what a
data loader produces for the users of one virtual client): it caps the examples,
batches them in the loader's order and attaches `client_seed`, a hash of the
virtual-client id, with which the client work shuffles every pass.
Virtual-client ids are expected to be unique per round (the schedule regroups users
every round), so seeds differ across rounds; the round number is folded in as well.

Where the data comes from. A process built with a `ClientLoader` (what every training
job uses) takes virtual-client ids: each client computation receives its id and builds
its client dataset inside its own graph (`ClientLoader.client_dataset`), so nothing but
the id crosses the computation boundary, and the reader's and decoder's functions are
instantiated once per worker session, not rebuilt from a serialized dataset for every
client (BENCHMARKS.md, "Where a round's time goes"). Without one, the process takes
client batches as above (tests, and callers that hold datasets already).

Identity remapping and the local training loop: `local_training`.

Update convention (TFF's): the update is `initial - final` weights, so the server
optimizer SGD with learning rate 1 reproduces plain averaging.

Dropped virtual clients (stragglers and failures). A TFF simulation cannot lose a
client the way a device fleet does, so failures are modelled inside the computation,
and a dropped client returns an all-zero update and is counted, never stops the round:
- a failed read: `make_client_dataset` skips elements whose reading raises
  (`ignore_errors`; the loader must raise per element, see `ClientLoader`), and a client
  that yields fewer examples than `expected_examples`, or none at all, is dropped
  (`failed_reads`);
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

Shared negatives (issue 22): with `ClientConfig.shared_negative_rows` Q > 0 the client
work's state, which the server broadcasts to every virtual client each round, also holds
`shared_negatives` (float32 [Q, embedding_size], zeros until the first release): the
DPLC-released cluster centers the training program sets before a release round
(`shared_negatives.with_shared_negatives`). Clients read them as fixed negative head
rows (`local_training`) and return only the backbone update, as without them. They sit
in the server state (and its checkpoints), never in the model weights or the export.

Client measurements (losses, counts) are computed on training users WITHOUT
privacy; they are for monitoring only and must not be released.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.algorithms.dp_fedemb.local_training import LocalTrainer
from tff_algorithms.config import model_config
from tff_algorithms.config.client_config import (
    ClientConfig,
)
from tff_algorithms.federated import client_data
from tff_algorithms.modeling import models
from tff_algorithms.modeling.identity_heads import KEY_BUCKETS


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
    return tf.strings.to_hash_bucket_fast(virtual_client_id, KEY_BUCKETS)


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
    decides their order) and batches them in that order; the client work reads it once
    (`local_training.read_client`) and shuffles each pass with the `client_seed`, a hash
    of the virtual-client id (`local_training.ClientPasses`). `expected_examples` is how
    many examples the loader should yield (None: unknown); the client work drops a
    client that yields fewer. Usable inside a TFF dataset computation.
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
        .batch(config.batch_size)
        .map(
            lambda b: collections.OrderedDict(
                image=b["image"],
                identity=b["identity"],
                client_seed=seed,
                expected_examples=expected,
            )
        )
        .with_options(client_data.client_dataset_options())
    )


@dataclasses.dataclass(frozen=True)
class ClientLoader:
    """How a client computation loads its virtual client's data from the id.

    `load_examples` maps a virtual-client id (scalar tf.string) to a dataset of
    per-example `{"image", "identity"}` elements; it must be traceable by `tf.function`
    (e.g. read the virtual client's shard files with tf.data). Elements whose reading
    raises are skipped, so a read error must fail its element and move on (an error in
    a `map`), not repeat forever (a file source that keeps failing, such as a
    `FixedLengthRecordDataset` on a missing file, would hang the round).
    `expected_examples` maps the id to the number of examples the loader should yield
    (traceable); a virtual client that yields fewer is dropped from the round. None:
    unknown. `seed_name` maps the id to the string the client's seeds (shuffle, local
    head, fault injection) hash; None: the whole id.
    """

    load_examples: Callable[[tf.Tensor], tf.data.Dataset]
    expected_examples: Callable[[tf.Tensor], tf.Tensor] | None = None
    seed_name: Callable[[tf.Tensor], tf.Tensor] | None = None

    def client_dataset(self, virtual_client_id: tf.Tensor, config: ClientConfig) -> tf.data.Dataset:
        """The client batches of one virtual client (`make_client_dataset`)."""
        return make_client_dataset(
            self.load_examples(virtual_client_id),
            virtual_client_id if self.seed_name is None else self.seed_name(virtual_client_id),
            config,
            None if self.expected_examples is None else self.expected_examples(virtual_client_id),
        )


def _client_data_type(client_input: collections.OrderedDict | ClientLoader) -> tff.SequenceType:
    """Client batches (`client_element_spec`), or with a loader a dataset of the one id."""
    if isinstance(client_input, ClientLoader):
        return tff.SequenceType(tff.TensorType(np.str_))
    return tff.SequenceType(tff.types.tensorflow_to_type(client_input))


def _client_state_type(negatives_shape: tuple[int, int] | None) -> tff.Type:
    fields = [("round_num", np.int64), ("head_seed", np.int64)]
    if negatives_shape is not None:
        fields.append(("shared_negatives", tff.TensorType(np.float32, negatives_shape)))
    return tff.StructWithPythonType(fields, collections.OrderedDict)


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
    shared_negatives: np.ndarray | None = None,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """One DP-FedEmb virtual client's local training outside TFF, run eagerly.

    The same `LocalTrainer` as the federated client work, for checking one client's
    behaviour (its budgets, its drop decision) without building a TFF process.
    Returns the unclipped backbone update (initial - final; zeros when the client is
    dropped) and the client's measurements. `shared_negatives` [Q, d]: the broadcast
    centers when `config.shared_negative_rows` is Q (None: zeros, nothing released).
    """
    trainer = LocalTrainer(lambda: models.build_backbone(backbone_config), config, None)
    client_state = collections.OrderedDict(
        round_num=tf.constant(round_num, tf.int64),
        head_seed=tf.constant(config.head_seed, tf.int64),
    )
    if config.shared_negative_rows:
        shape = (config.shared_negative_rows, backbone_config.embedding_size)
        client_state["shared_negatives"] = tf.constant(
            np.zeros(shape, np.float32) if shared_negatives is None else shared_negatives,
            tf.float32,
        )
    result, measurements = tf.function(trainer.train)(initial_weights, dataset, client_state)
    return [t.numpy() for t in result.update], {
        name: value.numpy().item() for name, value in measurements.items()
    }


def _build_client_work(
    backbone_fn: Callable[[], tf.keras.Model],
    weights_type: tff.Type,
    client_input: collections.OrderedDict | ClientLoader,
    config: ClientConfig,
    global_head_vocabulary: np.ndarray | None,
    max_reports: int | None,
    embedding_size: int | None = None,
) -> tff.learning.templates.ClientWorkProcess:
    if max_reports is not None and max_reports < 1:
        raise ValueError(f"max_reports must be >= 1, got {max_reports}")
    negatives_shape = None
    if config.shared_negative_rows:
        if global_head_vocabulary is not None or embedding_size is None:
            raise ValueError("shared negatives need a local head and the embedding size")
        negatives_shape = (config.shared_negative_rows, embedding_size)
    data_type = _client_data_type(client_input)
    state_type = _client_state_type(negatives_shape)

    def with_negatives(state: collections.OrderedDict, negatives: tf.Tensor | None):
        # The state keeps its structure; the training program replaces the centers.
        if negatives_shape is not None:
            state["shared_negatives"] = negatives
        return state

    @tff.tensorflow.computation(weights_type, data_type, state_type)
    def client_update(initial_weights, dataset, client_state):
        if isinstance(client_input, ClientLoader):
            dataset = client_input.client_dataset(dataset.get_single_element(), config)
        trainer = LocalTrainer(backbone_fn, config, global_head_vocabulary)
        return tf.function(trainer.train)(initial_weights, dataset, client_state)

    @tff.tensorflow.computation
    def initial_state():
        state = collections.OrderedDict(
            round_num=tf.constant(0, tf.int64), head_seed=tf.constant(config.head_seed, tf.int64)
        )
        return with_negatives(
            state, None if negatives_shape is None else tf.zeros(negatives_shape, tf.float32)
        )

    @tff.tensorflow.computation(state_type)
    def advance_round(state):
        advanced = collections.OrderedDict(
            round_num=state["round_num"] + 1, head_seed=state["head_seed"]
        )
        return with_negatives(advanced, state.get("shared_negatives"))

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
    client_input: collections.OrderedDict | ClientLoader,
    config: ClientConfig,
    max_reports: int | None = None,
    embedding_size: int | None = None,
) -> tff.learning.templates.ClientWorkProcess:
    """DP-FedEmb client work: local head, backbone-only update.

    Args:
      backbone_fn: no-arg function building a fresh backbone (its initial values
        are overwritten by the broadcast weights).
      backbone_weights_type: `ModelWeights(trainable=[...], non_trainable=[...])`
        type of the backbone (`models.backbone_weights_type`).
      client_input: the client batch spec (`client_element_spec`): the client data
        are datasets of client batches; or a `ClientLoader`: the client data are
        datasets of one virtual-client id each, loaded inside the client computation.
      config: local training configuration.
      max_reports: keep at most this many reporting clients per round (over-selection:
        the round selects more); None keeps every client that reports.
      embedding_size: the backbone's embedding size; needed with shared negatives
        (`config.shared_negative_rows` > 0), the width of their rows in the state.
    """
    return _build_client_work(
        backbone_fn,
        backbone_weights_type,
        client_input,
        config,
        None,
        max_reports,
        embedding_size,
    )


def build_fedavg_client_work(
    backbone_fn: Callable[[], tf.keras.Model],
    model_weights_type: tff.Type,
    client_input: collections.OrderedDict | ClientLoader,
    config: ClientConfig,
    identity_vocabulary: np.ndarray,
    max_reports: int | None = None,
) -> tff.learning.templates.ClientWorkProcess:
    """DP-FedAvg client work: the broadcast global head is trained and its update returned.

    `model_weights_type` is `ModelWeights(trainable=OrderedDict(backbone=[...],
    head=[kernel]), non_trainable=OrderedDict(backbone=[...]))`; the update has the
    `trainable` structure. `identity_vocabulary` is `identity_keys_vocabulary` of
    all training identities (one head row each, in that order). `client_input` and
    `max_reports` as in `build_fedemb_client_work`.
    """
    return _build_client_work(
        backbone_fn,
        model_weights_type,
        client_input,
        config,
        np.asarray(identity_vocabulary),
        max_reports,
    )

"""DP-FedEmb's family of learning processes: the FedEmb and FedAvg process shapes.

As in `tff.learning.algorithms`, one builder per process shape, and privacy is the aggregator parameter: a builder takes
an aggregator factory and a server optimizer and composes
`compose_learning_process(initial_weights_fn, broadcast, client_work, aggregator,
finalizer)`. DP-FedEmb and DP-FTRL-FedEmb are `build_fedemb_process`, DP-FedAvg is
`build_fedavg_process`, each given the aggregator that `mechanisms.aggregator_for_spec`
builds from the job's accounting spec (Gaussian or tree-aggregated noise) and the
optimizer `server_optimizer` builds (momentum SGD, `server_sgdm`; or Adam or LAMB,
`server_optimizers`).

Global model weights:
- DP-FedEmb / DP-FTRL-FedEmb: the backbone only,
  `ModelWeights(trainable=[...], non_trainable=[...])` in Keras variable order.
  No head exists anywhere in the server state, broadcast or aggregate.
- DP-FedAvg: `ModelWeights(trainable=OrderedDict(backbone=[...], head=[kernel]),
  non_trainable=OrderedDict(backbone=[...]))`; the global head has one row per
  training identity and is aggregated and noised with the backbone.
`backbone_model_weights` extracts the backbone from either layout. A process built with
a `feature_cut` trains the backbone's suffix after the cut on cached features of the
frozen prefix (`feature_cache`): its "backbone" weights are the suffix's, the trainable
ones the same variables in the same order as the whole backbone's.

Initial weights come from `backbone_seed`; to start from a pretrained backbone,
call `process.set_model_weights(state, weights)` with
`models.backbone_weights(models.load_pretrained_backbone(...))`.

Client data: given a `client_loader` (`client_work.ClientLoader`, what training jobs
use), the process's `next` takes virtual-client ids at CLIENTS and each client
computation loads its own data from its id; without one, `next` takes CLIENTS-placed
sequences of client batches (`client_work.client_element_spec`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.algorithms.dp_fedemb import client_work, server_optimizers
from tff_algorithms.config import model_config
from tff_algorithms.config.client_config import ClientConfig
from tff_algorithms.federated.feature_cache import FeatureCut
from tff_algorithms.modeling import models


def _trained_model(
    config: model_config.BackboneConfig, cut: FeatureCut | None, seed: int = 0
) -> tf.keras.Model:
    """The model a process trains: the backbone, or with cached features its suffix."""
    model = models.build_backbone(config, seed)
    return model if cut is None else cut.suffix(model)


def _input_shape(config: model_config.BackboneConfig, cut: FeatureCut | None) -> tuple[int, ...]:
    return config.image_shape if cut is None else cut.feature_shape


def _backbone_fn(
    config: model_config.BackboneConfig, cut: FeatureCut | None
) -> Callable[[], tf.keras.Model]:
    return lambda: _trained_model(config, cut)


def _initial_backbone_weights_fn(
    config: model_config.BackboneConfig, seed: int, cut: FeatureCut | None
) -> tff.Computation:
    @tff.tensorflow.computation
    def initial_weights():
        model = _trained_model(config, cut, seed)
        return tff.learning.models.ModelWeights(
            trainable=[v.read_value() for v in model.trainable_weights],
            non_trainable=[v.read_value() for v in model.non_trainable_weights],
        )

    return initial_weights


def _initial_fedavg_weights_fn(
    config: model_config.BackboneConfig, seed: int, num_identities: int, cut: FeatureCut | None
) -> tff.Computation:
    @tff.tensorflow.computation
    def initial_weights():
        model = _trained_model(config, cut, seed)
        head = models.initial_head_kernel(
            tf.constant([seed, -1], tf.int64), config.embedding_size, num_identities
        )
        return tff.learning.models.ModelWeights(
            trainable=collections.OrderedDict(
                backbone=[v.read_value() for v in model.trainable_weights], head=[head]
            ),
            non_trainable=collections.OrderedDict(
                backbone=[v.read_value() for v in model.non_trainable_weights]
            ),
        )

    return initial_weights


def _client_input(
    config: model_config.BackboneConfig,
    cut: FeatureCut | None,
    identity_dtype: tf.DType,
    loader: client_work.ClientLoader | None,
) -> collections.OrderedDict | client_work.ClientLoader:
    if loader is not None:
        return loader
    return client_work.client_element_spec(_input_shape(config, cut), identity_dtype)


def _compose(
    initial_weights_fn: tff.Computation,
    client_work_process: tff.learning.templates.ClientWorkProcess,
    aggregator_factory: tff.aggregators.UnweightedAggregationFactory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    client_loader: client_work.ClientLoader | None,
) -> tff.learning.templates.LearningProcess:
    weights_type = initial_weights_fn.type_signature.result
    # DP aggregation is unweighted: every virtual client counts once, and the
    # denominator is the planned number of clients, never the reported weights.
    aggregator = tff.aggregators.as_weighted_aggregator(aggregator_factory).create(
        weights_type.trainable, tff.TensorType(np.float32)
    )
    process = tff.learning.templates.compose_learning_process(
        initial_weights_fn,
        tff.learning.templates.build_broadcast_process(weights_type),
        client_work_process,
        aggregator,
        tff.learning.templates.build_apply_optimizer_finalizer(server_optimizer, weights_type),
    )
    return process if client_loader is None else _taking_virtual_client_ids(process)


def server_sgdm(learning_rate: float, momentum: float) -> tff.learning.optimizers.Optimizer:
    """The server optimizer of every federated algorithm: SGD with momentum (paper, Alg. 1).

    With tree-aggregated noise and a constant learning rate this is DP-FTRL with momentum.
    """
    # build_sgdm treats momentum=None as plain SGD (no momentum state).
    return tff.learning.optimizers.build_sgdm(
        learning_rate=learning_rate, momentum=momentum or None
    )


def server_optimizer(
    name: str, learning_rate: float, momentum: float
) -> tff.learning.optimizers.Optimizer:
    """The server optimizer `name` (`model_config.OPTIMIZERS`, the job's
    `server_optimizer`): momentum SGD (`server_sgdm`), or Adam or LAMB
    (`server_optimizers.ServerAdamLamb`, whose momentum is its beta1: `momentum` must be 0)."""
    if name == model_config.SGD:
        return server_sgdm(learning_rate, momentum)
    if name not in (model_config.ADAM, model_config.LAMB) or momentum:
        raise ValueError(
            f"server optimizer {name!r} with momentum {momentum:g}: choose one of "
            f"{', '.join(model_config.OPTIMIZERS)}, with momentum only for sgd"
        )
    return server_optimizers.ServerAdamLamb(learning_rate, layerwise=name == model_config.LAMB)


def build_fedemb_process(
    backbone_config: model_config.BackboneConfig,
    client_config: ClientConfig,
    aggregator_factory: tff.aggregators.UnweightedAggregationFactory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    *,
    identity_dtype: tf.DType = tf.string,
    backbone_seed: int = 0,
    max_reports: int | None = None,
    feature_cut: FeatureCut | None = None,
    client_loader: client_work.ClientLoader | None = None,
) -> tff.learning.templates.LearningProcess:
    """FedEmb with any aggregator (`mechanisms.aggregator_for_spec` for DP-FedEmb and
    DP-FTRL-FedEmb; `aggregators.no_dp` or `gaussian_adaptive` for ablations and tuning).

    `max_reports`: keep only the first this many reporting virtual clients of a round
    (over-selection; the aggregator's denominator is the planned number either way).
    `feature_cut`: train only the backbone's suffix after this cut, on cached features
    of the frozen prefix (`feature_cache`); the weights are then the suffix's.
    `client_loader`: `next` takes virtual-client ids and the client computations load
    their data (module docstring); None: `next` takes client batches.
    """
    initial_weights_fn = _initial_backbone_weights_fn(backbone_config, backbone_seed, feature_cut)
    work = client_work.build_fedemb_client_work(
        _backbone_fn(backbone_config, feature_cut),
        initial_weights_fn.type_signature.result,
        _client_input(backbone_config, feature_cut, identity_dtype, client_loader),
        client_config,
        max_reports,
        embedding_size=backbone_config.embedding_size,
    )
    return _compose(initial_weights_fn, work, aggregator_factory, server_optimizer, client_loader)


def build_fedavg_process(
    backbone_config: model_config.BackboneConfig,
    client_config: ClientConfig,
    identity_vocabulary: np.ndarray,
    aggregator_factory: tff.aggregators.UnweightedAggregationFactory,
    server_optimizer: tff.learning.optimizers.Optimizer,
    *,
    identity_dtype: tf.DType = tf.string,
    backbone_seed: int = 0,
    max_reports: int | None = None,
    feature_cut: FeatureCut | None = None,
    client_loader: client_work.ClientLoader | None = None,
) -> tff.learning.templates.LearningProcess:
    """FedAvg with a global head over `identity_vocabulary`, with any aggregator.

    DP-FedAvg (paper Alg. 2): the Gaussian aggregator of `mechanisms.aggregator_for_spec`
    clips and noises the backbone and global head together.

    `identity_vocabulary` is `identity_heads.identity_keys_vocabulary(all training identities)`;
    `max_reports`, `feature_cut` and `client_loader` as in `build_fedemb_process`.
    """
    initial_weights_fn = _initial_fedavg_weights_fn(
        backbone_config, backbone_seed, len(identity_vocabulary), feature_cut
    )
    work = client_work.build_fedavg_client_work(
        _backbone_fn(backbone_config, feature_cut),
        initial_weights_fn.type_signature.result,
        _client_input(backbone_config, feature_cut, identity_dtype, client_loader),
        client_config,
        identity_vocabulary,
        max_reports,
    )
    return _compose(initial_weights_fn, work, aggregator_factory, server_optimizer, client_loader)


def _taking_virtual_client_ids(
    process: tff.learning.templates.LearningProcess,
) -> tff.learning.templates.LearningProcess:
    """`process`, whose client data are datasets of one id, taking the ids themselves."""

    @tff.tensorflow.computation(tff.TensorType(np.str_))
    def one_id(virtual_client_id):
        return tf.data.Dataset.from_tensors(virtual_client_id)

    return tff.simulation.compose_dataset_computation_with_learning_process(one_id, process)


def backbone_model_weights(
    model_weights: tff.learning.models.ModelWeights,
) -> tff.learning.models.ModelWeights:
    """The backbone part of a process's global model weights (either layout)."""
    if isinstance(model_weights.trainable, collections.abc.Mapping):
        return tff.learning.models.ModelWeights(
            trainable=list(model_weights.trainable["backbone"]),
            non_trainable=list(model_weights.non_trainable["backbone"]),
        )
    return tff.learning.models.ModelWeights(
        trainable=list(model_weights.trainable), non_trainable=list(model_weights.non_trainable)
    )

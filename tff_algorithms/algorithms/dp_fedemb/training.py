"""DP-FedEmb's, DP-FTRL-FedEmb's and DP-FedAvg's trainer: the training loop
(`jobs/loop.py`) given a round of the federated TFF process (`federated/rounds.py`) over
the job's virtual-client schedule.

`run_train_job` (tff_algorithms/jobs/train_job.py) resolves the job's inputs and calls
`train_dp_fedemb` (local heads; DP-FTRL-FedEmb is the same trainer with the tree
mechanism and the epoch schedule its spec names) or `train_dp_fedavg` (a global head
over the training identities, aggregated and noised with the backbone). The process is a
shape (`processes.build_fedemb_process` / `build_fedavg_process`) given the aggregator
`mechanisms.aggregator_for_spec` builds from the job's accounting spec, the one the
ledger accounts with; its noise seed lives in the aggregator state, which the loop
checkpoints every round as a `checkpoints.StructureState`. A job
that trains a suffix of the backbone trains it on cached features of the frozen prefix
(`feature_cache`); shared negatives release DPLC centres before their rounds
(`shared_negatives`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow_federated as tff

from beam_jobs import schedule
from tff_algorithms.algorithms.dp_fedemb import client_work, mechanisms, processes
from tff_algorithms.config import loop_schedule
from tff_algorithms.config.job_config import TrainJobConfig
from tff_algorithms.config.job_plan import schedule_for
from tff_algorithms.federated import client_data, feature_cache, rounds
from tff_algorithms.jobs import job_outputs, loop
from tff_algorithms.jobs.checkpoints import StructureState
from tff_algorithms.jobs.job_inputs import JobInputs
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.modeling import identity_heads, models


def _shared_negatives_hook(
    inputs: JobInputs,
    process: tff.learning.templates.LearningProcess,
    backbone_of: Callable[[Any], tff.learning.models.ModelWeights],
) -> Callable[[int, Any], Any] | None:
    """Before each release round: release DPLC centers with the current backbone and
    put them in the state the round broadcasts (`shared_negatives`); None without them."""
    config = inputs.config
    if config.shared_negatives is None:
        return None
    from tff_algorithms.algorithms.dp_fedemb import shared_negatives

    plan = config.shared_negatives.release_plan()
    releaser = shared_negatives.CenterReleaser(
        config.shared_negatives,
        config.backbone_config,
        inputs.reader,
        inputs.user_ids,
        public_seed=config.seed,
        noise_seed=config.noise_seed,
        max_examples_per_user=config.max_examples_per_client,
    )

    def before_round(round_num: int, state: Any) -> Any:
        if not plan.is_release_round(round_num):
            return state
        backbone = backbone_of(state)
        previous = shared_negatives.shared_negatives_of(state)
        rows = releaser.release(round_num // plan.every_rounds, backbone, previous)
        return shared_negatives.with_shared_negatives(state, rows)

    return before_round


def _build_process(
    inputs: JobInputs,
    plan: schedule.VirtualClientSchedule,
    cached: feature_cache.CachedFeatures | None,
    cut: feature_cache.FeatureCut | None,
    global_head: bool,
) -> tff.learning.templates.LearningProcess:
    # The process shape comes from the algorithm (DP-FedAvg's global head or local heads); the mechanism (Gaussian or tree noise,
    # its noise multiplier and restarts) only from the spec the ledger accounts with.
    config = inputs.config
    client_config = config.client_config()
    aggregator = mechanisms.aggregator_for_spec(
        inputs.spec,
        clip_norm=float(config.clip_norm),
        virtual_clients_per_round=config.virtual_clients_per_round,
        noise_seed=loop_schedule.job_noise_seed(config.noise_seed),
        rounds_per_epoch=plan.rounds_per_epoch,
    )
    server_optimizer = processes.server_optimizer(
        config.server_optimizer, config.server_learning_rate, config.server_momentum
    )
    image_shape = config.image_shape
    shape_options = dict(
        backbone_seed=config.seed,
        max_reports=config.report_policy().max_reports,
        feature_cut=cut,
        client_loader=client_work.ClientLoader(
            (lambda vc_id: client_data.load_examples(vc_id, image_shape))
            if cached is None
            else cached.load_examples,
            client_data.expected_examples,
            client_data.seed_name,
        ),
    )
    if global_head:
        vocabulary = identity_heads.training_identity_vocabulary(inputs.reader, inputs.user_ids)
        return processes.build_fedavg_process(
            config.backbone_config,
            client_config,
            vocabulary,
            aggregator,
            server_optimizer,
            **shape_options,
        )
    return processes.build_fedemb_process(
        config.backbone_config, client_config, aggregator, server_optimizer, **shape_options
    )


def _with_backbone(
    process: tff.learning.templates.LearningProcess,
    state: Any,
    backbone: tff.learning.models.ModelWeights,
) -> Any:
    weights = process.get_model_weights(state)
    if isinstance(weights.trainable, Mapping):  # DP-FedAvg: keep the initial global head
        weights = tff.learning.models.ModelWeights(
            trainable={**weights.trainable, "backbone": list(backbone.trainable)},
            non_trainable={**weights.non_trainable, "backbone": list(backbone.non_trainable)},
        )
    else:
        weights = backbone
    return process.set_model_weights(state, weights)


def _head_capacity_check(config: TrainJobConfig, global_head: bool) -> Callable[[int, Any], None]:
    capacity = config.client_config().head_capacity

    def check(round_number: int, training_metrics: Any) -> None:
        dropped = int(training_metrics["client_work"]["examples_over_head_capacity"])
        if dropped:
            cause = (
                f"exceed the local head capacity {capacity}; raise head_capacity"
                if not global_head
                else "have identities outside the training vocabulary"
            )
            raise ValueError(f"round {round_number}: {dropped} training examples {cause}")

    return check


def feature_cache_decision(config: TrainJobConfig) -> feature_cache.CutDecision:
    """Whether a federated job trains on cached features, and after which cut (None:
    `cache_features` false, shared negatives, or the trained layers have no frozen
    prefix; `TrainJobConfig` refuses `cache_features: true` in those cases)."""
    if config.cache_features is False:
        return feature_cache.CutDecision(None, "cache_features is false")
    if config.shared_negatives is not None:
        return feature_cache.CutDecision(
            None, "shared negatives embed images with the whole backbone each release"
        )
    return feature_cache.cut_for(config.backbone_config)


class _SuffixTraining:
    """A federated job on cached features: the process trains the suffix after `cut`,
    the frozen prefix keeps the start backbone's values, and the backbone a round
    evaluates, releases centers with or exports is the two put back together."""

    def __init__(self, inputs: JobInputs, cut: feature_cache.FeatureCut) -> None:
        config = inputs.config
        self._backbone = models.build_backbone(config.backbone_config, config.seed)
        if inputs.pretrained is not None:
            models.assign_backbone_weights(self._backbone, inputs.pretrained)
        self._suffix = cut.suffix(self._backbone)
        self.start = models.backbone_weights(self._suffix)
        self.cached = feature_cache.ensure_cache(
            inputs.partition_dir,
            inputs.feature_cache_dir,
            config.backbone_config,
            self._backbone,
            cut,
        )

    def backbone(
        self, suffix_weights: tff.learning.models.ModelWeights
    ) -> tff.learning.models.ModelWeights:
        models.assign_backbone_weights(self._suffix, suffix_weights)
        return models.backbone_weights(self._backbone)


def train_dp_fedemb(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """DP-FedEmb's and DP-FTRL-FedEmb's trainer (`tff_algorithms/algorithms/dp_fedemb/__init__.py`):
    local heads; the spec's mechanism and schedule come with `inputs`."""
    return _train_federated(inputs, schedule_seed, global_head=False)


def train_dp_fedavg(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """DP-FedAvg's trainer: the backbone and a global head over the training identities."""
    return _train_federated(inputs, schedule_seed, global_head=True)


def _train_federated(inputs: JobInputs, schedule_seed: int, *, global_head: bool) -> JobOutcome:
    config, user_ids = inputs.config, inputs.user_ids
    plan = schedule_for(config, len(user_ids), schedule_seed)
    decision = feature_cache_decision(config)
    cut = decision.cut
    began = time.perf_counter()
    suffix = None if cut is None else _SuffixTraining(inputs, cut)
    cache_facts = feature_cache.cache_facts(
        decision, None if suffix is None else suffix.cached, time.perf_counter() - began
    )
    process = _build_process(
        inputs, plan, None if suffix is None else suffix.cached, cut, global_head
    )
    ids = client_data.VirtualClientIds(
        inputs.partition_dir if suffix is None else suffix.cached.partition_dir, plan, user_ids
    )
    start = inputs.pretrained if suffix is None else suffix.start
    state = process.initialize()
    if start is not None:
        state = _with_backbone(process, state, start)
    # Replaced by the checkpoint's on resume.
    server = StructureState(state)

    def backbone_of(state: Any) -> tff.learning.models.ModelWeights:
        trained = processes.backbone_model_weights(process.get_model_weights(state))
        return trained if suffix is None else suffix.backbone(trained)

    check_head = _head_capacity_check(config, global_head)
    before_round = _shared_negatives_hook(inputs, process, backbone_of)
    report_policy = config.report_policy()

    def round_step(t: int, _: Any) -> dict[str, Any]:
        state = server.get()
        if before_round is not None:
            state = before_round(t, state)
        applied = rounds.run_round(process, state, t, ids.for_round, report_policy)
        metrics = applied.output.metrics
        check_head(t + 1, metrics)
        server.set(applied.output.state)
        record: dict[str, Any] = {}
        if applied.discarded_kept_clients:
            record["discarded_attempts_kept_clients"] = applied.discarded_kept_clients
        work = metrics["client_work"]
        record["clients"] = {name: int(work[name]) for name in job_outputs.CLIENT_COUNTS}
        return record

    def backbone() -> tff.learning.models.ModelWeights:
        return backbone_of(server.get())

    outcome = loop.run(
        inputs,
        loop.Round(
            round_step,
            {"server_state": server.leaves},
            backbone,
            noisy=False,  # the noise seed is in the aggregator state
            evaluate_start=True,
            checkpoint_every=1,
        ),
    )
    return dataclasses.replace(outcome, feature_cache=cache_facts)

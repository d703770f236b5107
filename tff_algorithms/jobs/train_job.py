"""One training job: partition in, serving SavedModel + privacy ledger + metrics out.

`run_train_job(config, partition_dir, eval_records, output_dir)` is what `dp-fedemb
train` and the TFX trainer component call. It

1. builds the virtual-client schedule from the partition's user ids (mode "sampled"
   for DP-FedEmb / DP-FedAvg, "epoch" for DP-FTRL-FedEmb), the accounting spec from the
   schedule's participation statistics (both `job_config`), and refuses to start when
   the planned rounds cost more than `max_epsilon`;
2. trains with `training.train` (TFF; data loaded inside TFF from virtual-client ids,
   `client_data`), checkpointing under OUTPUT/checkpoints, so re-running the same job
   resumes where it stopped and ends bit-for-bit where an uninterrupted run ends;
3. evaluates exact recall@FAR (1e-1, 1e-2, 1e-3) on the held-out `eval_records` every
   `evaluate_every` rounds and after the last (`evaluation.HeldOutEvaluator`);
4. writes OUTPUT/saved_model (backbone only, `export`), OUTPUT/ledger.json and
   OUTPUT/metrics.json (`job_outputs`, which also says what is published and what is
   kept private).

The training step is the algorithm's trainer, named by its `algorithms.Algorithm`
(`tff_algorithms/algorithms/`) and imported when the job trains; the registered ones:

`algorithm="logit-dp"` is private contrastive training of the backbone
(`contrastive_training`): users sampled by the same schedule, one positive pair each,
per-pair clipping and noise; a "round" is one step.

`algorithm="dp-sgd-centralized"` and `"dp-last-layer"` are user-level DP-SGD without
virtual clients (`user_dp_sgd`): each sampled user's gradient clipped, summed, noised;
dp-last-layer trains the zero-initialised embedding layer alone on the feature cache
of the frozen prefix; a "round" is one step.

`algorithm="fdml"` is federated metric learning (`fdml_training`): embeddings up, the
trusted server's triplet derivatives down, noised; only users holding `samples_per_user`
images train (fewer than a round selects: refused before any round).

`algorithm="centralized"` is the non-private oracle (also the pipeline's non-private
pretraining on public data): SGD with momentum over all training examples, one "round"
per epoch, learning rate and momentum from `server_learning_rate` / `server_momentum`
(the paper lists the centralized learning rate in its server column); the DP fields
are ignored. Its outputs have the same layout, with epsilon null and `private: false`.
It is not a TFF process but one Keras model and optimizer (`processes.CentralizedTrainer`)
and trains through the step loop (`private_steps.run_steps`), one step an epoch, each
checkpointed, without noise; the ledger's epsilon is infinite from the first epoch.

A federated job's process is a process shape (`processes.build_fedemb_process`, or
`build_fedavg_process` for DP-FedAvg) given the aggregator
`mechanisms.aggregator_for_spec` builds from the job's accounting spec, the one the
ledger accounts with.

Both seeds come from OS entropy unless a testing flag allows a fixed one (`job_config`).
The schedule seed is drawn when a job first claims OUTPUT (`job_outputs`); the noise
seed (`loop_schedule.job_noise_seed`) lives in the checkpointed aggregator state.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition, schedule, splits
from tff_algorithms import algorithms
from tff_algorithms.base import job_files, owned_files
from tff_algorithms.config import loop_schedule
from tff_algorithms.config.job_config import (
    TrainJobConfig,
    accounting_spec_for,
    release_plan_for,
    schedule_for,
)
from tff_algorithms.evaluation.scoring import HeldOutEvaluator
from tff_algorithms.federated import (
    client_data,
    feature_cache,
    local_training,
    mechanisms,
    processes,
    runtime,
    training,
)
from tff_algorithms.jobs import job_outputs, private_steps, tensorboard_rounds
from tff_algorithms.jobs.job_outputs import JobOutcome, TrainJobResult
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting, dplc_releases
from tff_algorithms.privacy import budget as budget_lib
from tff_algorithms.privacy.ledger import PrivacyLedger

# Under OUTPUT unless the caller names a shared place (the pipeline does).


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


def _check_budget(config: TrainJobConfig, planned: accounting.PrivacyResult) -> None:
    if config.max_epsilon is not None and not planned.epsilon <= config.max_epsilon:
        cost = "infinite (no noise)" if math.isinf(planned.epsilon) else f"{planned.epsilon:.4g}"
        raise ValueError(
            f"over budget: {config.rounds} rounds of {config.algorithm} cost epsilon {cost} at "
            f"delta {planned.delta:.3g}, more than max_epsilon {config.max_epsilon:g}; refusing "
            "to start"
        )


@dataclasses.dataclass(frozen=True)
class JobInputs:
    """What both training loops start from, resolved by `run_train_job`.

    Attributes:
      config: the calibrated config (`TrainJobConfig.calibrated_for`).
      partition_dir / reader / user_ids: the training users' partition.
      spec: the accounting spec of the planned schedule.
      releases: the shared-negatives releases the ledger composes with it, or None.
      evaluator: held-out evaluation of backbone weights.
      checkpoint_dir: OUTPUT/checkpoints.
      pretrained: the initial backbone, or None for the seeded initialisation.
      progress: called with each round's history record, or None.
      feature_cache_dir: where caches of frozen-prefix features live (`feature_cache`).
    """

    config: TrainJobConfig
    partition_dir: str
    reader: partition.PartitionReader
    user_ids: list[str]
    spec: accounting.AccountingSpec
    releases: dplc_releases.ReleasePlan | None
    evaluator: HeldOutEvaluator
    checkpoint_dir: str
    pretrained: tff.learning.models.ModelWeights | None
    progress: Callable[[Mapping[str, Any]], None] | None
    feature_cache_dir: str


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
    server_optimizer = processes.server_sgdm(config.server_learning_rate, config.server_momentum)
    shape_options = dict(
        backbone_seed=config.seed,
        max_reports=config.report_policy().max_reports,
        feature_cut=cut,
    )
    if global_head:
        vocabulary = local_training.training_identity_vocabulary(inputs.reader, inputs.user_ids)
        base = processes.build_fedavg_process(
            config.backbone_config,
            client_config,
            vocabulary,
            aggregator,
            server_optimizer,
            **shape_options,
        )
    else:
        base = processes.build_fedemb_process(
            config.backbone_config, client_config, aggregator, server_optimizer, **shape_options
        )
    image_shape = config.image_shape
    return processes.compose_with_client_loader(
        base,
        (lambda vc_id: client_data.load_examples(vc_id, image_shape))
        if cached is None
        else cached.load_examples,
        client_config,
        client_data.expected_examples,
        client_data.seed_name,
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


def check_local_heads_fit(config: TrainJobConfig, manifest: Mapping[str, Any]) -> None:
    """Refuses, before any budget is charged, a DP-FedEmb job whose local head has fewer
    rows than the identities a virtual client may hold: when users share identities a
    user holds many, and a round drawing the users holding the most would stop the job
    midway (`_head_capacity_check`), its budget spent. The bound is the sum of the
    largest per-user identity counts (`partition.most_identities_of_users`), at most
    `max_examples_per_client` (one identity per example)."""
    if not algorithms.get(config.algorithm).local_heads:
        return  # DP-FedAvg's head is global; the others have no federated head
    most = partition.most_identities_of_users(manifest, config.users_per_virtual_client)
    if most is None:
        return  # a partition written before identity counts were kept: checked per round
    needed = min(most, config.max_examples_per_client)
    capacity = config.client_config().head_capacity
    if needed > capacity:
        raise ValueError(
            f"a virtual client of {config.users_per_virtual_client} training users may hold "
            f"{needed} identities (users hold several), more than the local head capacity "
            f"{capacity}: set head_capacity (--head-capacity, train.head_capacity) to at "
            f"least {needed}"
        )


def _head_capacity_check(
    config: TrainJobConfig, global_head: bool
) -> Callable[[Mapping[str, Any], Any], None]:
    capacity = config.client_config().head_capacity

    def check(record: Mapping[str, Any], training_metrics: Any) -> None:
        dropped = int(training_metrics["client_work"]["examples_over_head_capacity"])
        if dropped:
            cause = (
                f"exceed the local head capacity {capacity}; raise head_capacity"
                if not global_head
                else "have identities outside the training vocabulary"
            )
            raise ValueError(f"round {record['round']}: {dropped} training examples {cause}")

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
    config, user_ids, spec = inputs.config, inputs.user_ids, inputs.spec
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
    initial_state = None
    if start is not None:
        initial_state = _with_backbone(process, process.initialize(), start)

    def backbone_of(state: Any) -> tff.learning.models.ModelWeights:
        trained = processes.backbone_model_weights(process.get_model_weights(state))
        return trained if suffix is None else suffix.backbone(trained)

    check_head = _head_capacity_check(config, global_head)

    def on_round(record: dict[str, Any], training_metrics: Any) -> None:
        check_head(record, training_metrics)
        # The record is saved after this call, so the counts survive a resume.
        work = training_metrics["client_work"]
        record["clients"] = {name: int(work[name]) for name in job_outputs.CLIENT_COUNTS}
        if inputs.progress is not None:
            inputs.progress(record)

    result, ledger = training.train(
        process,
        ids.for_round,
        PrivacyLedger(spec, inputs.releases),
        lambda text: PrivacyLedger.from_json(
            text, expected_spec=spec, expected_releases=inputs.releases
        ),
        training.TrainingProgramConfig(
            config.rounds, inputs.checkpoint_dir, evaluate_every=config.evaluate_every
        ),
        evaluate=lambda state, _: inputs.evaluator(backbone_of(state)),
        initial_state=initial_state,
        on_round=on_round,
        report_policy=config.report_policy(),
        before_round=_shared_negatives_hook(inputs, process, backbone_of),
    )
    return JobOutcome(
        backbone_of(result.state), ledger, result.history, result.resumed_from_round, cache_facts
    )


def _all_training_examples(
    reader: partition.PartitionReader, partition_dir: str, image_shape
) -> tf.data.Dataset:  # noqa: ANN001
    parts = sorted({reader.location(u).part_file for u in reader.user_ids()})
    files = [os.path.join(partition_dir, p) for p in parts]
    return tf.data.TFRecordDataset(files).map(lambda s: client_data.parse_example(s, image_shape))


def train_centralized(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """The centralized oracle's trainer (module docstring). `schedule_seed` is not used:
    the oracle samples no users, and `config.seed` seeds its shuffling."""
    del schedule_seed
    config = inputs.config
    trainer = processes.CentralizedTrainer(
        config.backbone_config,
        local_training.training_identity_vocabulary(inputs.reader, inputs.user_ids),
        learning_rate=config.server_learning_rate,
        batch_size=config.batch_size,
        momentum=config.server_momentum,
        head_loss=config.head_loss_config,
        seed=config.seed,
        initial_backbone=inputs.pretrained,
    )
    examples = _all_training_examples(inputs.reader, inputs.partition_dir, config.image_shape)

    def epoch(e: int, _: tf.Tensor | None) -> None:
        trainer.train_epoch(examples, e)  # its loss is not recorded, as before

    # One step is one epoch; each is checkpointed (an epoch is the oracle's long unit).
    return private_steps.run_steps(
        inputs,
        trainer.checkpoint_objects(),
        epoch,
        lambda: models.backbone_weights(trainer.backbone),
        noisy=False,
        checkpoint_every=1,
    )


def _each_round(
    *callbacks: Callable[[Mapping[str, Any]], None] | None,
) -> Callable[[Mapping[str, Any]], None] | None:
    given = [callback for callback in callbacks if callback is not None]
    if not given:
        return None

    def each_round(record: Mapping[str, Any]) -> None:
        for callback in given:
            callback(record)

    return each_round


def run_train_job(
    config: TrainJobConfig,
    partition_dir: str,
    eval_records: str,
    output_dir: str,
    pretrained_backbone: str | None = None,
    *,
    progress: Callable[[Mapping[str, Any]], None] | None = None,
    runtime_config: runtime.RuntimeConfig | None = None,
    budget: budget_lib.BudgetPolicy | None = None,
    tensorboard_dir: str | None = None,
    run_id: str | None = None,
    feature_cache_dir: str | None = None,
    split_mode: str = splits.IDENTITY_AND_USER,
) -> TrainJobResult:
    """Trains (or resumes) one job and writes its outputs (module docstring).

    Args:
      config: hyperparameters.
      partition_dir: training users, partitioned by `beam_jobs.partition`.
      eval_records: held-out canonical records (directory or glob;
        `evaluation.record_files`).
      output_dir: checkpoints, saved_model, ledger.json, metrics.json.
      pretrained_backbone: path accepted by `models.load_pretrained_backbone`.
      progress: called with each round's history record (round, epsilon, seconds, eval).
      runtime_config: the TFF workers to train on (several split each round's clients),
        by `runtime.session`: None or the default means the active runtime, or one local
        worker when none is active.
      budget: the cross-run budget of the training users (`budget.charge_run`): the job
        is charged its planned schedule before training, or refused. None: no
        cross-run budget (`max_epsilon` still bounds this run alone).
      tensorboard_dir: where each round's scalars go (`tensorboard_rounds`), or None.
      run_id: the job's id in the budget ledger, for a run charged in advance
        (`budget.charge_runs`: the pipeline charges private pretraining and the training
        after it together); None: a new id (`job_outputs.claim_output_dir`).
      feature_cache_dir: where a job that trains a suffix of the backbone keeps the
        frozen prefix's features (`feature_cache`; keyed, so jobs may share it);
        None: OUTPUT/feature_cache.
      split_mode: the protocol `eval_records` were split by (`beam_jobs.splits.MODES`):
        in held_out_images the evaluation's genuine pairs join two users (`evaluation`).

    Raises:
      ValueError: bad input (not a partition, no evaluation records, too few users for a
        round, over budget, a different job already in `output_dir`, ...).
    """
    started = time.perf_counter()
    reader = partition.PartitionReader(partition_dir)
    user_ids = all_user_ids = reader.user_ids()
    algorithm = algorithms.get(config.algorithm)
    if algorithm.eligible_users is not None:
        # Its population (fdml: the users that can fill s rows).
        user_ids = algorithm.eligible_users(reader, user_ids, config)
    config, noise_source = config.calibrated_for(len(user_ids))
    spec = accounting_spec_for(config, len(user_ids))
    releases = release_plan_for(config)
    # The shared-negatives releases (if any) compose with the training everywhere its
    # epsilon is used: the budget checks, the ledger, metrics.json.
    planned = dplc_releases.composed_privacy(spec, releases)
    _check_budget(config, planned)
    check_local_heads_fit(config, reader.manifest)
    evaluator = HeldOutEvaluator(config.backbone_config, eval_records, split_mode)
    pretrained = (
        models.backbone_weights(
            models.load_pretrained_backbone(config.backbone_config, pretrained_backbone)
        )
        if pretrained_backbone
        else None
    )
    claimed = job_outputs.claim_output_dir(
        output_dir, job_outputs.job_record(config, reader), config, run_id
    )
    charge = None
    if budget is not None:  # the centralized oracle, noiseless, exceeds any budget
        charge = budget_lib.charge_run(
            budget,
            # Every training user, so runs on the same users compose whatever they sample.
            budget_lib.dataset_fingerprint(all_user_ids),
            len(all_user_ids),
            claimed.run_id,
            spec,
            releases,
        )
    # Tightened even when the job is finished: the checkpoints hold the noise state.
    checkpoint_dir = job_outputs.make_checkpoint_dir(output_dir)
    finished = job_outputs.finished_result(output_dir, config)
    if finished is not None:
        if charge is None:
            return finished
        # The files stay as they are; the caller learns the ledger's answer now (resumed,
        # not charged again, or charged in a ledger that had not seen this run).
        metrics = {**finished.metrics, "dataset_budget": charge.to_dict()}
        return dataclasses.replace(finished, metrics=metrics)
    board = None
    if tensorboard_dir is not None:
        # The calibrated noise multiplier: the mechanism as trained.
        board = tensorboard_rounds.TensorBoardRounds(
            tensorboard_dir,
            {"noise_multiplier": config.noise_multiplier, "clip_norm": config.clip_norm},
        )
    inputs = JobInputs(
        config,
        partition_dir,
        reader,
        user_ids,
        spec,
        releases,
        evaluator,
        checkpoint_dir,
        pretrained,
        _each_round(progress, board),
        feature_cache_dir or owned_files.create_entry(output_dir, job_files.FEATURE_CACHE_DIR),
    )
    trainer = algorithm.load_trainer()
    if algorithm.tff_runtime:
        # The caller's runtime, else one for this job; workers that `runtime_config` names
        # run nested over the caller's (stopping them reinstates it).
        with runtime.session(runtime_config, handle_signals=False):
            outcome = trainer(inputs, claimed.schedule_seed)
    else:
        outcome = trainer(inputs, claimed.schedule_seed)
    if board is not None:
        board.close()
    facts = job_outputs.JobFacts(
        noise_source, planned, eval_records, evaluator.labels, len(user_ids), charge, split_mode
    )
    return job_outputs.write_outputs(output_dir, config, outcome, facts, started)

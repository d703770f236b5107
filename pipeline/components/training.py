"""Training components: pretraining (non-private on public data, or Logit-DP on the
private users), and private training.

Both call `tff_algorithms.jobs.train_job.run_train_job` in a work directory (checkpoints
there let a killed run resume on retry) and publish only the serving SavedModel
(backbone only: per-virtual-client heads never leave the job), metrics.json and, for
private training, the privacy ledger. A private model never leaves the component
without its epsilon: the Model, PrivacyLedger and TrainingMetrics artifacts all carry
epsilon and delta as MLMD custom properties.
"""

import dataclasses
import hashlib
import json
import os
from typing import TYPE_CHECKING

import tensorflow as tf
from tfx import types
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputArtifact, Parameter
from tfx.dsl.component.experimental.decorators import component
from tfx.types import standard_artifacts

from pipeline import console
from pipeline.components import artifacts, layout
from tff_algorithms.base import job_files, owned_files
from tff_algorithms.config.job_config import TrainJobConfig
from tff_algorithms.config.job_plan import (
    accounting_spec_for,
    release_plan_for,
    schedule_shape_for,
)

if TYPE_CHECKING:  # imported lazily at run time: TFF is slow to import
    from tff_algorithms.jobs import job_outputs
    from tff_algorithms.privacy import ledger as ledger_lib

# pretrain.source private_contrastive (pipeline.config.PRIVATE_CONTRASTIVE): the value of
# a backbone's "trained_on" property.
PRIVATE_CONTRASTIVE = "private_contrastive"
# The budget run id the private training after a private pretraining was charged under.
RESERVED_TRAIN_RUN_ID = "reserved_train_run_id"


_PUBLIC_PARTITION = "public_partition"


def _work_dir(output: types.Artifact, *keys: str) -> str:
    """A directory that survives a failed execution, keyed by what the run depends on.

    Output URIs are new for every execution, so a retry of the same run finds its
    checkpoints here (PIPELINE_ROOT/<component>/.work/<key>) instead.
    """
    component_root = os.path.dirname(os.path.dirname(output.uri))
    key = hashlib.sha256("\x00".join(keys).encode()).hexdigest()[:16]
    return os.path.join(component_root, ".work", key)


def _tensorboard_run(tensorboard_dir: str, component_id: str, output: types.Artifact) -> str:
    # One TensorBoard run per execution: OUTPUT/tensorboard/<component>/execution-<id>.
    return os.path.join(tensorboard_dir, component_id, f"execution-{os.path.basename(output.uri)}")


def _run_job(
    component_id: str,
    job_config: str,
    partition_dir: str,
    eval_records: str,
    work_dir: str,
    pretrained_backbone: types.Artifact | None,
    tensorboard_dir: str,
    runtime_config: str | None = None,
    budget_policy: str | None = None,
    run_id: str | None = None,
    *,
    split_mode: str,
) -> "job_outputs.TrainJobResult":
    from tff_algorithms.federated import runtime
    from tff_algorithms.jobs import train_job
    from tff_algorithms.privacy import budget

    config = TrainJobConfig.from_dict(json.loads(job_config))
    backbone_dir = layout.serving_model_dir(pretrained_backbone) if pretrained_backbone else None
    workers = None
    if runtime_config:
        fields = json.loads(runtime_config)
        workers = runtime.RuntimeConfig(
            **{**fields, "worker_addresses": tuple(fields["worker_addresses"])}
        )
    # The job starts and stops its local TFF workers, or connects to the configured
    # remote ones (docs/design.md sections 1 and 8).
    return train_job.run_train_job(
        config,
        partition_dir,
        eval_records,
        work_dir,
        pretrained_backbone=backbone_dir,
        runtime_config=workers,
        budget=budget.BudgetPolicy(**json.loads(budget_policy)) if budget_policy else None,
        # Each round on the console as it ends (`dp-fedemb run`) or in the task's log.
        progress=console.RoundProgress(config.rounds, label=component_id),
        tensorboard_dir=tensorboard_dir,
        run_id=run_id,
        # Beside the work directories, not in them: a retry or another run whose job
        # differs but whose frozen prefix and partition are the same reuses the features.
        feature_cache_dir=os.path.join(os.path.dirname(work_dir), "feature_cache"),
        # The validation split's protocol: which pairs the evaluation counts as genuine.
        split_mode=split_mode,
    )


def _publish_model(
    result: "job_outputs.TrainJobResult", model: types.Artifact, metrics: types.Artifact
) -> None:
    """Moves the serving SavedModel where the Pusher looks, and copies metrics.json."""
    tf.io.gfile.rename(result.saved_model_dir, os.path.join(model.uri, layout.SERVING_MODEL_DIR))
    tf.io.gfile.copy(
        result.metrics_path, os.path.join(metrics.uri, job_files.METRICS_FILE), overwrite=True
    )


def _set_recall_properties(artifact: types.Artifact, metrics: dict) -> None:
    for far, recall in metrics["recall_at_far"].items():
        artifact.set_float_custom_property(f"recall_at_far_{far}", float(recall))


def _set_budget_properties(
    privacy_ledger: types.Artifact, charge: dict | None, budget_policy: str | None
) -> None:
    """The cross-run budget charge (tff_algorithms.privacy.budget.BudgetCharge) as lineage;
    `dp-fedemb run` checks the ledger against it (pipeline/budget_records.py)."""
    if charge is None or not budget_policy:
        return
    privacy_ledger.set_string_custom_property(artifacts.DATASET_FINGERPRINT, charge["fingerprint"])
    privacy_ledger.set_string_custom_property(artifacts.BUDGET_RUN_ID, charge["run_id"])
    privacy_ledger.set_string_custom_property(
        artifacts.BUDGET_LEDGER, json.loads(budget_policy)["ledger_path"]
    )
    privacy_ledger.set_string_custom_property(artifacts.BUDGET_CHAIN, charge["chain"])
    privacy_ledger.set_int_custom_property(
        artifacts.BUDGET_LEDGER_REPAIRED, int(charge["ledger_repaired"])
    )
    spent = charge["spent_after"]
    privacy_ledger.set_float_custom_property(
        artifacts.DATASET_EPSILON, float("inf") if spent is None else spent
    )
    privacy_ledger.set_float_custom_property(
        artifacts.DATASET_BUDGET_EPSILON, charge["total_epsilon"]
    )
    privacy_ledger.set_int_custom_property(artifacts.BUDGET_OVERRIDDEN, int(charge["overridden"]))


@component
def PretrainBackbone(
    examples: InputArtifact[standard_artifacts.Examples],
    backbone: OutputArtifact[standard_artifacts.Model],
    # Not `training_metrics`: TFX's Airflow driver names an artifact "<output key>:<run id>"
    # and ML Metadata keeps (type, name) unique, so PrivateTrain's would collide with it.
    backbone_metrics: OutputArtifact[artifacts.TrainingMetrics],
    train_job_config: Parameter[str],
    num_shards: Parameter[int],
    beam_args: Parameter[str],
    tensorboard_dir: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Non-private (centralized) training on the public split only.

    Public users are disjoint from private ones (split by identity and user) and
    deduplicated against private data, so this model costs no privacy budget.
    """
    from beam_jobs import partition, partition_job, split_protocols

    del code_fingerprint
    work_dir = _work_dir(backbone, train_job_config, examples.uri)
    # The job claims its directory (tff_algorithms/base/owned_files.py): what the component
    # writes there first is recorded as the product's too (a directory from before the
    # record, holding the partition, is adopted).
    owned_files.claim(
        work_dir,
        "PretrainBackbone",
        legacy_marker=_PUBLIC_PARTITION,
        legacy_names={_PUBLIC_PARTITION, *job_files.TRAIN_OUTPUT_NAMES},
    )
    public_partition = owned_files.create_entry(work_dir, _PUBLIC_PARTITION)
    if not tf.io.gfile.exists(os.path.join(public_partition, partition.MANIFEST_FILE)):
        partition_job.run_partition(
            layout.split_dir(examples, split_protocols.PUBLIC),
            public_partition,
            num_shards,
            beam_args=json.loads(beam_args),
        )
    result = _run_job(
        "PretrainBackbone",
        train_job_config,
        public_partition,
        layout.split_dir(examples, split_protocols.VALIDATION),
        work_dir,
        pretrained_backbone=None,
        tensorboard_dir=_tensorboard_run(tensorboard_dir, "PretrainBackbone", backbone),
        split_mode=layout.split_mode(examples),
    )
    _publish_model(result, backbone, backbone_metrics)
    layout.remove_tree(work_dir)
    backbone.set_string_custom_property("trained_on", "public")
    _set_recall_properties(backbone_metrics, result.metrics)


def _set_privacy_properties(
    artifact: types.Artifact, epsilon: float, ledger: "ledger_lib.PrivacyLedger"
) -> None:
    artifact.set_float_custom_property(artifacts.EPSILON, epsilon)
    artifact.set_float_custom_property(artifacts.DELTA, ledger.delta)
    artifact.set_string_custom_property(
        artifacts.ACCOUNTING_CONVENTION, ledger.spec.convention.value
    )
    artifact.set_string_custom_property(
        artifacts.NEIGHBORING_RELATION, ledger.spec.neighboring_relation.value
    )


def _planned_run(run_id: str, job_config: str, users: int) -> tuple:
    """(run id, accounting spec, shared-negatives releases) of a job as it will train."""
    config, _ = TrainJobConfig.from_dict(json.loads(job_config)).calibrated_for(users)
    return run_id, accounting_spec_for(config, users), release_plan_for(config)


@component
def PrivatePretrain(
    partition: InputArtifact[artifacts.VirtualClientPartition],
    examples: InputArtifact[standard_artifacts.Examples],
    backbone: OutputArtifact[standard_artifacts.Model],
    backbone_metrics: OutputArtifact[artifacts.TrainingMetrics],
    pretrain_job_config: Parameter[str],
    train_job_config: Parameter[str],
    budget_policy: Parameter[str],
    tensorboard_dir: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Logit-DP contrastive pretraining on the private training users (issue 26).

    Before it trains, this run and the private training that will start from its
    backbone (`train_job_config`, the PrivateTrain parameter) are charged to the users'
    budget together (`budget.charge_runs`), or both refused in one line: neither
    trains unless both fit. The training's run id travels on the backbone
    (`RESERVED_TRAIN_RUN_ID`), so PrivateTrain is not charged twice. The backbone
    carries this run's epsilon and its ledger.json, from which PrivateTrain composes
    the model's epsilon.
    """
    from beam_jobs import partition as partition_lib
    from beam_jobs import split_protocols
    from tff_algorithms.privacy import budget
    from tff_algorithms.privacy import ledger as ledger_lib

    del code_fingerprint
    work_dir = _work_dir(
        backbone, pretrain_job_config, train_job_config, partition.uri, examples.uri
    )
    # One key, two runs: a retry of this execution finds its charges in the ledger.
    run_key = os.path.basename(work_dir)
    pretrain_run_id, train_run_id = f"{run_key}-private-pretrain", f"{run_key}-private-train"
    user_ids = partition_lib.PartitionReader(partition.uri).user_ids()
    policy = budget.BudgetPolicy(**json.loads(budget_policy))
    budget.charge_runs(
        policy,
        budget.dataset_fingerprint(user_ids),
        len(user_ids),
        [
            _planned_run(pretrain_run_id, pretrain_job_config, len(user_ids)),
            _planned_run(train_run_id, train_job_config, len(user_ids)),
        ],
    )
    result = _run_job(
        "PrivatePretrain",
        pretrain_job_config,
        partition.uri,
        layout.split_dir(examples, split_protocols.VALIDATION),
        work_dir,
        pretrained_backbone=None,
        tensorboard_dir=_tensorboard_run(tensorboard_dir, "PrivatePretrain", backbone),
        budget_policy=budget_policy,
        run_id=pretrain_run_id,
        split_mode=layout.split_mode(examples),
    )
    tf.io.gfile.copy(
        result.ledger_path, os.path.join(backbone.uri, job_files.LEDGER_FILE), overwrite=True
    )
    ledger = ledger_lib.PrivacyLedger.from_json(tf.io.gfile.GFile(result.ledger_path).read())
    _publish_model(result, backbone, backbone_metrics)
    layout.remove_tree(work_dir)
    backbone.set_string_custom_property("trained_on", PRIVATE_CONTRASTIVE)
    backbone.set_string_custom_property(RESERVED_TRAIN_RUN_ID, train_run_id)
    backbone.set_string_custom_property("algorithm", json.loads(pretrain_job_config)["algorithm"])
    for artifact in (backbone, backbone_metrics):
        _set_privacy_properties(artifact, ledger.epsilon, ledger)
    _set_recall_properties(backbone_metrics, result.metrics)


def check_published_schedule(job: dict, statistics: types.Artifact, training_users: int) -> None:
    """The partition's published participation statistics must be those of the schedule
    this job trains and is accounted with (`job_plan.schedule_shape_for`): the whole
    statistics, users per round, rounds and participation bounds included."""
    from beam_jobs import partition, schedule

    config = TrainJobConfig.from_dict(job)
    trained = schedule_shape_for(config, training_users).participation_stats(config.rounds)
    path = os.path.join(statistics.uri, partition.PARTICIPATION_FILE)
    with tf.io.gfile.GFile(path) as f:
        published = schedule.ParticipationStats.from_json(f.read())
    if published != trained:
        differ = sorted(
            name
            for name, value in trained.to_dict().items()
            if published.to_dict().get(name) != value
        )
        raise ValueError(
            "the partition's schedule statistics are not the trained schedule's: "
            + ", ".join(
                f"{name} {published.to_dict().get(name)} published, {trained.to_dict()[name]} trained"
                for name in differ
            )
        )


@component
def CheckTrainingSchedule(
    examples: InputArtifact[standard_artifacts.Examples],
    train_job_config: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Stops the run in seconds, with one line naming the setting to change, when the
    training split cannot train (`local_heads.check_split_can_train`: a round its users
    cannot fill, a target epsilon out of reach, identities overflowing a local head).
    Runs right after the split, before statistics, dedup and pretraining; dedup may still
    remove users (and with them identities), and the training step checks again with the
    partition's final counts."""
    from tff_algorithms.jobs import local_heads

    del code_fingerprint
    with tf.io.gfile.GFile(os.path.join(examples.uri, layout.SUMMARY_FILE)) as f:
        split_summary = json.load(f)["split"]
    config = TrainJobConfig.from_dict(json.loads(train_job_config))
    try:
        local_heads.check_split_can_train(config, split_summary)
    except ValueError as e:
        raise ValueError(f"train: {e}") from None


@dataclasses.dataclass(frozen=True)
class _PrivateStart:
    """A backbone from private pretraining: its run's ledger and the training's run id."""

    ledger: "ledger_lib.PrivacyLedger"
    train_run_id: str


def _private_start(backbone: types.Artifact | None) -> _PrivateStart | None:
    if backbone is None or backbone.get_string_custom_property("trained_on") != (
        PRIVATE_CONTRASTIVE
    ):
        return None
    from tff_algorithms.privacy import ledger as ledger_lib

    with tf.io.gfile.GFile(os.path.join(backbone.uri, job_files.LEDGER_FILE)) as f:
        ledger = ledger_lib.PrivacyLedger.from_json(f.read())
    return _PrivateStart(ledger, backbone.get_string_custom_property(RESERVED_TRAIN_RUN_ID))


@component
def PrivateTrain(
    partition: InputArtifact[artifacts.VirtualClientPartition],
    schedule_statistics: InputArtifact[artifacts.ScheduleStatistics],
    examples: InputArtifact[standard_artifacts.Examples],
    model: OutputArtifact[standard_artifacts.Model],
    privacy_ledger: OutputArtifact[artifacts.PrivacyLedger],
    training_metrics: OutputArtifact[artifacts.TrainingMetrics],
    train_job_config: Parameter[str],
    runtime_config: Parameter[str],
    budget_policy: Parameter[str],
    tensorboard_dir: Parameter[str],
    code_fingerprint: Parameter[str],
    pretrained_backbone: InputArtifact[standard_artifacts.Model] = None,
) -> None:
    """User-level DP training (DP-FedEmb, DP-FTRL-FedEmb or DP-FedAvg, by config).

    `budget_policy` (JSON of tff_algorithms.privacy.budget.BudgetPolicy fields) is the training
    users' cross-run budget: the run is charged to it before training or refused. It is
    an execution property in ML Metadata, and the PrivacyLedger artifact carries what
    the charge did (dataset fingerprint, composed epsilon, budget, budget_overridden).

    `runtime_config` (JSON of tff_algorithms.federated.runtime.RuntimeConfig fields) names the
    TFF workers; it is not part of the work directory's key, so a retry on other
    workers resumes from the same checkpoints.

    The schedule seed (which users train in which round) is no parameter: outside
    tests `train_job_config` has none, and the job draws it from OS entropy inside
    this executor and keeps it in the work directory's train_job.json, next to the
    checkpoints (removed on success). So a retry resumes with the same virtual
    clients, a run with nothing changed keeps its cache key, and neither ML Metadata
    nor a compiled pipeline ever holds it.

    Recall during training is measured on the validation split (held-out identities
    and users); the final evaluation uses the test split (EvaluateAndBless).
    """
    from beam_jobs import split_protocols
    from tff_algorithms.privacy import composition as composition_lib
    from tff_algorithms.privacy import ledger as ledger_lib

    del code_fingerprint
    job = json.loads(train_job_config)
    check_published_schedule(job, schedule_statistics, partition.get_int_custom_property("users"))
    keys = [train_job_config, partition.uri, examples.uri]
    if pretrained_backbone is not None:
        keys.append(pretrained_backbone.uri)
    work_dir = _work_dir(model, *keys)
    private_start = _private_start(pretrained_backbone)
    result = _run_job(
        "PrivateTrain",
        train_job_config,
        partition.uri,
        layout.split_dir(examples, split_protocols.VALIDATION),
        work_dir,
        pretrained_backbone,
        _tensorboard_run(tensorboard_dir, "PrivateTrain", model),
        runtime_config,
        budget_policy,
        run_id=private_start.train_run_id if private_start else None,
        split_mode=layout.split_mode(examples),
    )
    with tf.io.gfile.GFile(result.ledger_path) as f:
        ledger_json = f.read()
    ledger = ledger_lib.PrivacyLedger.from_json(ledger_json)
    if ledger.rounds_recorded != job["rounds"]:
        raise ValueError(
            f"privacy ledger records {ledger.rounds_recorded} rounds, training ran {job['rounds']}"
        )
    with tf.io.gfile.GFile(os.path.join(privacy_ledger.uri, job_files.LEDGER_FILE), "w") as f:
        f.write(ledger_json)
    # The model's epsilon is that of every private run its weights come from.
    runs = [("PrivateTrain", ledger)]
    if private_start is not None:
        runs.insert(0, ("PrivatePretrain", private_start.ledger))
    composition = composition_lib.model_composition(runs, ledger.delta)
    with tf.io.gfile.GFile(os.path.join(privacy_ledger.uri, job_files.COMPOSITION_FILE), "w") as f:
        f.write(json.dumps(composition, indent=1, allow_nan=False))
    epsilon = composition_lib.composition_epsilon(composition)
    _publish_model(result, model, training_metrics)
    layout.remove_tree(work_dir)
    for artifact in (model, privacy_ledger, training_metrics):
        _set_privacy_properties(artifact, epsilon, ledger)
        artifact.set_float_custom_property(artifacts.RUN_EPSILON, ledger.epsilon)
        artifact.set_int_custom_property(artifacts.COMPOSED_RUNS, len(runs))
    model.set_string_custom_property("algorithm", job["algorithm"])
    privacy_ledger.set_int_custom_property("rounds", ledger.rounds_recorded)
    privacy_ledger.set_string_custom_property("mechanism", ledger.spec.mechanism.value)
    _set_budget_properties(privacy_ledger, result.metrics["dataset_budget"], budget_policy)
    _set_recall_properties(training_metrics, result.metrics)

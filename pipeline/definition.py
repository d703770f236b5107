"""The dp-fedemb TFX pipeline (docs/design.md section 7), built from a validated PipelineConfig.

CanonicalExampleGen -> CheckTrainingSchedule -> StatisticsGen -> SchemaGen -> ExampleValidator -> DeduplicateSplits
-> PartitionVirtualClients -> [PretrainBackbone | PrivatePretrain | backbone Importer]
-> PrivateTrain
-> EvaluateAndBless (+ latest blessed model resolver) -> Pusher -> RenderReport.

The same function serves every orchestrator: LocalDagRunner runs it, the Kubeflow V2
and Airflow targets compile it.
"""

from __future__ import annotations

import dataclasses
import json
import os

import tensorflow_data_validation as tfdv
from apache_beam.options.pipeline_options import StandardOptions
from tfx.components import ExampleValidator, SchemaGen, StatisticsGen
from tfx.dsl.components.common.importer import Importer
from tfx.dsl.components.common.resolver import Resolver
from tfx.dsl.input_resolution.strategies.latest_blessed_model_strategy import (
    LatestBlessedModelStrategy,
)
from tfx.orchestration import metadata
from tfx.orchestration.pipeline import Pipeline
from tfx.proto import pusher_pb2
from tfx.types import Channel, standard_artifacts

from beam_jobs import records_io
from pipeline import config as config_lib
from pipeline import config_checks, fingerprint
from pipeline.components import data, evaluation, reporting, training
from pipeline.components.pushing import Pusher
from tff_algorithms.config import job_config, job_plan, model_config

# Node ids, used by partial runs and tests.
EXAMPLE_GEN = "CanonicalExampleGen"
CHECK_SCHEDULE = "CheckTrainingSchedule"
STATISTICS_GEN = "StatisticsGen"
SCHEMA_GEN = "SchemaGen"
EXAMPLE_VALIDATOR = "ExampleValidator"
DEDUP = "DeduplicateSplits"
PARTITION = "PartitionVirtualClients"
PRETRAIN = "PretrainBackbone"
PRIVATE_PRETRAIN = "PrivatePretrain"
BACKBONE_IMPORTER = "BackboneImporter"
PRIVATE_TRAIN = "PrivateTrain"
BASELINE_RESOLVER = "LatestBlessedModelResolver"
EVALUATE = "EvaluateAndBless"
PUSHER = "Pusher"
REPORT = "RenderReport"


def pipeline_root(config: config_lib.PipelineConfig) -> str:
    return os.path.join(os.path.abspath(config.pipeline.output_dir), "pipeline_root")


def metadata_path(config: config_lib.PipelineConfig) -> str:
    return os.path.join(os.path.abspath(config.pipeline.output_dir), "metadata.sqlite")


def tensorboard_dir(config: config_lib.PipelineConfig) -> str:
    """`tensorboard --logdir` this: one run per training execution."""
    return os.path.join(os.path.abspath(config.pipeline.output_dir), "tensorboard")


def _code(component_factory, model_digests: tuple[str, ...]) -> str:
    """The component's code fingerprint, with the digests of the backbone files or factories
    the user brings (`_model_digests`): TFX caching then sees an edited model."""
    return "+".join([fingerprint.code_fingerprint(component_factory.__module__), *model_digests])


def _model_digests(*jobs: dict) -> tuple[str, ...]:
    """`model_config.source_digest` of each job's architecture, where it has one."""
    digests = {
        model_config.source_digest(str(job.get("architecture") or model_config.SMALL_CNN))
        for job in jobs
    }
    return tuple(sorted(digests - {None}))


def build_components(config: config_lib.PipelineConfig) -> list:
    beam_args = json.dumps(list(config.pipeline.beam_args))
    train_job = config.train_job_dict()
    schedule_counts = job_config.TrainJobConfig.from_dict(train_job)
    model_digests = _model_digests(train_job, config.pretrain_job_dict())

    example_gen = data.CanonicalExampleGen(
        input_sources=json.dumps([os.path.abspath(s) for s in config.data.inputs]),
        public_input_sources=json.dumps([os.path.abspath(s) for s in config.data.public_inputs]),
        evaluation_input_sources=json.dumps(
            [os.path.abspath(s) for s in config.data.evaluation_inputs]
        ),
        synthetic_config=json.dumps(dataclasses.asdict(config.data.synthetic), sort_keys=True),
        synthetic_public_config=json.dumps(
            config.synthetic_public and dataclasses.asdict(config.synthetic_public),
            sort_keys=True,
        ),
        split_config=json.dumps(config.split_config_dict(), sort_keys=True),
        max_bad_fraction=config.data.max_bad_fraction,
        identity_feature=config.data.identity_feature or "",
        max_image_pixels=config.data.max_image_pixels or 0,
        beam_args=beam_args,
        code_fingerprint=_code(data.CanonicalExampleGen, ()),
    ).with_id(EXAMPLE_GEN)
    # No top values or rank histograms: for user_id and identity they would list
    # training users' names (and SchemaGen would copy them into a string domain) in
    # published artifacts. Counts, presence and lengths are still computed.
    statistics_gen = StatisticsGen(
        examples=example_gen.outputs["examples"],
        stats_options=tfdv.StatsOptions(num_top_values=0, num_rank_histogram_buckets=0),
    ).with_id(STATISTICS_GEN)
    schema_gen = SchemaGen(
        statistics=statistics_gen.outputs["statistics"], infer_feature_shape=False
    ).with_id(SCHEMA_GEN)
    example_validator = ExampleValidator(
        statistics=statistics_gen.outputs["statistics"], schema=schema_gen.outputs["schema"]
    ).with_id(EXAMPLE_VALIDATOR)
    dedup = data.DeduplicateSplits(
        examples=example_gen.outputs["examples"],
        anomalies=example_validator.outputs["anomalies"],
        dedup_config=json.dumps(dataclasses.asdict(config.dedup), sort_keys=True),
        beam_args=beam_args,
        code_fingerprint=_code(data.DeduplicateSplits, ()),
    ).with_id(DEDUP)
    # Before anything slow: a schedule the training split cannot carry stops the run here.
    check_schedule = training.CheckTrainingSchedule(
        examples=example_gen.outputs["examples"],
        train_job_config=json.dumps(train_job, sort_keys=True),
        code_fingerprint=_code(training.CheckTrainingSchedule, ()),
    ).with_id(CHECK_SCHEDULE)
    statistics_gen.add_upstream_node(check_schedule)
    examples = dedup.outputs["deduplicated_examples"]
    partition = data.PartitionVirtualClients(
        examples=examples,
        num_shards=config.partition.num_shards,
        # The shared schedule's counts (an algorithm's section may name them).
        users_per_virtual_client=schedule_counts.users_per_virtual_client,
        virtual_clients_per_round=str(schedule_counts.virtual_clients_per_round),
        over_selection=float(train_job["over_selection"]),
        rounds=train_job["rounds"],
        schedule_mode=job_plan.schedule_mode(train_job["algorithm"]),
        beam_args=beam_args,
        code_fingerprint=_code(data.PartitionVirtualClients, ()),
    ).with_id(PARTITION)
    components = [
        example_gen,
        check_schedule,
        statistics_gen,
        schema_gen,
        example_validator,
        dedup,
        partition,
    ]

    backbone = None
    if config.pretrain.source == "public":
        pretrain = training.PretrainBackbone(
            examples=examples,
            train_job_config=json.dumps(config.pretrain_job_dict(), sort_keys=True),
            num_shards=config.partition.num_shards,
            beam_args=beam_args,
            tensorboard_dir=tensorboard_dir(config),
            code_fingerprint=_code(training.PretrainBackbone, model_digests),
        ).with_id(PRETRAIN)
        components.append(pretrain)
        backbone = pretrain.outputs["backbone"]
    elif config.pretrain.source == config_checks.PRIVATE_CONTRASTIVE:
        # On the private training users: after their partition, charged to their budget.
        private_pretrain = training.PrivatePretrain(
            partition=partition.outputs["partition"],
            examples=examples,
            pretrain_job_config=json.dumps(config.pretrain_job_dict(), sort_keys=True),
            train_job_config=json.dumps(train_job, sort_keys=True),
            budget_policy=json.dumps(config.budget_policy_dict(), sort_keys=True),
            tensorboard_dir=tensorboard_dir(config),
            code_fingerprint=_code(training.PrivatePretrain, model_digests),
        ).with_id(PRIVATE_PRETRAIN)
        components.append(private_pretrain)
        backbone = private_pretrain.outputs["backbone"]
    elif config.pretrain.source == "import":
        importer = Importer(
            source_uri=os.path.abspath(config.pretrain.backbone_dir),
            artifact_type=standard_artifacts.Model,
        ).with_id(BACKBONE_IMPORTER)
        components.append(importer)
        backbone = importer.outputs["result"]

    private_train = training.PrivateTrain(
        partition=partition.outputs["partition"],
        schedule_statistics=partition.outputs["schedule_statistics"],
        examples=examples,
        pretrained_backbone=backbone,
        train_job_config=json.dumps(train_job, sort_keys=True),
        runtime_config=json.dumps(dataclasses.asdict(config.runtime), sort_keys=True),
        budget_policy=json.dumps(config.budget_policy_dict(), sort_keys=True),
        tensorboard_dir=tensorboard_dir(config),
        code_fingerprint=_code(training.PrivateTrain, model_digests),
    ).with_id(PRIVATE_TRAIN)
    baseline_resolver = Resolver(
        strategy_class=LatestBlessedModelStrategy,
        model=Channel(type=standard_artifacts.Model),
        model_blessing=Channel(type=standard_artifacts.ModelBlessing),
    ).with_id(BASELINE_RESOLVER)
    evaluate = evaluation.EvaluateAndBless(
        model=private_train.outputs["model"],
        privacy_ledger=private_train.outputs["privacy_ledger"],
        examples=examples,
        baseline_model=baseline_resolver.outputs["model"],
        pretrained_backbone=backbone,
        privacy_budget_epsilon=config.evaluate.privacy_budget_epsilon,
        gate_far=config.evaluate.gate_far,
        max_recall_regression=config.evaluate.max_recall_regression,
        bootstrap_resamples=config.evaluate.bootstrap_resamples,
        confidence=config.evaluate.confidence,
        code_fingerprint=_code(evaluation.EvaluateAndBless, model_digests),
    ).with_id(EVALUATE)
    pusher = Pusher(
        model=private_train.outputs["model"],
        model_blessing=evaluate.outputs["blessing"],
        push_destination=pusher_pb2.PushDestination(
            filesystem=pusher_pb2.PushDestination.Filesystem(
                base_directory=os.path.abspath(config.serving_dir)
            )
        ),
    ).with_id(PUSHER)
    report = reporting.RenderReport(
        model_evaluation=evaluate.outputs["evaluation"],
        privacy_ledger=private_train.outputs["privacy_ledger"],
        training_metrics=private_train.outputs["training_metrics"],
        schedule_statistics=partition.outputs["schedule_statistics"],
        dedup_report=dedup.outputs["dedup_report"],
        pushed_model=pusher.outputs["pushed_model"],
        code_fingerprint=_code(reporting.RenderReport, ()),
    ).with_id(REPORT)
    return components + [private_train, baseline_resolver, evaluate, pusher, report]


def build_pipeline(
    config: config_lib.PipelineConfig,
    root: str | None = None,
    metadata_connection_config=None,
) -> Pipeline:
    """The pipeline; root and MLMD default to OUTPUT/pipeline_root and OUTPUT/metadata.sqlite.

    Compiled targets pass metadata_connection_config=None and their own root: the
    orchestrator there owns ML Metadata.
    """
    return Pipeline(
        pipeline_name=config.pipeline.name,
        pipeline_root=root or pipeline_root(config),
        components=build_components(config),
        enable_cache=config.pipeline.enable_cache,
        metadata_connection_config=metadata_connection_config,
        beam_pipeline_args=tfx_beam_args(config),
    )


# Beam options that tell TFX where Beam workers get their code (tfx.utils.dependency_utils).
_WORKER_CODE_OPTIONS = (
    "extra_packages",
    "setup_file",
    "requirements_file",
    "worker_harness_container_image",
    "sdk_container_image",
)


def tfx_beam_args(config: config_lib.PipelineConfig) -> list[str]:
    """The Beam arguments of TFX's own Beam components (StatisticsGen): `beam_args`, and
    for the DirectRunner the pipeline's image as the SDK container. Told nothing about
    the workers' code, TFX builds an sdist of itself for them in every run (2.3 s); the
    DirectRunner runs them in this process, which never reads it, and a DOCKER
    environment there should run the image that holds TFX and this project anyway."""
    arguments = list(config.pipeline.beam_args)
    options = records_io.pipeline_options(arguments)
    if options.view_as(StandardOptions).runner != records_io.DEFAULT_RUNNER:
        return arguments
    given = options.get_all_options()
    if any(given.get(name) for name in _WORKER_CODE_OPTIONS):
        return arguments
    return arguments + [f"--sdk_container_image={config.pipeline.image}"]


def local_metadata_config(config: config_lib.PipelineConfig):
    return metadata.sqlite_metadata_connection_config(metadata_path(config))

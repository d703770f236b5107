"""Data components: canonical ExampleGen, dedup, virtual-client partition and schedule.

Thin wrappers over beam_jobs: each stages its inputs, calls one library job with the
pipeline's Beam arguments, publishes the outputs into its artifacts and copies the
numbers a reader of ML Metadata wants (counts) into custom properties.
"""

import json
import os

import tensorflow as tf
from tensorflow_metadata.proto.v0 import anomalies_pb2
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputArtifact, Parameter
from tfx.dsl.component.experimental.decorators import component
from tfx.types import standard_artifacts

from pipeline import console
from pipeline.components import artifacts, layout

_STAGING = "_staging"


@component
def CanonicalExampleGen(
    examples: OutputArtifact[standard_artifacts.Examples],
    input_sources: Parameter[str],
    public_input_sources: Parameter[str],
    evaluation_input_sources: Parameter[str],
    synthetic_config: Parameter[str],
    synthetic_public_config: Parameter[str],
    split_config: Parameter[str],
    max_bad_fraction: Parameter[float],
    identity_feature: Parameter[str],
    max_image_pixels: Parameter[int],
    beam_args: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Ingests inputs into canonical records split by identity and user (Split-<name>).

    With no input sources the embedded synthetic dataset is rendered first (an image
    folder, read by the same loader a user's folder would be), and so is its public
    counterpart when `synthetic_public_config` is not null. Public sources are ingested
    apart and go whole to the public split, evaluation sources to the test split (their
    count is the custom property `evaluation_input_records`). Parameters holding lists or mappings are
    JSON; max_image_pixels 0 means the library default.
    """
    from beam_jobs import ingest, schema, split_protocols, splits, synthetic

    del code_fingerprint  # a cache key only (pipeline.fingerprint)
    staging = os.path.join(examples.uri, _STAGING)
    arguments = json.loads(beam_args)

    def ingested(sources: list[str], synthetic_json: str, name: str) -> tuple[str, dict]:
        """Ingests `sources` (or the synthetic dataset they default to) into STAGING/name."""
        if not sources:
            folder = os.path.join(staging, f"synthetic_{name}")
            synthetic.write_image_folder(
                folder, synthetic.SyntheticConfig(**json.loads(synthetic_json))
            )
            sources = [folder]
        out = os.path.join(staging, name)
        summary = ingest.run_ingest(
            sources,
            out,
            max_bad_fraction,
            arguments,
            identity_feature or None,
            max_image_pixels or schema.DEFAULT_MAX_IMAGE_PIXELS,
        )
        return out, summary

    private_dir, ingest_summary = ingested(json.loads(input_sources), synthetic_config, "ingested")
    config = split_protocols.SplitConfig(**json.loads(split_config))
    summaries = {"ingest": ingest_summary}
    public_dir = None
    if config.public_inputs:
        public_dir, summaries["ingest_public"] = ingested(
            json.loads(public_input_sources), synthetic_public_config, "ingested_public"
        )
    evaluation_dir = None
    if config.evaluation_inputs:
        evaluation_dir, summaries["ingest_evaluation"] = ingested(
            json.loads(evaluation_input_sources), "null", "ingested_evaluation"
        )
    summaries["split"] = split_summary = splits.run_split(
        private_dir, os.path.join(staging, "split"), config, arguments, public_dir, evaluation_dir
    )
    layout.publish_splits(os.path.join(staging, "split"), list(config.splits), examples)
    with tf.io.gfile.GFile(os.path.join(examples.uri, layout.SUMMARY_FILE), "w") as f:
        f.write(json.dumps(summaries, indent=1, sort_keys=True))
    layout.remove_tree(staging)
    examples.set_int_custom_property("records", ingest_summary["records"])
    examples.set_int_custom_property("bad_inputs", ingest_summary["bad"])
    if public_dir is not None:
        examples.set_int_custom_property("public_records", summaries["ingest_public"]["records"])
        examples.set_int_custom_property("public_bad_inputs", summaries["ingest_public"]["bad"])
    if evaluation_dir is not None:
        examples.set_int_custom_property(
            layout.EVALUATION_INPUT_RECORDS, summaries["ingest_evaluation"]["records"]
        )
    for split in config.splits:
        examples.set_int_custom_property(f"users_{split}", split_summary["users"][split])
    # The protocol the splits were made by (auto resolved): dedup and evaluation read it.
    examples.set_string_custom_property(layout.SPLIT_MODE, split_summary["mode"])
    read = [f"{ingest_summary['records']:,} private images"]
    if public_dir is not None:
        read.append(f"{summaries['ingest_public']['records']:,} public")
    if evaluation_dir is not None:
        read.append(f"{summaries['ingest_evaluation']['records']:,} evaluation-only")
    bad = sum(summary["bad"] for name, summary in summaries.items() if name.startswith("ingest"))
    users = ", ".join(f"{split} {split_summary['users'][split]:,}" for split in config.splits)
    console.note(
        f"read {' + '.join(read)} ({bad:,} bad inputs skipped); split mode "
        f"{split_summary['mode']}, users: {users}"
        + (
            f"; {split_summary['dropped_records']:,} records dropped"
            if split_summary["dropped_records"]
            else ""
        )
    )


def _anomalies_found(anomalies: standard_artifacts.ExampleAnomalies) -> list[str]:
    found = []
    for split in layout.split_names(anomalies):
        path = os.path.join(layout.split_dir(anomalies, split), "SchemaDiff.pb")
        report = anomalies_pb2.Anomalies()
        with tf.io.gfile.GFile(path, "rb") as f:
            report.ParseFromString(f.read())
        found.extend(f"{split}:{feature}" for feature in report.anomaly_info)
    return sorted(found)


@component
def DeduplicateSplits(
    examples: InputArtifact[standard_artifacts.Examples],
    anomalies: InputArtifact[standard_artifacts.ExampleAnomalies],
    deduplicated_examples: OutputArtifact[standard_artifacts.Examples],
    dedup_report: OutputArtifact[artifacts.DedupReport],
    dedup_config: Parameter[str],
    beam_args: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Removes train (and public) images equal or near to evaluation (and private) ones.

    Refuses data the ExampleValidator found anomalies in: validation gates what trains.
    Stops when dedup would remove more of a split than dedup.max_removed_fraction; the
    report then stays beside the (discarded) output artifact, and the error names it.
    """
    from beam_jobs import dedup

    del code_fingerprint
    found = _anomalies_found(anomalies)
    if found:
        raise ValueError(
            f"ExampleValidator found anomalies in {', '.join(found)}; see {anomalies.uri}"
        )
    staging = os.path.join(deduplicated_examples.uri, _STAGING)
    layout.stage_splits(examples, os.path.join(staging, "input"))
    try:
        report = dedup.run_dedup(
            os.path.join(staging, "input"),
            os.path.join(staging, "output"),
            dedup.DedupConfig(**json.loads(dedup_config)),
            json.loads(beam_args),
            layout.split_mode(examples),
        )
    except dedup.DedupRefused as refused:
        # TFX deletes a failed execution's output directories: the report moves next to
        # them, where the error line points.
        kept = f"{dedup_report.uri.rstrip('/')}-refused"
        tf.io.gfile.makedirs(kept)
        path = os.path.join(kept, dedup.REPORT_FILE)
        tf.io.gfile.copy(refused.report_path, path, overwrite=True)
        layout.remove_tree(staging)
        raise dedup.DedupRefused(refused.section, path) from None
    layout.publish_splits(
        os.path.join(staging, "output"), layout.split_names(examples), deduplicated_examples
    )
    deduplicated_examples.set_string_custom_property(layout.SPLIT_MODE, layout.split_mode(examples))
    if examples.has_custom_property(layout.EVALUATION_INPUT_RECORDS):
        # Where the test split came from: the evaluation and its texts read it.
        deduplicated_examples.set_int_custom_property(
            layout.EVALUATION_INPUT_RECORDS,
            examples.get_int_custom_property(layout.EVALUATION_INPUT_RECORDS),
        )
    tf.io.gfile.rename(
        os.path.join(staging, "output", dedup.REPORT_FILE),
        os.path.join(dedup_report.uri, dedup.REPORT_FILE),
    )
    layout.remove_tree(staging)
    for name, part in report.items():
        dedup_report.set_int_custom_property(
            f"{name}_removed", part["removed_exact"] + part["removed_near"]
        )
        dedup_report.set_float_custom_property(f"{name}_removed_fraction", part["removed_fraction"])
        dedup_report.set_float_custom_property(
            f"{name}_max_removed_fraction", part["max_removed_fraction"]
        )
        console.note(
            f"{part['candidate_split']}: removed {part['removed_exact']:,} exact and "
            f"{part['removed_near']:,} near copies of {part['reference_splits']} images, "
            f"kept {part['kept']:,} of {part['candidate_records']:,}"
        )


@component
def PartitionVirtualClients(
    examples: InputArtifact[standard_artifacts.Examples],
    partition: OutputArtifact[artifacts.VirtualClientPartition],
    schedule_statistics: OutputArtifact[artifacts.ScheduleStatistics],
    num_shards: Parameter[int],
    users_per_virtual_client: Parameter[int],
    virtual_clients_per_round: Parameter[str],
    over_selection: Parameter[float],
    rounds: Parameter[int],
    schedule_mode: Parameter[str],
    beam_args: Parameter[str],
    code_fingerprint: Parameter[str],
) -> None:
    """Shards the private train split by user and records the schedule's participation.

    `virtual_clients_per_round`: a count, or `auto` (beam_jobs.schedule.AUTO)."""
    from beam_jobs import partition_job, schedule, split_protocols
    from beam_jobs.partition import PARTICIPATION_FILE, ScheduleSpec

    del code_fingerprint
    planned = virtual_clients_per_round
    spec = ScheduleSpec(
        users_per_virtual_client,
        planned if planned == schedule.AUTO else int(planned),
        rounds,
        schedule_mode,
        over_selection,
    )
    partition_job.run_partition(
        layout.split_dir(examples, split_protocols.TRAIN),
        partition.uri,
        num_shards,
        spec,
        beam_args=json.loads(beam_args),
    )
    source = os.path.join(partition.uri, PARTICIPATION_FILE)
    with tf.io.gfile.GFile(source) as f:
        stats = schedule.ParticipationStats.from_json(f.read())
    tf.io.gfile.copy(
        source,
        os.path.join(schedule_statistics.uri, PARTICIPATION_FILE),
        overwrite=True,
    )
    partition.set_int_custom_property("users", stats.users)
    console.note(
        f"{stats.users:,} training users; {stats.rounds} rounds of "
        f"{stats.virtual_clients_per_round} virtual clients x {stats.users_per_virtual_client} "
        f"users; each user in at most {stats.max_participations} rounds"
    )
    for name, value in stats.to_dict().items():
        if isinstance(value, int):
            schedule_statistics.set_int_custom_property(name, value)
        else:
            schedule_statistics.set_string_custom_property(name, str(value))

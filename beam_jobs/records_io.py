"""On-disk layout shared by the Beam jobs, and their pipeline options.

Every job reads and writes canonical records (beam_jobs.schema) as TFRecord shards named
DIR/records-SSSSS-of-NNNNN.tfrecord, and writes its summary or report as one JSON file.
"""

import json
import logging
import os
import re
from collections.abc import Sequence

import apache_beam as beam
import numpy as np
import tensorflow as tf
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions, StandardOptions

RECORDS_PREFIX = "records"
RECORDS_SUFFIX = ".tfrecord"
DEFAULT_RUNNER = "DirectRunner"
PORTABLE_RUNNER = "PortableRunner"
# Runners that never read --job_endpoint (they run the job themselves, or on Dataflow).
_NON_PORTABLE_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "DataflowRunner")


def records_pattern(directory: str) -> str:
    return os.path.join(directory, f"{RECORDS_PREFIX}-*{RECORDS_SUFFIX}")


def pipeline_options(beam_args: Sequence[str] | None = None) -> PipelineOptions:
    """Standard Beam options from command-line style args; the runner is always named.

    Every option any runner defines passes through (DirectRunner, Dataflow, Flink,
    Spark, portable: docs/scaling.md). Without `--runner` the DirectRunner is named
    explicitly, so a newer Beam never falls back to a runner that downloads binaries at
    run time. An option no Beam options class knows is refused (ValueError): Beam would
    only log and drop it, so a typo such as --direct_num_wokers=2 would silently run a
    different job. PortableRunner without --job_endpoint, and --job_endpoint with a
    runner that ignores it, are refused too.
    """
    arguments = list(beam_args or [])
    for i, argument in enumerate(arguments):
        # A value either follows "=" or is the next argument after "--name".
        is_value = i > 0 and arguments[i - 1].startswith("--") and "=" not in arguments[i - 1]
        if not argument.startswith("--") and not is_value:
            raise ValueError(
                f"Beam pipeline options look like --name=value or --name value, got {argument!r}"
            )
    options = PipelineOptions(arguments)
    # Beam logs a warning per unknown option while parsing; the error below says it once.
    parser_log = logging.getLogger("apache_beam.options.pipeline_options")
    level = parser_log.level
    parser_log.setLevel(logging.ERROR)
    try:
        known = options.get_all_options()
        unknown = sorted(set(options.get_all_options(retain_unknown_options=True)) - set(known))
    finally:
        parser_log.setLevel(level)
    if unknown:
        raise ValueError(
            f"unknown Beam pipeline option --{unknown[0]} (no runner defines it; a typo?)"
        )
    if not options.view_as(StandardOptions).runner:
        options.view_as(StandardOptions).runner = DEFAULT_RUNNER
    _check_portable(options)
    return options


def _check_portable(options: PipelineOptions) -> None:
    """A job endpoint and a portable runner go together (docs/scaling.md).

    Without --job_endpoint, PortableRunner stops with a traceback deep in Beam; a
    --job_endpoint given to the DirectRunner or Dataflow is ignored, so the job would
    quietly run somewhere else than the user asked.
    """
    runner = options.view_as(StandardOptions).runner
    job_endpoint = options.view_as(PortableOptions).job_endpoint
    if runner == PORTABLE_RUNNER and not job_endpoint:
        raise ValueError(
            "--runner=PortableRunner needs --job_endpoint=HOST:PORT, the Beam job service "
            "to submit to (docs/scaling.md)"
        )
    if job_endpoint and runner in _NON_PORTABLE_RUNNERS:
        raise ValueError(
            f"--job_endpoint={job_endpoint} is read only by portable runners "
            f"(PortableRunner, FlinkRunner, SparkRunner), not --runner={runner}"
        )


def require_matches(pattern: str, what: str) -> list[str]:
    """Paths matching `pattern`; a clear ValueError when there are none."""
    paths = [m.path for m in FileSystems.match([pattern])[0].metadata_list]
    if not paths:
        raise ValueError(f"no {what} found at {pattern}")
    return sorted(paths)


class ReadRecords(beam.PTransform):
    """Reads serialized canonical records written by a previous job (trusted input)."""

    def __init__(self, directory: str):
        super().__init__()
        self._pattern = records_pattern(directory)
        require_matches(self._pattern, "record shards")

    def expand(self, pbegin):
        return pbegin | beam.io.ReadFromTFRecord(self._pattern)


def remove_interrupted_writes(path_prefix: str) -> list[str]:
    """Removes the staging folders that interrupted Beam writes to `path_prefix` left,
    and returns them.

    Beam's file sinks stage a write in <folder>/beam-temp-<prefix>-<uuid1 hex>/ and
    remove it when the write finishes; a killed job leaves it (one held a copy of the
    records: issue 63). Only folders so named after this job's own prefix, holding
    plain files only, are removed.
    """
    directory, prefix = os.path.split(path_prefix)
    staging = re.compile(rf"beam-temp-{re.escape(prefix)}-[0-9a-f]{{32}}")
    if not tf.io.gfile.isdir(directory):
        return []
    removed = []
    for name in sorted(entry.rstrip("/") for entry in tf.io.gfile.listdir(directory)):
        folder = os.path.join(directory, name)
        if not staging.fullmatch(name) or not tf.io.gfile.isdir(folder):
            continue
        if any(tf.io.gfile.isdir(os.path.join(folder, e)) for e in tf.io.gfile.listdir(folder)):
            continue  # not what Beam stages: left alone
        tf.io.gfile.rmtree(folder)
        removed.append(folder)
    return removed


class WriteRecords(beam.PTransform):
    """Writes serialized canonical records as DIR/records-*.tfrecord (an interrupted
    earlier write's staging folder removed first)."""

    def __init__(self, directory: str, num_shards: int = 0):
        super().__init__()
        self._directory = directory
        self._num_shards = num_shards
        remove_interrupted_writes(os.path.join(directory, RECORDS_PREFIX))

    def expand(self, records):
        return records | beam.io.WriteToTFRecord(
            os.path.join(self._directory, RECORDS_PREFIX),
            file_name_suffix=RECORDS_SUFFIX,
            num_shards=self._num_shards,
        )


class WriteJson(beam.PTransform):
    """Writes a single-element PCollection of a JSON-able object to one exact path (an
    interrupted earlier write's staging folder removed first)."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path
        remove_interrupted_writes(path)

    def expand(self, pcoll):
        return (
            pcoll
            | "ToJson" >> beam.Map(lambda value: json.dumps(value, indent=2, sort_keys=True))
            | "Write" >> beam.io.WriteToText(self._path, num_shards=1, shard_name_template="")
        )


def read_json(path: str) -> dict:
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


def count_records(directory: str) -> int:
    """Number of records in DIR/records-*.tfrecord (reads the framing, parses nothing)."""
    return count_matching_records(records_pattern(directory))


def count_matching_records(file_pattern: str) -> int:
    """Number of records in the TFRecord files matching `file_pattern` (reads the
    framing, parses nothing; tf.errors.DataLossError where it is corrupt)."""
    files = tf.io.gfile.glob(file_pattern)
    return int(tf.data.TFRecordDataset(files).reduce(np.int64(0), lambda count, _: count + 1))


def copy_records(source: str, target: str) -> None:
    """Copies SOURCE/records-*.tfrecord into TARGET/, names kept."""
    tf.io.gfile.makedirs(target)
    for path in tf.io.gfile.glob(records_pattern(source)):
        tf.io.gfile.copy(path, os.path.join(target, os.path.basename(path)), overwrite=True)


def remove_records(directory: str) -> None:
    for path in tf.io.gfile.glob(records_pattern(directory)):
        tf.io.gfile.remove(path)

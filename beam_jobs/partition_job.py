"""The Beam job that partitions canonical records by user (beam_jobs/partition.py holds
the layout, its writer per shard and the reader).

Records cross the job's one shuffle as files, not as elements: each bundle appends its
records to one spill file per shard (under PARTITION_DIR/SPILL_DIR), and only the files'
names are grouped by shard (beam_jobs/spill.py says why). Grouping names, the job holds one shard's records (sorted by `write_shard`) at a time
per worker (docs/scaling.md). The spill files are removed once every shard is written.
"""

import collections
import os
from collections.abc import Iterable, Sequence

import apache_beam as beam
import tensorflow as tf

from beam_jobs import progress, records_io, schema, spill
from beam_jobs.partition import (
    IDENTITIES,
    IDENTITIES_PER_USER,
    INDEX_DIR,
    MANIFEST_FILE,
    ScheduleSpec,
    build_manifest,
    read_manifest,
    shard_of_user,
    write_participation,
    write_shard,
)

# Under the partition directory while the job runs; removed after the manifest.
SPILL_DIR = spill.SPILL_DIR
# _WriteShardFn's second output: each identity a shard holds, once.
_IDENTITIES_TAG = "identities"


def identities_per_user_histogram(records: Iterable[tuple[str, str]]) -> dict[str, int]:
    """{distinct identities a user holds: users holding that many} of (user, identity)
    pairs; keys are strings (JSON)."""
    held = collections.defaultdict(set)
    for user_id, identity in records:
        held[user_id].add(identity)
    counts = collections.Counter(len(identities) for identities in held.values())
    return {str(n): users for n, users in sorted(counts.items())}


class _SpillByShardFn(beam.DoFn):
    """Serialized records -> one spill file per (bundle, shard) of TFRecord frames; yields
    (shard, file name) for each at the end of the bundle (`spill.SpillFiles`)."""

    def __init__(self, spill_dir: str, num_shards: int):
        self._spill_dir = spill_dir
        self._num_shards = num_shards

    def start_bundle(self):
        self._files = spill.SpillFiles(self._spill_dir)

    def process(self, serialized: bytes):
        shard = shard_of_user(schema.parse(serialized).user_id, self._num_shards)
        self._files.append(f"shard-{shard:05d}", serialized)

    def finish_bundle(self):
        for name, path in self._files.close().items():
            shard = int(name.removeprefix("shard-"))
            yield beam.transforms.window.GlobalWindows.windowed_value((shard, path))


def _spilled_records(paths: Iterable[str]) -> Iterable[tuple[str, str, bytes]]:
    """(user, identity, record) of each record in the spill files, file by file."""
    for path in sorted(paths):
        for serialized in spill.read_file(path):
            record = schema.parse(serialized)
            yield record.user_id, record.identity, serialized


class _WriteShardFn(beam.DoFn):
    """(shard, spill file names) -> part files and the shard index (`write_shard`); yields
    the shard's counts, with its users' identity counts (`partition.IDENTITIES_PER_USER`),
    and each identity the shard holds once (tagged `_IDENTITIES_TAG`)."""

    def __init__(self, partition_dir: str, max_part_bytes: int):
        self._partition_dir = partition_dir
        self._max_part_bytes = max_part_bytes

    def process(self, shard_files: tuple[int, Iterable[str]]):
        shard, paths = shard_files
        held = []  # (user, identity) of the shard's records, for the histogram

        def user_records():
            for user_id, identity, serialized in _spilled_records(paths):
                held.append((user_id, identity))
                yield user_id, serialized

        counts = write_shard(self._partition_dir, shard, user_records(), self._max_part_bytes)
        yield {**counts, IDENTITIES_PER_USER: identities_per_user_histogram(held)}
        for identity in {identity for _, identity in held}:
            yield beam.pvalue.TaggedOutput(_IDENTITIES_TAG, identity)


def _manifest_without_spill(
    shard_counts: list[dict], spill_dir: str, *args, identities: int
) -> dict:
    # Every shard is written once the counts are all here: the spill files are spent.
    spill.remove(spill_dir)
    return {**build_manifest(shard_counts, *args), IDENTITIES: identities}


class PartitionByUser(beam.PTransform):
    """Serialized canonical records -> files under partition_dir; returns the manifest."""

    def __init__(self, partition_dir: str, num_shards: int = 16, max_part_bytes: int = 64 << 20):
        super().__init__()
        if num_shards < 1 or max_part_bytes < 1:
            raise ValueError("num shards and max part bytes must be >= 1")
        self._partition_dir = partition_dir
        self._num_shards = num_shards
        self._max_part_bytes = max_part_bytes

    def expand(self, records):
        num_shards, partition_dir = self._num_shards, self._partition_dir
        spill_dir = os.path.join(partition_dir, SPILL_DIR)
        tf.io.gfile.makedirs(os.path.join(partition_dir, INDEX_DIR))
        tf.io.gfile.makedirs(spill_dir)
        written = (
            records
            | "SpillByShard" >> beam.ParDo(_SpillByShardFn(spill_dir, num_shards))
            | "GroupByShard" >> beam.GroupByKey()
            | "Progress" >> progress.Progress("partition", "shards written", total=num_shards)
            | "WriteShards"
            >> beam.ParDo(_WriteShardFn(partition_dir, self._max_part_bytes)).with_outputs(
                _IDENTITIES_TAG, main="counts"
            )
        )
        identities = (
            written[_IDENTITIES_TAG]
            | "DistinctIdentities" >> beam.Distinct()
            | "CountIdentities" >> beam.combiners.Count.Globally()
        )
        manifest = (
            written.counts
            | "ShardCounts" >> beam.combiners.ToList()
            | "Manifest"
            >> beam.Map(
                _manifest_without_spill,
                spill_dir,
                num_shards,
                self._max_part_bytes,
                identities=beam.pvalue.AsSingleton(identities),
            )
        )
        _ = manifest | "WriteManifest" >> records_io.WriteJson(
            os.path.join(partition_dir, MANIFEST_FILE)
        )
        return manifest


def run_partition(
    input_dir: str,
    partition_dir: str,
    num_shards: int = 16,
    schedule_spec: ScheduleSpec | None = None,
    max_part_bytes: int = 64 << 20,
    beam_args: Sequence[str] | None = None,
) -> dict:
    """Partitions INPUT_DIR/records-* into PARTITION_DIR; returns the manifest."""
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        _ = (
            pipeline
            | "Read" >> records_io.ReadRecords(input_dir)
            | "Progress"
            >> progress.Progress(
                # Counted first (a pass over the record framing): the line's total.
                "partition",
                "records read",
                total=records_io.count_records(input_dir),
            )
            | "Partition" >> PartitionByUser(partition_dir, num_shards, max_part_bytes)
        )
    if schedule_spec is not None:
        write_participation(partition_dir, schedule_spec)
    return read_manifest(partition_dir)


def write_training_inputs(
    out_dir: str,
    training: Iterable[schema.CanonicalRecord],
    held_out: Iterable[schema.CanonicalRecord] = (),
    num_shards: int = 16,
    beam_args: Sequence[str] | None = None,
) -> tuple[str, str]:
    """A training job's two inputs from in-memory records: OUT/partition and OUT/eval.

    `training` is partitioned by user (a real Beam pipeline); `held_out` goes to one
    TFRecord file in OUT/eval, left empty when none. Returns (partition_dir, eval_dir),
    the order `tff_algorithms.jobs.train_job.run_train_job` takes them in. For synthetic and
    test populations; real data goes through ingest, split and `run_partition`.
    """
    partition_dir, eval_dir = os.path.join(out_dir, "partition"), os.path.join(out_dir, "eval")
    serialized = [schema.serialize(record) for record in training]
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        _ = pipeline | beam.Create(serialized) | PartitionByUser(partition_dir, num_shards)
    tf.io.gfile.makedirs(eval_dir)
    with tf.io.TFRecordWriter(os.path.join(eval_dir, "records-00000-of-00001.tfrecord")) as w:
        for record in held_out:
            w.write(schema.serialize(record))
    return partition_dir, eval_dir

"""Partition: the sharded loader returns exactly each user's input records."""

import collections
import os

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import partition, partition_job, records_io, schedule, schema


def _records() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [
        schema.serialize(
            schema.CanonicalRecord(
                f"user{u:03d}",
                f"id{u}_{k % 2}",
                schema.encode_png(rng.integers(0, 255, (8, 8), dtype=np.uint8)),
            )
        )
        for u in range(40)
        for k in range(1 + u % 4)
    ]


@pytest.fixture(scope="module")
def partition_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("partition"))
    spec = partition.ScheduleSpec(
        users_per_virtual_client=2, virtual_clients_per_round=4, rounds=25, mode=schedule.EPOCH
    )
    # A small part limit forces several part files per shard.
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        manifest = (
            pipeline | beam.Create(_records()) | partition_job.PartitionByUser(directory, 3, 600)
        )
        assert_that(
            manifest | beam.Map(lambda m: (m["users"], m["records"])), equal_to([(40, 100)])
        )
    partition.write_participation(directory, spec)
    return directory


def test_loader_returns_each_users_records(partition_dir):
    expected = collections.defaultdict(list)
    for serialized in _records():
        expected[schema.parse(serialized).user_id].append(serialized)
    reader = partition.PartitionReader(partition_dir)
    assert reader.user_ids() == sorted(expected)
    for user_id, records in expected.items():
        assert sorted(partition.load_user_examples(partition_dir, user_id)) == sorted(records)
    assert len(reader.virtual_client_examples(["user001", "user002"])) == 2 + 3
    assert len(tf.io.gfile.glob(os.path.join(partition_dir, "shard-*.tfrecord"))) > 3
    # The records crossed the shuffle as spill files; none is left once the job is done.
    assert not os.path.exists(os.path.join(partition_dir, partition_job.SPILL_DIR))


def test_part_files_are_plain_tfrecords(partition_dir):
    files = sorted(tf.io.gfile.glob(os.path.join(partition_dir, "shard-*.tfrecord")))
    everything = [r.numpy() for r in tf.data.TFRecordDataset(files)]
    assert sorted(everything) == sorted(_records())


def test_tf_data_loader_and_unknown_user(partition_dir):
    reader = partition.PartitionReader(partition_dir)
    features = list(reader.dataset(["user003"]).as_numpy_iterator())
    assert [f[schema.USER_ID_KEY] for f in features] == [b"user003"] * 4
    with pytest.raises(ValueError, match="not in partition"):
        reader.user_examples("nobody")


def test_participation_statistics_are_written(partition_dir):
    stats = partition.PartitionReader(partition_dir).participation_stats()
    assert stats == schedule.VirtualClientSchedule(
        40, 2, 4, seed=0, mode=schedule.EPOCH
    ).participation_stats(25)
    assert (
        stats.users,
        stats.rounds_per_epoch,
        stats.max_participations,
        stats.min_separation,
    ) == (40, 5, 5, 4)


def test_partitioning_is_deterministic(partition_dir, tmp_path):
    source = str(tmp_path / "in")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = (
            pipeline
            | beam.Create(list(reversed(_records())))
            | records_io.WriteRecords(source, num_shards=2)
        )
    again = str(tmp_path / "again")
    spec = partition.ScheduleSpec(2, 4, 25, schedule.EPOCH)
    partition_job.run_partition(source, again, num_shards=3, schedule_spec=spec, max_part_bytes=600)
    names = sorted(
        os.path.relpath(p, partition_dir)
        for p in tf.io.gfile.glob(os.path.join(partition_dir, "**"))
    )
    for pattern in ("shard-*.tfrecord", "index/*.jsonl", "*.json"):
        first = sorted(tf.io.gfile.glob(os.path.join(partition_dir, pattern)))
        second = sorted(tf.io.gfile.glob(os.path.join(again, pattern)))
        assert [os.path.basename(p) for p in first] == [os.path.basename(p) for p in second], names
        for a, b in zip(first, second):
            with open(a, "rb") as fa, open(b, "rb") as fb:
                assert fa.read() == fb.read(), a


def test_manifest_counts_the_identities_each_user_holds(partition_dir):
    manifest = partition.read_manifest(partition_dir)
    # Independently: user u holds 1 + u % 4 records of identities id{u}_0, id{u}_1, ...
    held = collections.defaultdict(set)
    for serialized in _records():
        record = schema.parse(serialized)
        held[record.user_id].add(record.identity)
    expected = collections.Counter(len(identities) for identities in held.values())
    assert manifest[partition.IDENTITIES_PER_USER] == {str(n): c for n, c in expected.items()}
    assert expected == {1: 10, 2: 30}
    # The most identities k users hold together: the 2-identity users first.
    assert partition.most_identities_of_users(manifest, 2) == 4
    assert partition.most_identities_of_users(manifest, 35) == 30 * 2 + 5
    assert partition.most_identities_of_users(manifest, 100) == 70
    assert partition.most_identities_of_users({"users": 3}, 2) is None  # an older manifest
    # The distinct identities of all the records, counted across shards.
    assert manifest[partition.IDENTITIES] == len(set().union(*held.values())) == 70


def test_manifest_counts_identities_users_share_once(tmp_path):
    """Writers of the same characters: 12 users over 3 shards, each holding 3 of 5
    shared identities; the manifest counts 5, not 36."""
    records = [
        schema.serialize(schema.CanonicalRecord(f"writer{u}", f"char{(u + j) % 5}", b"x"))
        for u in range(12)
        for j in range(3)
    ]
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | partition_job.PartitionByUser(str(tmp_path), 3)
    manifest = partition.read_manifest(str(tmp_path))
    assert manifest[partition.IDENTITIES] == 5
    assert manifest[partition.IDENTITIES_PER_USER] == {"3": 12}

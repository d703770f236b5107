"""Virtual-client data read inside TFF from ids: same bytes as PartitionReader, own range only."""

import os
import shutil
import subprocess
import sys

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition, partition_job, records_io, schedule, schema, synthetic
from tff_algorithms.federated import client_data
from tff_algorithms.modeling import export

IMAGE_SHAPE = (28, 28, 1)
SYNTH = synthetic.SyntheticConfig(identities=12, images_per_identity=3, identities_per_user=2)


@pytest.fixture(scope="module")
def partition_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("partition"))
    records = [
        schema.serialize(r) for r in synthetic.records_for_identities(SYNTH, 0, SYNTH.identities)
    ]
    # Small parts: several users share a part file, and there are several part files.
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = (
            pipeline
            | beam.Create(records)
            | partition_job.PartitionByUser(directory, num_shards=2, max_part_bytes=12000)
        )
    return directory


def _ids(partition_dir: str, round_num: int, users_per_virtual_client: int = 2) -> list[str]:
    user_ids = partition.PartitionReader(partition_dir).user_ids()
    plan = schedule.VirtualClientSchedule(len(user_ids), users_per_virtual_client, 2, seed=3)
    return client_data.VirtualClientIds(partition_dir, plan, user_ids).for_round(round_num)


@tff.tensorflow.computation(np.str_)
def _records_in_tff(virtual_client_id):
    return (
        client_data.read_virtual_client_records(virtual_client_id)
        .batch(1 << 20)
        .get_single_element()
    )


def _users_of(partition_dir: str, round_num: int, virtual_client: int) -> list[str]:
    user_ids = partition.PartitionReader(partition_dir).user_ids()
    plan = schedule.VirtualClientSchedule(len(user_ids), 2, 2, seed=3)
    return [user_ids[i] for i in plan.virtual_client_user_indices(round_num, virtual_client)]


def test_loader_inside_tff_returns_what_partition_reader_returns(tff_runtime, partition_dir):
    reader = partition.PartitionReader(partition_dir)
    for round_num in (0, 1):
        for j, virtual_client_id in enumerate(_ids(partition_dir, round_num)):
            expected = reader.virtual_client_examples(_users_of(partition_dir, round_num, j))
            assert [bytes(r) for r in _records_in_tff(virtual_client_id)] == expected


def test_examples_are_decoded_like_the_serving_model(partition_dir):
    virtual_client_id = _ids(partition_dir, 0)[0]
    reader = partition.PartitionReader(partition_dir)
    expected = reader.virtual_client_examples(_users_of(partition_dir, 0, 0))
    loaded = list(client_data.load_examples(tf.constant(virtual_client_id), IMAGE_SHAPE))
    assert len(loaded) == len(expected) == 2 * 2 * SYNTH.images_per_identity
    for example, serialized in zip(loaded, expected, strict=True):
        record = schema.parse(serialized)
        assert example["identity"].numpy().decode() == record.identity
        np.testing.assert_array_equal(
            example["image"], export.decode_image(tf.constant(record.image), IMAGE_SHAPE)
        )


def test_reading_a_user_never_touches_other_users_bytes(tff_runtime, partition_dir, tmp_path):
    corrupted_dir = str(tmp_path / "corrupted")
    shutil.copytree(partition_dir, corrupted_dir)
    reader = partition.PartitionReader(corrupted_dir)
    locations = {u: reader.location(u) for u in reader.user_ids()}
    # Two users in the same part file: corrupt every byte of one, read the other.
    by_file: dict[str, list[str]] = {}
    for user, location in locations.items():
        by_file.setdefault(location.part_file, []).append(user)
    victim, neighbour = next(users for users in by_file.values() if len(users) >= 2)[:2]
    expected = reader.user_examples(neighbour)
    victim_location = locations[victim]
    with open(f"{corrupted_dir}/{victim_location.part_file}", "r+b") as f:
        f.seek(victim_location.offset)
        f.write(b"\xff" * victim_location.length)

    plan = schedule.VirtualClientSchedule(len(locations), 1, 1, seed=0)
    ids = client_data.VirtualClientIds(corrupted_dir, plan, sorted(locations))
    neighbour_id = client_data.virtual_client_id(0, 0, [ids.user_range(neighbour)])
    assert [bytes(r) for r in _records_in_tff(neighbour_id)] == expected
    # The corrupted user itself fails loudly rather than yielding garbage examples.
    victim_id = client_data.virtual_client_id(0, 0, [ids.user_range(victim)])
    with pytest.raises(tf.errors.OpError):
        list(client_data.read_virtual_client_records(tf.constant(victim_id)))


@pytest.mark.parametrize(
    "change", ["append a record", "append a byte", "cut the last byte", "delete it"]
)
def test_a_round_refuses_a_part_file_changed_since_it_was_written(partition_dir, tmp_path, change):
    changed_dir = str(tmp_path / "changed")
    shutil.copytree(partition_dir, changed_dir)
    reader = partition.PartitionReader(changed_dir)
    users = reader.user_ids()
    plan = schedule.VirtualClientSchedule(len(users), len(users), 1, seed=0)
    ids = client_data.VirtualClientIds(changed_dir, plan, users)
    assert len(ids.for_round(0)) == 1  # every user, every part file: unchanged, accepted
    part = os.path.join(changed_dir, reader.location(users[-1]).part_file)
    size = os.path.getsize(part)
    if change == "cut the last byte":
        os.truncate(part, size - 1)
    elif change == "delete it":
        os.remove(part)
    else:
        with open(part, "ab") as f:
            f.write(
                partition.tfrecord_frame(b"late record") if change == "append a record" else b"x"
            )
    with pytest.raises(client_data.StalePartitionError, match=os.path.basename(part)):
        ids.for_round(1)


def test_ids_carry_the_round_and_only_that_rounds_users(partition_dir):
    round0, round1 = _ids(partition_dir, 0), _ids(partition_dir, 1)
    assert len(round0) == 2 and all(i.startswith("round=0;virtual_client=") for i in round0)
    assert all(i.startswith("round=1;") for i in round1)
    users_per_id = [len(i.split(client_data.USER_SEPARATOR)) - 1 for i in round0]
    assert users_per_id == [2, 2]
    user_range = client_data.VirtualClientIds(
        partition_dir,
        schedule.VirtualClientSchedule(6, 1, 1, seed=0),
        partition.PartitionReader(partition_dir).user_ids(),
    ).user_range("u0")
    # Same users in another round: another id, so another local-head seed.
    assert client_data.virtual_client_id(0, 0, [user_range]) != client_data.virtual_client_id(
        1, 0, [user_range]
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"path": "a\x1fb"},
        {"offset": -1},
        {"length": 0},
        {"records": 0},
    ],
)
def test_byte_range_rejects_nonsense(kwargs):
    values = {"path": "/p", "offset": 0, "length": 10, "records": 1, **kwargs}
    with pytest.raises(ValueError):
        client_data.UserByteRange(**values)


def test_seeds_follow_round_and_virtual_client_not_where_the_data_lives():
    def seed_name(round_num: int, virtual_client: int, path: str, attempt: int = 0) -> bytes:
        user = client_data.UserByteRange(path, 0, 10, 1)
        vc_id = client_data.virtual_client_id(round_num, virtual_client, [user], attempt)
        return client_data.seed_name(tf.constant(vc_id)).numpy()

    assert seed_name(3, 1, "/data/a/part-0") == seed_name(3, 1, "/mnt/copy/part-0")
    names = {seed_name(3, 1, "/d"), seed_name(4, 1, "/d"), seed_name(3, 2, "/d")}
    assert len(names | {seed_name(3, 1, "/d", attempt=1)}) == 4


def _bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_a_user_deep_in_a_part_file_is_reached_by_a_seek_not_a_read_through(tmp_path):
    path = str(tmp_path / "part-0")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"\0" * (16 << 20))  # other users' 16 MiB before this user's records
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        tail = tmp_path / "tail"
        with tf.io.TFRecordWriter(str(tail)) as writer:
            writer.write(b"first")
            writer.write(b"second")
        f.write(tail.read_bytes())
    size = os.path.getsize(path)
    user = client_data.UserByteRange(path, offset, size - offset, 2)
    virtual_client_id = tf.constant(client_data.virtual_client_id(0, 0, [user]))
    list(client_data.read_virtual_client_records(virtual_client_id))  # builds the pipeline
    before = _bytes_read_by_this_process()
    records = [r.numpy() for r in client_data.read_virtual_client_records(virtual_client_id)]
    # Reading through the part file up to the user's offset would read >= 16 MiB.
    assert _bytes_read_by_this_process() - before < 1 << 20
    assert records == [b"first", b"second"]


@pytest.mark.slow
def test_the_workers_partition_reader_loads_no_beam():
    # A TFF worker imports client_data to read users; Beam belongs to the jobs that write.
    check = "import sys, tff_algorithms.federated.client_data; print('apache_beam' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "False"

"""Virtual-client data loaded inside TFF from the virtual client's id (docs/design.md section 3).

The training loop never holds users' examples in Python. For each round it turns the
schedule's virtual clients into string ids, and each client computation reads its
virtual client's records from the partition (`beam_jobs.partition`) inside the TFF
worker (`client_work.ClientLoader`).

An id carries everything the worker needs, looked up in Python from the partition's
shard indexes for the round's users only (O(users per round)):

    "round=<r>;[attempt=<a>;]virtual_client=<j>" RS user_1 RS user_2 ...
    user_i = part file path US byte offset US byte length US records

(RS = "\\x1e", US = "\\x1f", ASCII record and unit separators.) The round number is in
the id, so the client work's per-(round, virtual client) head seed, which hashes the
id, differs across rounds even for the same users; so is a retried round's attempt.

A user's records are read with TensorFlow's TFRecord reader from the user's byte
offset on (`TFRecordDatasetV2`'s `byte_offsets`: a seek, not a read through the part
file), exactly the indexed number of records, with the user's byte range as the read
buffer. Only the user's byte range is read and parsed, so other users' bytes never
influence the result. Costs and checks:
- I/O and CPU per user are O(user's bytes), whatever the user's offset in its part file
  (BENCHMARKS.md, "Loader").
- The reader verifies every frame's CRC32C; the frames must exactly tile the byte range
  and their number must equal the index's record count. So a corrupt or truncated part
  file never yields wrong examples: the user's read fails, and the client work drops the
  virtual client from the round (`failed_reads`, its `expected_examples` not met); a
  round with too few reports is retried, then stops the job with an error
  (`tff_algorithms.federated.dropouts`).
- Before each round, every part file the round reads must be exactly as long as its
  index says (where its last indexed record ends): a part file appended to, grown or
  shortened since the partition was written stops the job with `StalePartitionError`
  before the round spends any privacy budget. One stat per part file and round, in
  Python: a probe of each user's file end inside the client computation cost 4 ms a
  user, a third of a cached-feature client's time (BENCHMARKS.md, "Where a round's time
  goes"). Not caught: a part file rewritten to the same length with other records that
  happen to tile the user's byte range with valid CRCs, or a change between the round's
  check and its reads.
- Part file paths are absolute: every TFF worker must see the partition at the same path
  (a shared or cloud file system when workers run on other hosts).

Examples are parsed with the canonical schema's feature spec and images are decoded with
`export.decode_image`, the function the serving SavedModel uses, so training and serving
preprocess identically.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence

import tensorflow as tf

from beam_jobs import partition, schedule, schema
from tff_algorithms.modeling import export

USER_SEPARATOR = "\x1e"
FIELD_SEPARATOR = "\x1f"
# A TFRecord frame: 8-byte length, 4-byte length CRC, the record, 4-byte data CRC.
_FRAME_OVERHEAD_BYTES = 16


# What a `StalePartitionError` tells the user to do.
_REWRITE_PARTITION = (
    "write the partition again into a new directory and train from there (dp-fedemb train "
    "prepares its data under --output: train into a new --output)"
)


class StalePartitionError(ValueError):
    """A part file's length is not what the partition's index says: the partition
    changed after it was written."""


@dataclasses.dataclass(frozen=True)
class UserByteRange:
    """Where one user's records are: a byte range of a part file."""

    path: str
    offset: int
    length: int
    records: int

    def __post_init__(self) -> None:
        if USER_SEPARATOR in self.path or FIELD_SEPARATOR in self.path:
            raise ValueError(f"partition path {self.path!r} contains a control character")
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"byte range [{self.offset}, {self.offset + self.length}) of {self.path} "
                "is empty or starts before the file"
            )
        if self.records < 1:
            raise ValueError(f"a user range must hold at least one record, got {self.records}")


def virtual_client_id(
    round_num: int, virtual_client: int, user_ranges: Sequence[UserByteRange], attempt: int = 0
) -> str:
    """The id of virtual client `virtual_client` of round `round_num` (module docstring).

    A retried round's attempt number (> 0) is part of the id, so its head seeds differ.
    """
    if round_num < 0 or virtual_client < 0 or attempt < 0:
        raise ValueError(
            f"round, virtual client and attempt must be >= 0, got {round_num}, "
            f"{virtual_client}, {attempt}"
        )
    if not user_ranges:
        raise ValueError("a virtual client needs at least one user")
    users = [
        FIELD_SEPARATOR.join([r.path, str(r.offset), str(r.length), str(r.records)])
        for r in user_ranges
    ]
    retry = f"attempt={attempt};" if attempt else ""
    return USER_SEPARATOR.join(
        [f"round={round_num};{retry}virtual_client={virtual_client}", *users]
    )


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


class VirtualClientIds:
    """The virtual-client ids of each round, from a partition and a schedule.

    `user_ids` is the canonical user order the schedule's indices refer to
    (`PartitionReader.user_ids()`). A round costs one shard-index lookup per user (the
    reader caches shard indexes) and one stat per part file it reads (module docstring).
    """

    def __init__(
        self,
        partition_dir: str,
        plan: schedule.VirtualClientSchedule,
        user_ids: Sequence[str],
    ) -> None:
        if plan.num_users != len(user_ids):
            raise ValueError(
                f"the schedule is for {plan.num_users} users, the partition has {len(user_ids)}"
            )
        self._dir = _absolute(partition_dir)
        self._reader = partition.PartitionReader(self._dir)
        self._plan = plan
        self._user_ids = user_ids

    def user_range(self, user_id: str) -> UserByteRange:
        location = self._reader.location(user_id)
        path = os.path.join(self._dir, location.part_file)
        return UserByteRange(path, location.offset, location.length, location.records)

    def check_part_files(self, user_ids: Sequence[str]) -> None:
        """Raises `StalePartitionError` unless every part file holding these users exists
        and is exactly as long as its index says."""
        ends = {}
        for user_id in user_ids:
            path = os.path.join(self._dir, self._reader.location(user_id).part_file)
            ends[path] = self._reader.part_file_end(user_id)
        for path, end in sorted(ends.items()):
            try:
                size = tf.io.gfile.stat(path).length
            except tf.errors.NotFoundError:
                raise StalePartitionError(
                    f"part file {path} is missing: the partition changed after it was "
                    f"written; {_REWRITE_PARTITION}"
                ) from None
            if size != end:
                raise StalePartitionError(
                    f"part file {path} is {size} bytes but its index ends at byte {end}: "
                    f"the partition changed after it was written; {_REWRITE_PARTITION}"
                )

    def for_round(self, round_num: int, attempt: int = 0) -> list[str]:
        """Ids of the round's virtual clients; `attempt` > 0: a retry's fresh selection.
        Checks the part files they read first (`check_part_files`)."""
        groups = [
            [self._user_ids[i] for i in group]
            for group in self._plan.round_user_indices(round_num, attempt)
        ]
        self.check_part_files([user for group in groups for user in group])
        return [
            virtual_client_id(round_num, j, [self.user_range(user) for user in group], attempt)
            for j, group in enumerate(groups)
        ]


def _tfrecords_from(path: tf.Tensor, offset: tf.Tensor, buffer_bytes: tf.Tensor) -> tf.data.Dataset:
    """The TFRecords of one file from byte `offset` on, reached by a seek, CRCs verified.

    `tf.data.TFRecordDataset` has no byte-offset argument in TF 2.14, but its kernel
    (`TFRecordDatasetV2`) does. TF 2.14 cannot serialise that kernel's dataset (it writes
    3 of its 4 inputs), which tf.data does to optimise a pipeline it iterates: so this
    dataset may only be consumed inside an op (`get_single_element`), never iterated as
    a pipeline of its own or as a `flat_map`/`interleave` source.
    """
    variant = tf.raw_ops.TFRecordDatasetV2(
        filenames=tf.reshape(path, [1]),
        compression_type="",
        buffer_size=buffer_bytes,
        byte_offsets=tf.reshape(offset, [1]),
    )
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string)).with_options(
        client_dataset_options()
    )


def client_dataset_options() -> tf.data.Options:
    """Options for the datasets built anew for every user and virtual client in every
    round: no graph rewrites, no autotuning, no injected prefetch.

    They hold a few dozen elements, but with tf.data's default options each read
    first rebuilds and rewrites its dataset and starts autotuning, which costs more than
    reading and decoding the elements (BENCHMARKS.md, "Where a round's time goes").
    None of these changes an element or an order.
    """
    options = tf.data.Options()
    options.experimental_optimization.apply_default_optimizations = False
    options.experimental_optimization.inject_prefetch = False
    options.autotune.enabled = False
    return options


def _user_records(path, offset, length, records) -> tf.Tensor:  # noqa: ANN001
    """A user's records, string[records], as one op: a failed read (missing or corrupt
    file) fails this user's element once, which the client work's `ignore_errors` skips;
    the same failure in a file source dataset would repeat forever under
    `ignore_errors`."""
    # The read buffer is the user's byte range, so a correct index reads no other bytes.
    payloads = (
        _tfrecords_from(path, offset, length).take(records).batch(records).get_single_element()
    )
    read_bytes = tf.reduce_sum(
        tf.cast(tf.strings.length(payloads) + _FRAME_OVERHEAD_BYTES, tf.int64)
    )
    # `Assert` with string data only: `assert_equal` also prints its int64 operands,
    # for which TensorFlow guards it with a cond, and a cond's branches are instantiated
    # anew for every user a tf.data map reads (about 1.5 ms a user).
    checks = [
        tf.debugging.Assert(
            tf.equal(tf.cast(tf.size(payloads), tf.int64), records),
            ["user byte range holds fewer TFRecord frames than indexed"],
        ),
        tf.debugging.Assert(
            tf.equal(read_bytes, length),
            ["user byte range does not hold exactly the indexed number of TFRecord frames"],
        ),
    ]
    with tf.control_dependencies(checks):
        return tf.identity(payloads)


def _id_fields(virtual_client_id_tensor: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(part file paths string[users], numbers int64[users, 3]: offset, length, records)
    of a virtual-client id."""
    users = tf.strings.split(virtual_client_id_tensor, USER_SEPARATOR)[1:]
    fields = tf.strings.split(users, FIELD_SEPARATOR).to_tensor(shape=[None, 4])
    return fields[:, 0], tf.strings.to_number(fields[:, 1:], tf.int64)


def read_virtual_client_records(virtual_client_id_tensor: tf.Tensor) -> tf.data.Dataset:
    """Serialized canonical examples of a virtual client, users in id order. Traceable."""
    paths, numbers = _id_fields(virtual_client_id_tensor)
    ranges = (paths, numbers[:, 0], numbers[:, 1], numbers[:, 2])
    return tf.data.Dataset.from_tensor_slices(ranges).map(_user_records).unbatch()


def seed_name(virtual_client_id_tensor: tf.Tensor) -> tf.Tensor:
    """The id's "round=...;virtual_client=..." part, what the client's seeds hash. Traceable.

    The user fields hold absolute part-file paths; seeding from them would make the
    same job train differently when its partition is copied elsewhere.
    """
    return tf.strings.split(virtual_client_id_tensor, USER_SEPARATOR)[0]


def expected_examples(virtual_client_id_tensor: tf.Tensor) -> tf.Tensor:
    """int64 number of records the id's users hold (what a complete read yields). Traceable."""
    return tf.reduce_sum(_id_fields(virtual_client_id_tensor)[1][:, 2])


def parse_example(
    serialized: tf.Tensor, image_shape: tuple[int, int, int]
) -> collections.OrderedDict:
    """Serialized canonical example -> {"image": float32 [H, W, C] in [0, 1], "identity"}."""
    features = tf.io.parse_single_example(serialized, schema.FEATURE_SPEC)
    return collections.OrderedDict(
        image=export.decode_image(features[schema.IMAGE_KEY], image_shape),
        identity=features[schema.IDENTITY_KEY],
    )


def load_examples(
    virtual_client_id_tensor: tf.Tensor, image_shape: tuple[int, int, int]
) -> tf.data.Dataset:
    """Per-example `{"image", "identity"}` of a virtual client: the client work's input."""
    return read_virtual_client_records(virtual_client_id_tensor).map(
        lambda serialized: parse_example(serialized, image_shape)
    )

"""Virtual-client data loaded inside TFF from the virtual client's id (DESIGN.md section 9).

The training loop never holds users' examples in Python. For each round it turns the
schedule's virtual clients into string ids, and a TFF dataset computation
(`processes.compose_with_client_loader`) reads each virtual client's records from the
partition (`beam_jobs.partition`) inside the TFF worker.

An id carries everything the worker needs, looked up in Python from the partition's
shard indexes for the round's users only (O(users per round)):

    "round=<r>;[attempt=<a>;]virtual_client=<j>" RS user_1 RS user_2 ...
    user_i = part file path US byte offset US byte length US part file size US records

(RS = "\\x1e", US = "\\x1f", ASCII record and unit separators.) The round number is in
the id, so the client work's per-(round, virtual client) head seed, which hashes the
id, differs across rounds even for the same users; so is a retried round's attempt.

TFRecord readers have no byte-range option, so a user's bytes are read with
`tf.data.FixedLengthRecordDataset` as one record of `length` bytes between a header of
`offset` bytes and a footer of the rest of the file; the TFRecord frames (8-byte
little-endian length, 4-byte CRC, data, 4-byte CRC) are split in graph. Only the
user's byte range is parsed, so other users' bytes never influence the result.
Costs and checks:
- TF skips the header by reading through it, so I/O per user is O(offset), bounded by
  the partition's part-file size (`max_part_bytes`); the CPU cost is O(user's bytes).
- TF has no CRC32C op, so checksums are not verified in graph (`PartitionReader` does
  verify them); instead the frames must exactly tile the byte range, their number must
  equal the index's record count, and the file size must equal the index-time size
  (`FixedLengthRecordDataset` fails otherwise), so a stale index or a truncated or
  rewritten part file never yields wrong examples: the user's read fails, and the
  client work drops the virtual client from the round (`failed_reads`, its
  `expected_examples` not met); a round with too few reports is retried, then stops
  the job with an error (`tff_algorithms.dropouts`).
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
from tff_algorithms import export

USER_SEPARATOR = "\x1e"
FIELD_SEPARATOR = "\x1f"
_FRAME_HEADER_BYTES = 12  # 8-byte length + 4-byte length CRC
_FRAME_OVERHEAD_BYTES = 16  # header + 4-byte data CRC


@dataclasses.dataclass(frozen=True)
class UserByteRange:
    """Where one user's records are: a byte range of a part file."""

    path: str
    offset: int
    length: int
    file_size: int
    records: int

    def __post_init__(self) -> None:
        if USER_SEPARATOR in self.path or FIELD_SEPARATOR in self.path:
            raise ValueError(f"partition path {self.path!r} contains a control character")
        if self.offset < 0 or self.length < 1 or self.offset + self.length > self.file_size:
            raise ValueError(
                f"byte range [{self.offset}, {self.offset + self.length}) is not inside "
                f"{self.path} of {self.file_size} bytes"
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
        FIELD_SEPARATOR.join(
            [r.path, str(r.offset), str(r.length), str(r.file_size), str(r.records)]
        )
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
    reader caches shard indexes) and one file-size lookup per new part file.
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
        self._file_sizes: dict[str, int] = {}

    def _file_size(self, path: str) -> int:
        if path not in self._file_sizes:
            self._file_sizes[path] = tf.io.gfile.stat(path).length
        return self._file_sizes[path]

    def user_range(self, user_id: str) -> UserByteRange:
        location = self._reader.location(user_id)
        path = os.path.join(self._dir, location.part_file)
        return UserByteRange(
            path, location.offset, location.length, self._file_size(path), location.records
        )

    def for_round(self, round_num: int, attempt: int = 0) -> list[str]:
        """Ids of the round's virtual clients; `attempt` > 0: a retry's fresh selection."""
        groups = self._plan.round_user_indices(round_num, attempt)
        return [
            virtual_client_id(
                round_num, j, [self.user_range(self._user_ids[i]) for i in group], attempt
            )
            for j, group in enumerate(groups)
        ]


def _split_frames(data: tf.Tensor, num_records: tf.Tensor) -> tf.Tensor:
    """Concatenated TFRecord frames (one scalar string) -> their payloads, string[num_records]."""

    def body(i, position, payloads):
        length_bytes = tf.strings.substr(data, position, 8)
        length = tf.io.decode_raw(length_bytes, tf.int64, little_endian=True)[0]
        payload = tf.strings.substr(data, position + _FRAME_HEADER_BYTES, length)
        return i + 1, position + _FRAME_OVERHEAD_BYTES + length, payloads.write(i, payload)

    num_records = tf.cast(num_records, tf.int32)

    _, end, payloads = tf.while_loop(
        lambda i, position, payloads: i < num_records,
        body,
        (
            tf.constant(0, tf.int32),
            tf.constant(0, tf.int64),
            tf.TensorArray(tf.string, size=num_records),
        ),
    )
    tiled = tf.debugging.assert_equal(
        end,
        tf.cast(tf.strings.length(data), tf.int64),
        message="user byte range does not hold exactly the indexed number of TFRecord frames",
    )
    with tf.control_dependencies([tiled]):
        return tf.identity(payloads.stack())


def _user_bytes(path, offset, length, file_size) -> tf.Tensor:  # noqa: ANN001 - tensors
    """A user's byte range, as one op: a failed read (missing or resized file) fails this
    user's element once, which the client work's `ignore_errors` skips; the same failure
    in a file source dataset would repeat forever under `ignore_errors`."""
    return tf.data.FixedLengthRecordDataset(
        path, record_bytes=length, header_bytes=offset, footer_bytes=file_size - offset - length
    ).get_single_element()


def _id_fields(virtual_client_id_tensor: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(part file paths string[users], numbers int64[users, 4]) of a virtual-client id."""
    users = tf.strings.split(virtual_client_id_tensor, USER_SEPARATOR)[1:]
    fields = tf.strings.split(users, FIELD_SEPARATOR).to_tensor(shape=[None, 5])
    return fields[:, 0], tf.strings.to_number(fields[:, 1:], tf.int64)


def read_virtual_client_records(virtual_client_id_tensor: tf.Tensor) -> tf.data.Dataset:
    """Serialized canonical examples of a virtual client, users in id order. Traceable."""
    paths, numbers = _id_fields(virtual_client_id_tensor)
    ranges = (paths, numbers[:, 0], numbers[:, 1], numbers[:, 2], numbers[:, 3])
    return (
        tf.data.Dataset.from_tensor_slices(ranges)
        .map(
            lambda path, offset, length, file_size, records: (
                _user_bytes(path, offset, length, file_size),
                records,
            )
        )
        .flat_map(
            lambda data, records: tf.data.Dataset.from_tensor_slices(_split_frames(data, records))
        )
    )


def seed_name(virtual_client_id_tensor: tf.Tensor) -> tf.Tensor:
    """The id's "round=...;virtual_client=..." part, what the client's seeds hash. Traceable.

    The user fields hold absolute part-file paths; seeding from them would make the
    same job train differently when its partition is copied elsewhere.
    """
    return tf.strings.split(virtual_client_id_tensor, USER_SEPARATOR)[0]


def expected_examples(virtual_client_id_tensor: tf.Tensor) -> tf.Tensor:
    """int64 number of records the id's users hold (what a complete read yields). Traceable."""
    return tf.reduce_sum(_id_fields(virtual_client_id_tensor)[1][:, 3])


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

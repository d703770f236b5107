"""User-sharded partition of training records: its files, their writer and reader.

No Beam here: the TFF worker reads a partition through this module
(tff_algorithms.federated.client_data), and the Beam job that writes one
(beam_jobs/partition_job.py) calls `write_shard` for each shard.

Layout under PARTITION_DIR:
- shard-SSSSS-part-PPPPP.tfrecord: users hash into `num_shards` shards; within a shard
  users are sorted and each user's records are contiguous; a shard rolls over to a new
  part file past `max_part_bytes`, never splitting a user.
- index/shard-SSSSS.jsonl: one line per user of the shard, sorted:
  [user_id, part file, byte offset, byte length, record count].
- manifest.json: shard count, users/records per shard, the hash that maps users to shards,
  and how many users hold how many distinct identities (`IDENTITIES_PER_USER`).
- participation.json: ParticipationStats of the virtual-client schedule over this
  population (beam_jobs.schedule), for the privacy accountant.

A reader hashes the user to its shard, looks the user up in that shard's index (loaded
once, cached) and reads exactly the user's byte range: loading a user or virtual client
costs O(its data), and 10^6 users need only num_shards index files and a few part files
per shard, never a file per user.
"""

import collections
import dataclasses
import functools
import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence

import google_crc32c
import tensorflow as tf

from beam_jobs import schedule, schema

MANIFEST_FILE = "manifest.json"
PARTICIPATION_FILE = "participation.json"
INDEX_DIR = "index"
# Manifest key: {distinct identities a user holds: users holding that many}, what a local
# head must have room for (`most_identities_of_users`).
IDENTITIES_PER_USER = "identities_per_user"
# The distinct identities of the partition's records (manifests from before have none).
IDENTITIES = "identities"
SHARD_HASH = "blake2b-64 of UTF-8 user id, big endian, mod num_shards"


def shard_of_user(user_id: str, num_shards: int) -> int:
    digest = hashlib.blake2b(user_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def _masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_frame(record: bytes) -> bytes:
    """One record in the TFRecord wire format (readable by tf.data.TFRecordDataset)."""
    length = struct.pack("<Q", len(record))
    return (
        length
        + struct.pack("<I", _masked_crc32c(length))
        + record
        + struct.pack("<I", _masked_crc32c(record))
    )


def parse_tfrecord_frames(data: bytes) -> list[bytes]:
    """Inverse of concatenated tfrecord_frame()s, checking both checksums."""
    records, position = [], 0
    while position < len(data):
        (length,) = struct.unpack_from("<Q", data, position)
        (length_crc,) = struct.unpack_from("<I", data, position + 8)
        record = data[position + 12 : position + 12 + length]
        (record_crc,) = struct.unpack_from("<I", data, position + 12 + length)
        if length_crc != _masked_crc32c(
            data[position : position + 8]
        ) or record_crc != _masked_crc32c(record):
            raise ValueError("partition data is corrupt (TFRecord checksum mismatch)")
        records.append(record)
        position += 16 + length
    return records


def _part_name(shard: int, part: int) -> str:
    return f"shard-{shard:05d}-part-{part:05d}.tfrecord"


def _index_path(partition_dir: str, shard: int) -> str:
    return os.path.join(partition_dir, INDEX_DIR, f"shard-{shard:05d}.jsonl")


def write_shard(
    partition_dir: str,
    shard: int,
    records: Iterable[tuple[str, bytes]],
    max_part_bytes: int,
    keep_order: bool = False,
) -> dict:
    """One shard's part files and index from its (user id, serialized record) pairs;
    returns the shard's counts for `build_manifest`. What `partition_job.PartitionByUser` does for each
    shard, callable without a pipeline.

    Files are written under temporary names and renamed (the index last), so a retried
    bundle leaves complete files only. `keep_order`: a user's records keep their given
    order (a derived partition that must match its source's record for record, such as
    `tff_algorithms.federated.feature_cache`) instead of being sorted by their bytes.
    """
    # Sorting by (user, bytes) makes the files identical across runs.
    ordered = sorted(records, key=lambda r: r[0]) if keep_order else sorted(records)
    index_lines, part, part_bytes, writer, temporaries = [], 0, 0, None, []
    position = 0
    while position < len(ordered):
        user_id = ordered[position][0]
        end = position
        while end < len(ordered) and ordered[end][0] == user_id:
            end += 1
        frames = b"".join(tfrecord_frame(r) for _, r in ordered[position:end])
        if writer is None or (part_bytes and part_bytes + len(frames) > max_part_bytes):
            if writer is not None:
                writer.close()
                part += 1
            final = os.path.join(partition_dir, _part_name(shard, part))
            temporaries.append((final + ".tmp", final))
            writer, part_bytes = tf.io.gfile.GFile(final + ".tmp", "wb"), 0
        writer.write(frames)
        index_lines.append(
            json.dumps([user_id, _part_name(shard, part), part_bytes, len(frames), end - position])
        )
        part_bytes += len(frames)
        position = end
    writer.close()
    index_temporary = _index_path(partition_dir, shard) + ".tmp"
    with tf.io.gfile.GFile(index_temporary, "w") as f:
        f.write("\n".join(index_lines) + "\n")
    temporaries.append((index_temporary, _index_path(partition_dir, shard)))
    for temporary, final in temporaries:
        tf.io.gfile.rename(temporary, final, overwrite=True)
    return {
        "shard": shard,
        "users": len(index_lines),
        "records": len(ordered),
        "parts": part + 1,
    }


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """Schedule parameters the partition job records participation statistics for.

    virtual_clients_per_round may be `schedule.AUTO`: resolved from the partition's
    users (`schedule.largest_virtual_clients_per_round`, at `over_selection`).
    """

    users_per_virtual_client: int
    virtual_clients_per_round: int | str
    rounds: int
    mode: str = schedule.SAMPLED
    over_selection: float = 0.0

    def shape(self, num_users: int) -> schedule.ScheduleShape:
        """The trained schedule (`schedule.trained_shape`): over-selected rounds count
        every selected virtual client."""
        return schedule.trained_shape(
            num_users,
            self.users_per_virtual_client,
            self.virtual_clients_per_round,
            self.mode,
            self.over_selection,
        )


def build_manifest(shard_counts: list[dict], num_shards: int, max_part_bytes: int) -> dict:
    """manifest.json's content from every written shard's counts (`write_shard`), with
    the users' identity counts summed when the shards carry them (`IDENTITIES_PER_USER`)."""
    by_shard = {c["shard"]: c for c in shard_counts}
    extra = {}
    if shard_counts and all(IDENTITIES_PER_USER in c for c in shard_counts):
        histogram = collections.Counter()
        for c in shard_counts:
            histogram.update({int(n): users for n, users in c[IDENTITIES_PER_USER].items()})
        extra[IDENTITIES_PER_USER] = {str(n): histogram[n] for n in sorted(histogram)}
    return {
        "num_shards": num_shards,
        "shard_hash": SHARD_HASH,
        "max_part_bytes": max_part_bytes,
        "users": sum(c["users"] for c in shard_counts),
        "records": sum(c["records"] for c in shard_counts),
        "shards": [
            by_shard.get(s, {"shard": s, "users": 0, "records": 0, "parts": 0})
            for s in range(num_shards)
        ],
        **extra,
    }


def most_identities_of_users(manifest: dict, num_users: int) -> int | None:
    """The most distinct identities any `num_users` users of the partition hold together
    (the sum of the largest per-user counts), or None for a manifest written without
    `IDENTITIES_PER_USER` (older partitions)."""
    histogram = manifest.get(IDENTITIES_PER_USER)
    if histogram is None:
        return None
    total, left = 0, num_users
    for n in sorted((int(k) for k in histogram), reverse=True):
        taken = min(left, histogram[str(n)])
        total, left = total + n * taken, left - taken
        if not left:
            break
    return total


def read_manifest(partition_dir: str) -> dict:
    with tf.io.gfile.GFile(os.path.join(partition_dir, MANIFEST_FILE)) as f:
        return json.load(f)


def participation(manifest: dict, spec: ScheduleSpec) -> dict:
    """The participation statistics of `spec` over the manifest's users. Counts only:
    the partition never sees the (secret) schedule seed."""
    return spec.shape(manifest["users"]).participation_stats(spec.rounds).to_dict()


def write_participation(partition_dir: str, spec: ScheduleSpec) -> dict:
    """participation.json of a written partition. Outside Beam: a schedule the users
    cannot fill is one ValueError line, not a worker traceback."""
    manifest = read_manifest(partition_dir)
    stats = participation(manifest, spec)
    with tf.io.gfile.GFile(os.path.join(partition_dir, PARTICIPATION_FILE), "w") as f:
        f.write(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


@dataclasses.dataclass(frozen=True)
class UserLocation:
    part_file: str
    offset: int
    length: int
    records: int


class PartitionReader:
    """Random access to one user's (or virtual client's) records in a partition."""

    def __init__(self, partition_dir: str):
        manifest_path = os.path.join(partition_dir, MANIFEST_FILE)
        if not tf.io.gfile.exists(manifest_path):
            raise ValueError(f"{partition_dir} is not a partition (no {MANIFEST_FILE})")
        self._dir = partition_dir
        self.manifest = read_manifest(partition_dir)
        self._shard_index = functools.lru_cache(maxsize=None)(self._load_shard_index)
        self._part_file_ends = functools.lru_cache(maxsize=None)(self._indexed_part_file_ends)

    @property
    def num_users(self) -> int:
        return self.manifest["users"]

    def _load_shard_index(self, shard: int) -> dict[str, UserLocation]:
        path = _index_path(self._dir, shard)
        if not tf.io.gfile.exists(path):
            return {}
        with tf.io.gfile.GFile(path) as f:
            return {e[0]: UserLocation(*e[1:]) for e in map(json.loads, f.read().splitlines()) if e}

    def _indexed_part_file_ends(self, shard: int) -> dict[str, int]:
        ends: dict[str, int] = {}
        for entry in self._shard_index(shard).values():
            ends[entry.part_file] = max(ends.get(entry.part_file, 0), entry.offset + entry.length)
        return ends

    def part_file_end(self, user_id: str) -> int:
        """Where the indexed records of the part file holding `user_id` end: the size
        of that part file as written (`write_shard` writes nothing else into it)."""
        shard = shard_of_user(user_id, self.manifest["num_shards"])
        return self._part_file_ends(shard)[self.location(user_id).part_file]

    def location(self, user_id: str) -> UserLocation:
        entry = self._shard_index(shard_of_user(user_id, self.manifest["num_shards"])).get(user_id)
        if entry is None:
            raise ValueError(f"user {user_id!r} is not in partition {self._dir}")
        return entry

    def user_examples(self, user_id: str) -> list[bytes]:
        """The user's serialized canonical examples, read from its byte range only."""
        entry = self.location(user_id)
        with tf.io.gfile.GFile(os.path.join(self._dir, entry.part_file), "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.length)
        return parse_tfrecord_frames(data)

    def user_records(self, user_id: str) -> list[schema.CanonicalRecord]:
        return [schema.parse(s) for s in self.user_examples(user_id)]

    def virtual_client_examples(self, user_ids: Sequence[str]) -> list[bytes]:
        return [example for user_id in user_ids for example in self.user_examples(user_id)]

    def dataset(self, user_ids: Sequence[str]) -> tf.data.Dataset:
        """tf.data of parsed canonical features (schema.FEATURE_SPEC) for these users."""
        examples = self.virtual_client_examples(user_ids)
        serialized = tf.data.Dataset.from_tensor_slices(
            tf.constant(examples, dtype=tf.string, shape=[len(examples)])
        )
        return serialized.map(schema.parse_tf_example)

    def user_ids(self) -> list[str]:
        """All user ids, sorted: the canonical order the schedule's user indices refer to.

        Loads every shard index (O(users)); per-round loading never needs it.
        """
        return sorted(u for s in range(self.manifest["num_shards"]) for u in self._shard_index(s))

    def participation_stats(self) -> schedule.ParticipationStats:
        path = os.path.join(self._dir, PARTICIPATION_FILE)
        if not tf.io.gfile.exists(path):
            raise ValueError(f"partition {self._dir} has no {PARTICIPATION_FILE}")
        with tf.io.gfile.GFile(path) as f:
            return schedule.ParticipationStats.from_json(f.read())


@functools.lru_cache(maxsize=8)
def _reader(partition_dir: str) -> PartitionReader:
    return PartitionReader(partition_dir)


def load_user_examples(partition_dir: str, user_id: str) -> list[bytes]:
    """One user's serialized canonical examples (readers are cached per directory)."""
    return _reader(partition_dir).user_examples(user_id)

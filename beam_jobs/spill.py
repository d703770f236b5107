"""Records that cross a Beam shuffle as files (spill files), not as grouped elements.

Beam's in-memory runner (the DirectRunner's FnApiRunner, Beam 2.59) keeps every element
it groups in its own process, with no spill to disk: grouping the records themselves
holds the whole dataset there (docs/scaling.md). Instead each bundle appends its records
to files of TFRecord frames under a spill folder (under the job's output directory, which
every worker writes and reads anyway), and only small references are grouped:
- partition_job: the files' names, by shard (`SpillFiles`);
- splits: per key (a user, an identity) and bundle, the file's name and the offsets of
  the key's records in it (`SpillByKey`), read back by `SpillReader` one key at a time.

The job removes its spill folder (`remove`) once every spilled record is read back.
"""

import os
import struct
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import apache_beam as beam
import tensorflow as tf

from beam_jobs.partition import parse_tfrecord_frames, tfrecord_frame

# A job's spill folder, under its output directory; removed when the job is done.
SPILL_DIR = "spill.tmp"
_HEADER = 12  # a TFRecord frame's length (8 bytes) and its checksum (4)
_OFFSET = struct.Struct("<Q")


class SpillFiles:
    """One bundle's spill files: `append` writes a record to the file of a name, created
    on first use as SPILL_DIR/NAME-<bundle id>.frames (a retried bundle writes new files,
    and the names of a failed one are never emitted)."""

    def __init__(self, spill_dir: str):
        self._spill_dir = spill_dir
        self._bundle = uuid.uuid4().hex
        self._files: dict[str, tuple[str, Any]] = {}
        self._sizes: dict[str, int] = {}

    def append(self, name: str, record: bytes) -> int:
        """Writes `record` to NAME's file; returns its byte offset there."""
        if name not in self._files:
            path = os.path.join(self._spill_dir, f"{name}-{self._bundle}.frames")
            self._files[name] = (path, tf.io.gfile.GFile(path, "wb"))
            self._sizes[name] = 0
        frame = tfrecord_frame(record)
        self._files[name][1].write(frame)
        offset = self._sizes[name]
        self._sizes[name] += len(frame)
        return offset

    def close(self) -> dict[str, str]:
        """Closes the files; {name: path} of each, sorted by name."""
        for _, spill in self._files.values():
            spill.close()
        return {name: path for name, (path, _) in sorted(self._files.items())}


def read_file(path: str) -> list[bytes]:
    """Every record of one spill file, in the order written."""
    with tf.io.gfile.GFile(path, "rb") as spill:
        return parse_tfrecord_frames(spill.read())


class _SpillByKeyFn(beam.DoFn):
    """(key, record) -> (key, (file name, packed offsets)) once per key and bundle, at the
    end of the bundle, keys in the order they first came: a runner that groups in arrival
    order (the FnApiRunner) then orders keys, and each key's records, as it would have
    grouping the records themselves."""

    _FILE = "records"

    def __init__(self, spill_dir: str):
        self._spill_dir = spill_dir

    def start_bundle(self):
        self._files = SpillFiles(self._spill_dir)
        self._offsets: dict[Any, list[int]] = {}

    def process(self, keyed: tuple[Any, bytes]):
        key, record = keyed
        self._offsets.setdefault(key, []).append(self._files.append(self._FILE, record))

    def finish_bundle(self):
        paths = self._files.close()
        if not paths:
            return
        name = os.path.basename(paths[self._FILE])
        for key, offsets in self._offsets.items():
            packed = b"".join(_OFFSET.pack(offset) for offset in offsets)
            yield beam.transforms.window.GlobalWindows.windowed_value((key, (name, packed)))


class SpillByKey(beam.PTransform):
    """(key, serialized record) -> (key, reference): the records go to spill files under
    `spill_dir`; a reference (a file name and the offsets of the key's records in it, 8
    bytes each) is what a GroupByKey or CoGroupByKey after this groups. `SpillReader`
    reads the records back."""

    def __init__(self, spill_dir: str):
        super().__init__()
        self._spill_dir = spill_dir

    def expand(self, keyed):
        tf.io.gfile.makedirs(self._spill_dir)
        return keyed | beam.ParDo(_SpillByKeyFn(self._spill_dir))


def records_referenced(reference: tuple[str, bytes]) -> int:
    """How many records one of `SpillByKey`'s references points to."""
    return len(reference[1]) // _OFFSET.size


class SpillReader:
    """Reads records back from `SpillByKey`'s references; keeps its files open (one per
    bundle that spilled) until `close`."""

    def __init__(self, spill_dir: str):
        self._spill_dir = spill_dir
        self._files: dict[str, Any] = {}

    def records(self, references: Iterable[tuple[str, bytes]]) -> list[bytes]:
        """The records of the references, in order."""
        records = []
        for name, packed in references:
            if name not in self._files:
                self._files[name] = tf.io.gfile.GFile(os.path.join(self._spill_dir, name), "rb")
            spill = self._files[name]
            for (offset,) in _OFFSET.iter_unpack(packed):
                spill.seek(offset)
                header = spill.read(_HEADER)
                (length,) = _OFFSET.unpack_from(header)
                # The frame's own checksums are checked as any other frame's.
                records.extend(parse_tfrecord_frames(header + spill.read(length + 4)))
        return records

    def close(self) -> None:
        for spill in self._files.values():
            spill.close()
        self._files = {}


class WithSpilledRecords(beam.DoFn):
    """Calls `fn((key, records), *args, *side_inputs)` on each grouped (key, references),
    or with `fields` on (key, {field: references, ...}) from a CoGroupByKey, each field's
    references read back as records (one key's at a time); yields what `fn` yields."""

    def __init__(
        self, spill_dir: str, fn: Callable[..., Iterator], *args, fields: tuple[str, ...] = ()
    ):
        self._spill_dir = spill_dir
        self._fn = fn
        self._args = args
        self._fields = fields

    def start_bundle(self):
        self._reader = SpillReader(self._spill_dir)

    def process(self, grouped: tuple[Any, Any], *side_inputs):
        key, value = grouped
        if self._fields:
            value = {**value, **{f: self._reader.records(value[f]) for f in self._fields}}
        else:
            value = self._reader.records(value)
        yield from self._fn((key, value), *self._args, *side_inputs)

    def finish_bundle(self):
        self._reader.close()


def folder(spill_dir: str | None) -> str:
    """`spill_dir`, or without one a new local temporary folder: enough for the
    DirectRunner; other runners need one every worker sees (the jobs give their own)."""
    return spill_dir or tempfile.mkdtemp(prefix="spill-")


def remove(spill_dir: str) -> None:
    """Removes a spill folder (once every record spilled there is read back)."""
    if tf.io.gfile.exists(spill_dir):
        tf.io.gfile.rmtree(spill_dir)


def removed_then(value: Any, spill_dir: str) -> Any:
    """`value`, once the spill folder is removed: a step after every read of the folder."""
    remove(spill_dir)
    return value

"""Ingest raw inputs into canonical records (docs/design.md section 3).

Three readers, each a composite transform from the pipeline root to
{"records": serialized canonical examples, "bad": image_files.BadInput}:
- ReadImageFolder: ROOT/<user_id>/<identity>/<file>.{png,jpg,jpeg}, read by
  `beam_jobs.image_files` (the reader `dp-fedemb evaluate` uses too)
- ReadCanonicalTFRecords: TFRecords that already hold canonical examples
- ReadSqlClientData: the SQLite client-data files of TFF's datasets (tables `examples`
  and `client_metadata`, one serialized tf.train.Example per row keyed by client id)

IngestToCanonical flattens any number of readers and adds a summary (counts per bad
reason, bad share, limit); run_ingest writes records and summary and fails with one
clear line when the bad share is over the limit.

Each reader's progress line (`beam_jobs.progress`) counts its own unit against a total
counted when the reader is built: an image folder's user folders read (the user folders
listed once more), a TFRecord pattern's records read (the files' framing read once
more, as split and partition count their input) and a SQLite file's rows read (one
COUNT query).

Hostile input is a counted skip (a BadInput with its reason), never a crash: invalid
names (`schema.check_name`: control characters, undecodable bytes in a user, identity,
file or client name, ...), FIFOs, devices and other files that are not regular files
(never opened), empty files, images over `max_image_pixels` (refused from the file size or
the header, before decoding), corrupt or truncated images. Images in other pixel
formats (alpha, palette, 16-bit) are converted, as `beam_jobs.schema` describes, and
counted per source mode in the Beam counters `converted_image_<mode>`. Sources in the
summary are shown with non-printable characters escaped.
"""

import contextlib
import dataclasses
import os
import sqlite3
from collections.abc import Sequence

import apache_beam as beam
import numpy as np
import tensorflow as tf
from apache_beam.metrics import Metrics

from beam_jobs import image_files, progress, records_io, schema

BAD_TAG = "bad"
_ROW_CLIENT_TAG = "row_client"
# How much of its input a reading step has finished (a user folder, a row range's rows):
# what the reader's progress line counts.
_DONE_TAG = "done"
METRICS_NAMESPACE = "dp_fedemb.ingest"
# Modes decode without conversion; others are converted and counted (module docstring).
_NATIVE_IMAGE_MODES = ("L", "RGB")

SUMMARY_FILE = "ingest_summary.json"
_EXAMPLES_IN_SUMMARY = 10


def _count(name: str) -> None:
    Metrics.counter(METRICS_NAMESPACE, name).inc()


def _bad(reason: str, source: str, detail: str) -> beam.pvalue.TaggedOutput:
    _count(reason)
    return beam.pvalue.TaggedOutput(BAD_TAG, image_files.bad_input(reason, source, detail))


def _outputs(image: image_files.CheckedImage | image_files.BadInput):
    """The serialized record of a checked image, else its counted, tagged BadInput."""
    if isinstance(image, image_files.BadInput):
        _count(image.reason)
        yield beam.pvalue.TaggedOutput(BAD_TAG, image)
        return
    if image.mode not in _NATIVE_IMAGE_MODES:
        _count(f"converted_image_{image.mode}")
    _count("records")
    yield schema.serialize(image.record)


def _checked(record: schema.CanonicalRecord, source: str, max_pixels: int):
    """Yields the serialized record if it validates, else a tagged BadInput."""
    yield from _outputs(image_files.check_record(record, source, max_pixels))


class _ReadUserFolderFn(beam.DoFn):
    """One user's folder -> its records and bad inputs (`image_files.read_user_folder`)."""

    def __init__(self, max_pixels: int):
        self._max_pixels = max_pixels

    def process(self, user_folder: bytes):
        for image in image_files.read_user_folder(user_folder, self._max_pixels):
            yield from _outputs(image)
        yield beam.pvalue.TaggedOutput(_DONE_TAG, 1)


class ReadImageFolder(beam.PTransform):
    """ROOT/<user_id>/<identity>/<file>.{png,jpg,jpeg} -> {"records", "bad"}."""

    def __init__(self, root: str, max_image_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS):
        super().__init__()
        if not tf.io.gfile.isdir(root):
            raise ValueError(f"image folder {root} does not exist or is not a directory")
        self._root = root
        self._max_pixels = _checked_limit(max_image_pixels)
        # The progress line's total. The job lists them again in a worker: a list of
        # every user in the pipeline itself would outgrow what a runner accepts.
        self._user_folders = len(image_files.list_user_folders(root))

    def expand(self, pbegin):
        outputs = (
            pbegin
            | "Root" >> beam.Create([self._root])
            | "ListUsers" >> beam.FlatMap(image_files.list_user_folders)
            # Users are listed by one worker; spread them before reading images.
            | "Reshuffle" >> beam.Reshuffle()
            | "ReadUsers"
            >> beam.ParDo(_ReadUserFolderFn(self._max_pixels)).with_outputs(
                BAD_TAG, _DONE_TAG, main="records"
            )
        )
        _ = outputs[_DONE_TAG] | "Progress" >> progress.Progress(
            "ingest", "user folders read", total=self._user_folders
        )
        return {"records": outputs.records, "bad": outputs[BAD_TAG]}


def _checked_limit(max_image_pixels: int) -> int:
    if isinstance(max_image_pixels, bool) or not isinstance(max_image_pixels, int):
        raise ValueError(f"max image pixels must be an integer, got {max_image_pixels!r}")
    if max_image_pixels < 1:
        raise ValueError(f"max image pixels must be >= 1, got {max_image_pixels}")
    return max_image_pixels


def _validate_serialized(serialized: bytes, source: str, max_pixels: int):
    try:
        record = schema.parse(serialized)
    except schema.RecordError as e:
        yield _bad(e.reason, source, str(e))
        return
    yield from _checked(record, source, max_pixels)


def _framed_records(file_pattern: str) -> int | None:
    """Records in the files of `file_pattern`; None (no total) where they do not read as
    uncompressed TFRecords: the job's own read then decompresses them by their name or
    fails with Beam's error, as it did before the count."""
    try:
        return records_io.count_matching_records(file_pattern)
    except tf.errors.DataLossError:
        return None


class ReadCanonicalTFRecords(beam.PTransform):
    """TFRecord files of canonical examples (validated) -> {"records", "bad"}."""

    def __init__(self, file_pattern: str, max_image_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS):
        super().__init__()
        records_io.require_matches(file_pattern, "TFRecord files")
        self._file_pattern = file_pattern
        self._max_pixels = _checked_limit(max_image_pixels)
        self._records = _framed_records(file_pattern)

    def expand(self, pbegin):
        pattern = self._file_pattern
        outputs = (
            pbegin
            | "Read" >> beam.io.ReadFromTFRecord(pattern)
            | "Progress" >> progress.Progress("ingest", "records read", total=self._records)
            | "Validate"
            >> beam.FlatMap(_validate_serialized, pattern, self._max_pixels).with_outputs(
                BAD_TAG, main="records"
            )
        )
        return {"records": outputs.records, "bad": outputs[BAD_TAG]}


# Feature names TFF's datasets use, in the order they are tried.
_TFF_IDENTITY_FEATURES = ("identity", "label", "class")
_TFF_ENCODED_IMAGE_FEATURES = (schema.IMAGE_KEY, "image/encoded_jpeg")
_TFF_PIXEL_FEATURES = ("pixels", "image/decoded")


def _feature_values(feature: tf.train.Feature) -> list:
    kind = feature.WhichOneof("kind")
    return list(getattr(feature, kind).value) if kind else []


def _pixels_to_png(values: list, max_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS) -> bytes:
    """Flat pixel values (EMNIST floats in [0, 1] or uint8 ints) -> PNG.

    TFF's serializer flattens the pixel tensor, so the shape is inferred: a square
    grayscale or RGB image.
    """
    if len(values) > 3 * max_pixels:
        raise schema.RecordError(
            schema.IMAGE_TOO_LARGE, f"{len(values)} pixel values, over the limit of {max_pixels}"
        )
    try:
        pixels = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):  # bytes values
        raise schema.RecordError(schema.CORRUPT_IMAGE, "pixel values are not numbers") from None
    if not np.all(np.isfinite(pixels)):
        raise schema.RecordError(schema.CORRUPT_IMAGE, "pixel values are not all finite")
    if pixels.size and pixels.max() <= 1.0:  # EMNIST-style floats
        pixels = pixels * 255.0
    for channels in (1, 3):
        side = int(round((pixels.size / channels) ** 0.5))
        if side > 0 and side * side * channels == pixels.size:
            shape = (side, side) if channels == 1 else (side, side, 3)
            return schema.encode_png(
                np.clip(np.round(pixels), 0, 255).astype(np.uint8).reshape(shape)
            )
    raise schema.RecordError(
        schema.MISSING_FIELD, f"{pixels.size} pixel values are not a square image"
    )


def tff_example_to_record(
    client_id: str,
    serialized: bytes,
    identity_feature: str | None = None,
    max_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS,
) -> schema.CanonicalRecord:
    """One row of a TFF SQLite client-data file -> canonical record (not yet validated).

    The user is the client id. The identity is `identity_feature` when given, else the
    first of identity/label/class present. The image is encoded bytes when present, else
    pixels (EMNIST floats, or decoded uint8 values) encoded to PNG.
    """
    example = tf.train.Example()
    try:
        example.ParseFromString(serialized)
    except Exception as e:  # protobuf's DecodeError
        raise schema.RecordError(schema.MISSING_FIELD, f"not a tf.train.Example: {e}") from e
    features = example.features.feature
    names = (identity_feature,) if identity_feature else _TFF_IDENTITY_FEATURES
    identity_values = next((_feature_values(features[n]) for n in names if n in features), [])
    if len(identity_values) != 1:
        raise schema.RecordError(
            schema.MISSING_FIELD, f"no single-valued identity feature among {names}"
        )
    identity = identity_values[0]
    try:
        identity = identity.decode("utf-8") if isinstance(identity, bytes) else str(identity)
    except UnicodeDecodeError:
        raise schema.RecordError(schema.INVALID_NAME, "identity must be UTF-8") from None
    for name in _TFF_ENCODED_IMAGE_FEATURES:
        if name in features and _feature_values(features[name]):
            if features[name].WhichOneof("kind") != "bytes_list":
                raise schema.RecordError(schema.MISSING_FIELD, f"feature {name!r} must be bytes")
            return schema.CanonicalRecord(client_id, identity, _feature_values(features[name])[0])
    for name in _TFF_PIXEL_FEATURES:
        if name in features and _feature_values(features[name]):
            return schema.CanonicalRecord(
                client_id, identity, _pixels_to_png(_feature_values(features[name]), max_pixels)
            )
    raise schema.RecordError(schema.MISSING_FIELD, "no image feature (image/encoded, pixels, ...)")


def _rowid_ranges(database: str, rows_per_read: int) -> list[tuple[int, int]]:
    # Ranges of the examples table's rowid b-tree: each read is an indexed range scan,
    # where per-client queries would each scan the whole (unindexed) table.
    with _connect(database) as connection:
        low, high = connection.execute("SELECT MIN(rowid), MAX(rowid) FROM examples").fetchone()
    if low is None:
        return []
    return [
        (start, min(start + rows_per_read - 1, high))
        for start in range(low, high + 1, rows_per_read)
    ]


def _connect(database: str) -> sqlite3.Connection:
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    # Client ids with undecodable bytes keep them as lone surrogates: check_name then
    # counts them as invalid_name, where sqlite3's default would fail the whole read.
    connection.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
    return connection


def _split_clause(split_name: str | None) -> tuple[str, tuple]:
    return (" AND split_name = ?", (split_name,)) if split_name is not None else ("", ())


# Each row's types come first, and a value is fetched only when it is a blob of at most
# the bound: a value the file controls never sizes an allocation (issue 63: an INTEGER
# of 5,000,000,000 in bytes() was a MemoryError).
_ROWS_QUERY = (
    "SELECT rowid, typeof(client_id), CASE WHEN typeof(client_id) = 'text' THEN client_id END, "
    "typeof(serialized_example_proto), length(serialized_example_proto), "
    "CASE WHEN typeof(serialized_example_proto) = 'blob' "
    "AND length(serialized_example_proto) <= ? THEN serialized_example_proto END "
    "FROM examples WHERE rowid BETWEEN ? AND ?"
)


def _row_error(
    client_type: str, proto_type: str, proto_bytes: int | None, max_bytes: int
) -> tuple[str, str] | None:
    """(reason, detail) of a row whose types or size are not TFF client data's."""
    if client_type != "text":
        return schema.INVALID_NAME, f"client_id is {client_type}, not text"
    if proto_type != "blob":
        return schema.MISSING_FIELD, f"serialized_example_proto is {proto_type}, not a blob"
    if proto_bytes > max_bytes:
        return schema.IMAGE_TOO_LARGE, f"serialized_example_proto over {max_bytes} bytes"
    return None


class _ReadSqlRowsFn(beam.DoFn):
    def __init__(
        self,
        database: str,
        split_name: str | None,
        identity_feature: str | None,
        max_pixels: int,
    ):
        self._database = database
        self._split_name = split_name
        self._identity_feature = identity_feature
        self._max_pixels = max_pixels
        # A serialized example holds one image (or its pixels) and a few small features.
        self._max_bytes = image_files.max_encoded_bytes(max_pixels) + 65536

    def process(self, rowid_range: tuple[int, int]):
        clause, params = _split_clause(self._split_name)
        with _connect(self._database) as connection:
            rows = connection.execute(
                _ROWS_QUERY + clause, (self._max_bytes, *rowid_range, *params)
            ).fetchall()
        yield beam.pvalue.TaggedOutput(_DONE_TAG, len(rows))
        for rowid, client_type, client_id, proto_type, proto_bytes, serialized in rows:
            source = f"{self._database}#rowid={rowid}"
            if client_type == "text":
                # Every row of a client, good or bad, shows the client is not empty.
                yield beam.pvalue.TaggedOutput(_ROW_CLIENT_TAG, _client_key(client_id))
            problem = _row_error(client_type, proto_type, proto_bytes, self._max_bytes)
            if problem is not None:
                reason, detail = problem
                yield _bad(reason, source, detail)
                continue
            try:
                record = tff_example_to_record(
                    client_id, serialized, self._identity_feature, self._max_pixels
                )
            except schema.RecordError as e:
                yield _bad(e.reason, source, str(e))
                continue
            yield from _checked(record, source, self._max_pixels)


def _row_count(database: str, split_name: str | None) -> int:
    """The rows the readers will read (their progress line's total)."""
    clause, params = _split_clause(split_name)
    with _connect(database) as connection:
        (rows,) = connection.execute(
            f"SELECT COUNT(*) FROM examples WHERE 1=1{clause}", params
        ).fetchone()
    return rows


def _client_key(client_id: str) -> bytes:
    # Bytes, so that undecodable ids (lone surrogates) survive Beam's UTF-8 string coder.
    return client_id.encode("utf-8", "surrogateescape")


def _client_metadata(database: str, split_name: str | None):
    """Listed client ids (keys); a listing whose client_id is not text is a bad input."""
    clause, params = _split_clause(split_name)
    with _connect(database) as connection:
        rows = connection.execute(
            "SELECT DISTINCT typeof(client_id), "
            f"CASE WHEN typeof(client_id) = 'text' THEN client_id END FROM client_metadata WHERE 1=1{clause}",
            params,
        ).fetchall()
    for client_type, client_id in rows:
        if client_type == "text":
            yield _client_key(client_id)
        else:
            yield _bad(
                schema.INVALID_NAME,
                f"{database}#client_metadata",
                f"client_id is {client_type}, not text",
            )


def _empty_clients(joined: tuple[str, dict], database: str):
    client_key, groups = joined
    client_id = client_key.decode("utf-8", "surrogateescape")
    if groups["listed"] and not groups["examples"]:
        _count(image_files.EMPTY_USER)
        yield image_files.bad_input(
            image_files.EMPTY_USER, f"{database}#client={client_id}", "client has no examples"
        )


# The columns TFF's client-data files have, and the type affinity each must have
# (https://www.sqlite.org/datatype3.html, 3.1): examples as blobs, client ids as text.
_TFF_COLUMNS = {
    "examples": {"client_id": "text", "serialized_example_proto": "blob"},
    "client_metadata": {"client_id": "text"},
}


def _affinity(declared: str) -> str:
    declared = declared.upper()
    if "INT" in declared:
        return "integer"
    if any(word in declared for word in ("CHAR", "CLOB", "TEXT")):
        return "text"
    if "BLOB" in declared or not declared:
        return "blob"
    if any(word in declared for word in ("REAL", "FLOA", "DOUB")):
        return "real"
    return "numeric"


def _check_tff_database(database: str, split_name: str | None) -> None:
    """The tables, columns and column types of TFF client data, before any row is read."""
    if not os.path.isfile(database):
        raise ValueError(f"SQLite client-data file {database} does not exist")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            tables = {
                name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            missing = set(_TFF_COLUMNS) - tables
            if missing:
                raise ValueError(f"{database} lacks the TFF client-data tables {sorted(missing)}")
            columns = {
                table: {row[1]: row[2] for row in db.execute(f"PRAGMA table_info({table})")}
                for table in _TFF_COLUMNS
            }
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{database} is not a SQLite database: {e}") from e
    for table, wanted in _TFF_COLUMNS.items():
        needed = {**wanted, **({"split_name": "text"} if split_name is not None else {})}
        for column, affinity in needed.items():
            if column not in columns[table]:
                raise ValueError(
                    f"{database}: table {table} has no column {column} (it has "
                    f"{', '.join(sorted(columns[table])) or 'none'}); TFF client data has "
                    f"{', '.join(sorted(needed))}"
                )
            declared = columns[table][column]
            if _affinity(declared) != affinity:
                raise ValueError(
                    f"{database}: column {table}.{column} is declared {declared or 'untyped'}; "
                    f"TFF client data stores it as {affinity.upper()}"
                )


class ReadSqlClientData(beam.PTransform):
    """A TFF SQLite client-data file -> {"records", "bad"}; clients listed without
    examples are empty users. The file must be readable locally by the workers."""

    def __init__(
        self,
        database: str,
        split_name: str | None = None,
        identity_feature: str | None = None,
        rows_per_read: int = 10_000,
        max_image_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS,
    ):
        super().__init__()
        _check_tff_database(database, split_name)
        self._database = database
        self._split_name = split_name
        self._identity_feature = identity_feature
        self._rows_per_read = rows_per_read
        self._max_pixels = _checked_limit(max_image_pixels)
        self._rows = _row_count(database, split_name)

    def expand(self, pbegin):
        database, split_name = self._database, self._split_name
        outputs = (
            pbegin
            | "Database" >> beam.Create([database])
            | "RowRanges" >> beam.FlatMap(_rowid_ranges, self._rows_per_read)
            | "Reshuffle" >> beam.Reshuffle()
            | "ReadRows"
            >> beam.ParDo(
                _ReadSqlRowsFn(database, split_name, self._identity_feature, self._max_pixels)
            ).with_outputs(BAD_TAG, _ROW_CLIENT_TAG, _DONE_TAG, main="records")
        )
        _ = outputs[_DONE_TAG] | "Progress" >> progress.Progress(
            "ingest", "rows read", total=self._rows, weight=int
        )
        seen_clients = (
            outputs[_ROW_CLIENT_TAG]
            | "DistinctClients" >> beam.Distinct()
            | "KeySeen" >> beam.Map(lambda client_id: (client_id, None))
        )
        listed = (
            pbegin
            | "MetadataSource" >> beam.Create([database])
            | "ListedClients"
            >> beam.FlatMap(_client_metadata, split_name).with_outputs(BAD_TAG, main="listed")
        )
        listed_clients = listed.listed | "KeyListed" >> beam.Map(
            lambda client_id: (client_id, None)
        )
        empty_users = (
            {"listed": listed_clients, "examples": seen_clients}
            | "JoinClients" >> beam.CoGroupByKey()
            | "EmptyClients" >> beam.FlatMap(_empty_clients, database)
        )
        bad = (outputs[BAD_TAG], listed[BAD_TAG], empty_users) | "AllBad" >> beam.Flatten()
        return {"records": outputs.records, "bad": bad}


def reader_for(
    source: str,
    identity_feature: str | None = None,
    max_image_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS,
) -> beam.PTransform:
    """The reader for a source path: a directory is an image folder, a .sqlite/.sqlite3/
    .db file is TFF client data (identity from `identity_feature`), anything else a
    TFRecord file pattern. Images over `max_image_pixels` are refused (bad input)."""
    if tf.io.gfile.isdir(source):
        return ReadImageFolder(source, max_image_pixels)
    if source.endswith((".sqlite", ".sqlite3", ".db")):
        return ReadSqlClientData(
            source, identity_feature=identity_feature, max_image_pixels=max_image_pixels
        )
    return ReadCanonicalTFRecords(source, max_image_pixels)


def _summary(
    records: int, bad_counts: dict[str, int], bad_examples: list, max_bad_fraction: float
) -> dict:
    skipped = {r: n for r, n in bad_counts.items() if r in image_files.SKIPPED_REASONS}
    bad_counts = {r: n for r, n in bad_counts.items() if r not in skipped}
    bad = sum(bad_counts.values())
    total = records + bad
    bad_fraction = bad / total if total else 0.0
    return {
        "records": records,
        "bad": bad,
        "bad_by_reason": dict(sorted(bad_counts.items())),
        # Hidden entries, not read and not bad (image_files.HIDDEN_ENTRY).
        "skipped_by_reason": dict(sorted(skipped.items())),
        "bad_fraction": bad_fraction,
        "max_bad_fraction": max_bad_fraction,
        "within_limit": total > 0 and bad_fraction <= max_bad_fraction,
        "bad_examples": sorted(
            (dataclasses.asdict(b) for b in bad_examples), key=lambda b: b["source"]
        ),
    }


class IngestToCanonical(beam.PTransform):
    """Readers -> {"records", "bad", "summary"}; summary is one dict (see _summary)."""

    def __init__(self, readers: Sequence[beam.PTransform], max_bad_fraction: float = 0.01):
        super().__init__()
        if not readers:
            raise ValueError("ingest needs at least one input")
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"max bad fraction must be in [0, 1], got {max_bad_fraction}")
        self._readers = list(readers)
        self._max_bad_fraction = max_bad_fraction

    def expand(self, pbegin):
        outputs = [pbegin | f"Read{i}" >> reader for i, reader in enumerate(self._readers)]
        records = [o["records"] for o in outputs] | "FlattenRecords" >> beam.Flatten()
        bad = [o["bad"] for o in outputs] | "FlattenBad" >> beam.Flatten()
        bad_counts = (
            bad
            | "BadReason" >> beam.Map(lambda b: b.reason)
            | "CountReasons" >> beam.combiners.Count.PerElement()
        )
        bad_examples = bad | "BadExamples" >> beam.combiners.Sample.FixedSizeGlobally(
            _EXAMPLES_IN_SUMMARY
        )
        summary = (
            records
            | "CountRecords" >> beam.combiners.Count.Globally()
            | "Summary"
            >> beam.Map(
                _summary,
                bad_counts=beam.pvalue.AsDict(bad_counts),
                bad_examples=beam.pvalue.AsSingleton(bad_examples),
                max_bad_fraction=self._max_bad_fraction,
            )
        )
        return {"records": records, "bad": bad, "summary": summary}


def run_ingest(
    sources: Sequence[str],
    out_dir: str,
    max_bad_fraction: float = 0.01,
    beam_args: Sequence[str] | None = None,
    identity_feature: str | None = None,
    max_image_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS,
) -> dict:
    """Ingests `sources` into OUT/records-*.tfrecord and OUT/ingest_summary.json.

    Raises ValueError (one line) when the bad share exceeds `max_bad_fraction`; the
    record shards are then removed so nothing downstream uses them, the summary stays.
    """
    readers = [reader_for(source, identity_feature, max_image_pixels) for source in sources]
    summary_path = os.path.join(out_dir, SUMMARY_FILE)
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        ingested = pipeline | "Ingest" >> IngestToCanonical(readers, max_bad_fraction)
        _ = ingested["records"] | "WriteRecords" >> records_io.WriteRecords(out_dir)
        _ = ingested["summary"] | "WriteSummary" >> records_io.WriteJson(summary_path)
    summary = records_io.read_json(summary_path)
    if not summary["within_limit"]:
        records_io.remove_records(out_dir)
        if summary["records"] + summary["bad"] == 0:
            raise ValueError(f"ingest found no input records in {', '.join(sources)}")
        error = image_files.bad_share_error(
            "ingest", summary["records"], summary["bad_by_reason"], max_bad_fraction, "limit"
        )
        raise ValueError(f"{error}; see {summary_path}")
    return summary

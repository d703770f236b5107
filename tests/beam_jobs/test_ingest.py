"""Ingest: image folders, canonical TFRecords, TFF SQLite client data, bad-input accounting."""

import os
import re
import sqlite3

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import ingest, records_io, schema


def _png(value: int) -> bytes:
    return schema.encode_png(np.full((6, 6), value, dtype=np.uint8))


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture
def image_folder(tmp_path):
    root = tmp_path / "raw"
    for user, identity, name, value in [
        ("alice", "a", "0.png", 1),
        ("alice", "a", "1.png", 2),
        ("bob", "b", "0.png", 3),
    ]:
        _write(str(root / user / identity / name), _png(value))
    _write(str(root / "bob" / "b" / "broken.jpg"), b"\xff\xd8\xff not really a jpeg")
    _write(str(root / "bob" / "b" / "notes.txt"), b"hello")
    os.makedirs(root / "carol" / "c")  # a user without images
    return str(root)


def _summary_without_examples(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "bad_examples"}


def test_image_folder_records_and_bad_input_accounting(image_folder):
    expected_records = [
        schema.serialize(schema.CanonicalRecord(u, i, _png(v)))
        for u, i, v in [("alice", "a", 1), ("alice", "a", 2), ("bob", "b", 3)]
    ]
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        outputs = pipeline | ingest.IngestToCanonical(
            [ingest.ReadImageFolder(image_folder)], max_bad_fraction=0.5
        )
        assert_that(outputs["records"], equal_to(expected_records), label="Records")
        summary = outputs["summary"] | "Strip" >> beam.Map(_summary_without_examples)
        assert_that(
            summary,
            equal_to(
                [
                    {
                        "records": 3,
                        "bad": 3,
                        "bad_by_reason": {
                            "corrupt_image": 1,
                            "empty_user": 1,
                            "unsupported_image_format": 1,
                        },
                        "skipped_by_reason": {},
                        "bad_fraction": 0.5,
                        "max_bad_fraction": 0.5,
                        "within_limit": True,
                    }
                ]
            ),
            label="Summary",
        )


def test_run_ingest_fails_over_the_limit_and_leaves_no_records(image_folder, tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"3 of 6 inputs are bad \(50.0% > limit 10.0%\)") as error:
        ingest.run_ingest([image_folder], out, max_bad_fraction=0.1)
    assert "\n" not in str(error.value)
    assert not tf.io.gfile.glob(records_io.records_pattern(out))
    assert records_io.read_json(os.path.join(out, ingest.SUMMARY_FILE))["bad"] == 3


def test_missing_folder_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ingest.ReadImageFolder(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no TFRecord files found"):
        ingest.reader_for(str(tmp_path / "nope"))


def test_canonical_tfrecords_with_missing_fields(tmp_path):
    good = schema.serialize(schema.CanonicalRecord("u", "i", _png(9)))
    no_identity = schema.to_example(schema.CanonicalRecord("u", "i", _png(9)))
    del no_identity.features.feature[schema.IDENTITY_KEY]
    path = str(tmp_path / "in.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for record in (good, no_identity.SerializeToString(), b"garbage"):
            writer.write(record)
    out = str(tmp_path / "out")
    summary = ingest.run_ingest([path], out, max_bad_fraction=0.7)
    assert summary["records"] == 1 and summary["bad_by_reason"] == {"missing_field": 2}
    written = [
        r.numpy()
        for r in tf.data.TFRecordDataset(tf.io.gfile.glob(records_io.records_pattern(out)))
    ]
    assert written == [good]


def _tff_database(
    path: str, rows: list[tuple[str, bytes]], metadata: list[tuple[str, int]]
) -> None:
    """A file laid out like tff.simulation.datasets.sql_client_data_utils writes it."""
    with sqlite3.connect(path) as connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, serialized_example_proto BLOB NOT NULL);"
        )
        connection.execute(
            "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, num_examples INTEGER NOT NULL);"
        )
        connection.executemany("INSERT INTO examples VALUES ('train', ?, ?)", rows)
        connection.executemany("INSERT INTO client_metadata VALUES (?, 'train', ?)", metadata)


def _emnist_example(pixels: np.ndarray, label: int) -> bytes:
    example = tf.train.Example()
    example.features.feature["pixels"].float_list.value.extend(pixels.ravel().tolist())
    example.features.feature["label"].int64_list.value.append(label)
    return example.SerializeToString()


def test_sql_client_data_emnist_layout(tmp_path):
    database = str(tmp_path / "emnist.sqlite")
    pixels = np.linspace(0.0, 1.0, 28 * 28, dtype=np.float32).reshape(28, 28)
    no_pixels = tf.train.Example()
    no_pixels.features.feature["label"].int64_list.value.append(3)
    rows = [
        ("f0000_14", _emnist_example(pixels, 7)),
        ("f0000_14", _emnist_example(1.0 - pixels, 2)),
        ("f0001_41", no_pixels.SerializeToString()),
    ]
    _tff_database(database, rows, [("f0000_14", 2), ("f0001_41", 1), ("f0002_02", 0)])
    expected_png = schema.encode_png(np.round(pixels * 255).astype(np.uint8))
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        outputs = pipeline | ingest.IngestToCanonical(
            [ingest.ReadSqlClientData(database, rows_per_read=2)], 0.5
        )
        records = outputs["records"] | "Parse" >> beam.Map(schema.parse)
        assert_that(
            records | "Keys" >> beam.Map(lambda r: (r.user_id, r.identity)),
            equal_to([("f0000_14", "7"), ("f0000_14", "2")]),
            label="CheckKeys",
        )
        assert_that(
            records
            | "Seven" >> beam.Filter(lambda r: r.identity == "7")
            | "Image" >> beam.Map(lambda r: r.image),
            equal_to([expected_png]),
            label="CheckPixels",
        )
        assert_that(
            outputs["bad"] | "Reasons" >> beam.Map(lambda b: b.reason),
            equal_to(["missing_field", "empty_user"]),
            label="CheckBad",
        )


def test_sql_client_data_with_encoded_images_and_class(tmp_path):
    database = str(tmp_path / "gld.sqlite")
    example = tf.train.Example()
    example.features.feature["image/encoded_jpeg"].bytes_list.value.append(_png(5))
    example.features.feature["class"].int64_list.value.append(42)
    _tff_database(database, [("photographer", example.SerializeToString())], [("photographer", 1)])
    out = str(tmp_path / "out")
    summary = ingest.run_ingest([database], out)
    assert summary["records"] == 1 and summary["bad"] == 0
    (written,) = [
        r.numpy()
        for r in tf.data.TFRecordDataset(tf.io.gfile.glob(records_io.records_pattern(out)))
    ]
    assert schema.parse(written) == schema.CanonicalRecord("photographer", "42", _png(5))


def test_not_a_tff_database_is_one_clear_error(tmp_path):
    database = str(tmp_path / "other.sqlite")
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE things (x)")
    with pytest.raises(ValueError, match="lacks the TFF client-data tables"):
        ingest.reader_for(database)


def _labelled_png_example(label: int) -> bytes:
    example = tf.train.Example()
    example.features.feature["image/encoded"].bytes_list.value.append(_png(label))
    example.features.feature["label"].int64_list.value.append(label)
    return example.SerializeToString()


@pytest.mark.parametrize(
    ("examples", "message"),
    [
        ("client_id TEXT, proto BLOB", "table examples has no column serialized_example_proto"),
        ("user TEXT, serialized_example_proto BLOB", "table examples has no column client_id"),
        (
            "client_id TEXT, serialized_example_proto TEXT",
            "column examples.serialized_example_proto is declared TEXT; TFF client data "
            "stores it as BLOB",
        ),
        (
            "client_id INTEGER, serialized_example_proto BLOB",
            "column examples.client_id is declared INTEGER",
        ),
    ],
)
def test_sql_columns_and_their_types_are_checked_before_reading(tmp_path, examples, message):
    database = str(tmp_path / "odd.sqlite")
    with sqlite3.connect(database) as connection:
        connection.execute(f"CREATE TABLE examples ({examples})")
        connection.execute("CREATE TABLE client_metadata (client_id TEXT)")
    with pytest.raises(ValueError, match=message) as refused:
        ingest.reader_for(database)
    assert "\n" not in str(refused.value)
    # A split asks for split_name in both tables.
    _tff_database(str(tmp_path / "tff.sqlite"), [], [])
    ingest.ReadSqlClientData(str(tmp_path / "tff.sqlite"), split_name="train")


def test_sql_rows_of_the_wrong_type_are_counted_bad_rows_never_read(tmp_path):
    """TEXT, NULL or INTEGER examples and NULL or BLOB client ids, in columns whose
    declared types are right (SQLite stores any type in any column): each row a counted
    bad input; an INTEGER of 5e9 is never turned into 5 GB of zero bytes; a NULL client
    never becomes a user named "None"."""
    database = str(tmp_path / "typed.sqlite")
    with sqlite3.connect(database) as connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)"
        )
        connection.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT)")
        rows = [
            ("good", _labelled_png_example(1)),
            ("text", "a string, not a proto"),
            ("null", None),
            ("integer", 5_000_000_000),
            (None, _labelled_png_example(2)),
            (b"a blob", _labelled_png_example(3)),  # TEXT affinity keeps a blob a blob
        ]
        connection.executemany("INSERT INTO examples VALUES ('train', ?, ?)", rows)
        connection.executemany(
            "INSERT INTO client_metadata VALUES (?, 'train')", [("good",), (None,)]
        )
    out = str(tmp_path / "out")
    summary = ingest.run_ingest([database], out, max_bad_fraction=1.0)
    assert summary["records"] == 1
    # Three rows with no blob; a NULL and a BLOB client id, and a NULL listing.
    assert summary["bad_by_reason"] == {
        schema.MISSING_FIELD: 3,
        schema.INVALID_NAME: 3,
    }
    (written,) = [
        r.numpy()
        for r in tf.data.TFRecordDataset(tf.io.gfile.glob(records_io.records_pattern(out)))
    ]
    assert schema.parse(written).user_id == "good"


def test_an_oversized_sql_example_is_counted_without_being_fetched(tmp_path):
    database = str(tmp_path / "big.sqlite")
    _tff_database(database, [("u", _labelled_png_example(1)), ("v", b"\0" * 5000)], [])
    with sqlite3.connect(database) as connection:
        connection.execute("INSERT INTO examples VALUES ('train', 'w', zeroblob(200000))")
    out = str(tmp_path / "out")
    # 10 pixels allow 80 bytes of image and 64 KiB of the rest: v's 5000 zero bytes are
    # read and are no example; w's 200 kB are over the bound and never fetched.
    summary = ingest.run_ingest([database], out, max_bad_fraction=1.0, max_image_pixels=10)
    assert summary["bad_by_reason"] == {
        schema.MISSING_FIELD: 1,
        schema.IMAGE_TOO_LARGE: 2,  # w's row; u's image, 36 pixels
    }


def _fail(record):
    raise RuntimeError("the job was interrupted")


def test_an_interrupted_writes_staging_folder_is_removed_by_the_rerun(tmp_path):
    """Issue 63: a Beam job interrupted in its write left beam-temp-* folders (one held
    a copy of the records) that the re-run kept."""
    out = str(tmp_path / "out")
    with pytest.raises(RuntimeError, match="interrupted"):
        with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
            _ = (
                pipeline
                | beam.Create([b"a record"])
                | beam.Map(_fail)
                | records_io.WriteRecords(out)
            )
    (left,) = os.listdir(out)  # what Beam staged and the interruption left
    assert re.fullmatch(r"beam-temp-records-[0-9a-f]{32}", left), left
    (tmp_path / "out" / left / "0f1e").write_bytes(b"a staged shard")
    # Not Beam's staging of this job: kept.
    os.makedirs(tmp_path / "out" / "beam-temp-mine")
    os.makedirs(tmp_path / "out" / f"beam-temp-records-{'0' * 32}" / "sub")

    folder = tmp_path / "images" / "u" / "face"
    os.makedirs(folder)
    (folder / "a.png").write_bytes(_png(1))
    summary = ingest.run_ingest([str(tmp_path / "images")], out)
    assert summary["records"] == 1
    assert sorted(n for n in os.listdir(out) if n.startswith("beam-temp")) == [
        "beam-temp-mine",
        f"beam-temp-records-{'0' * 32}",
    ]

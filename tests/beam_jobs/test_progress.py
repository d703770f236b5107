"""Progress lines of the Beam jobs: a pass-through step that counts, and the jobs' lines."""

import io
import os
import re
import sqlite3

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import (
    dedup,
    dedup_batches,
    ingest,
    partition_job,
    progress,
    records_io,
    schema,
    split_protocols,
    splits,
    synthetic,
)


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_progress_passes_elements_through_and_counts_weighted_elements_against_the_total(
    capsys,
):
    batches = [[1, 2], [3], [4, 5, 6]]
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        out = (
            pipeline
            | beam.Create(batches, reshuffle=False)
            | progress.Progress("job", "things counted", total=6, weight=len, every_seconds=0)
        )
        assert_that(out, equal_to(batches))
    lines = _lines(capsys.readouterr().err, "job: things counted ")
    # One line per element at every_seconds 0; the last one has seen all six.
    assert len(lines) == 3
    assert re.match(r"job: things counted 6 of 6 \(100%\), \S+/s, \d+ s$", lines[-1]), lines


def test_progress_writes_nothing_before_every_seconds(capsys):
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(range(50)) | progress.Progress("job", "n", every_seconds=3600)
    assert "job: n" not in capsys.readouterr().err


def test_progress_line_names_a_worker_process_and_has_no_total_when_unknown():
    line = progress.progress_line("dedup", "buckets joined", 1234, None, 65.0, 4242)
    assert line == "dedup: buckets joined 1,234, 19/s, 1 min 5 s [worker process 4242]"


def test_progress_line_with_a_total_says_the_time_left_at_the_rate_so_far():
    # A quarter done in 2 hours: three quarters left take 6 more.
    line = progress.progress_line("ingest", "images read", 50, 200, 7200.0, None)
    assert line == "ingest: images read 50 of 200 (25%), 0.0069/s, 2 h 0 min, 6 h 0 min left"
    line = progress.progress_line("dedup", "images verified", 3, 4, 90.0, 7)
    assert (
        line
        == "dedup: images verified 3 of 4 (75%), 0.033/s, 1 min 30 s, 30 s left [worker process 7]"
    )
    # Nothing left to estimate once done, or before anything is done.
    assert progress.progress_line("job", "n", 4, 4, 9.0, None).endswith(", 9 s")
    assert progress.progress_line("job", "n", 0, 4, 9.0, None).endswith(", 9 s")


def test_lines_to_points_the_lines_of_in_process_jobs_elsewhere(capsys):
    elsewhere = io.StringIO()
    for stream in (elsewhere, None):
        with (
            progress.lines_to(stream),
            TestPipeline(options=records_io.pipeline_options()) as pipeline,
        ):
            _ = pipeline | beam.Create([1, 2]) | progress.Progress("job", "n", every_seconds=0)
    assert capsys.readouterr().err == ""
    assert elsewhere.getvalue().splitlines()[-1].startswith("job: n 2, ")


@pytest.mark.parametrize("text", ["soon", "-1", "nan"])
def test_bad_progress_seconds_is_one_line_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(progress.EVERY_SECONDS_ENV, text)
    with pytest.raises(ValueError, match=rf"^{progress.EVERY_SECONDS_ENV}=.*0 or more$"):
        progress.Progress("job", "n")


def test_split_dedup_and_partition_report_progress_against_their_totals(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(progress.EVERY_SECONDS_ENV, "0")
    config = synthetic.SyntheticConfig(identities=20, images_per_identity=2, seed=3)
    source = str(tmp_path / "in")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | synthetic.SyntheticRecords(config) | records_io.WriteRecords(source)
    split_dir = str(tmp_path / "split")
    summary = splits.run_split(source, split_dir, split_protocols.SplitConfig(0.2, 0.2))
    dedup.run_dedup(split_dir, str(tmp_path / "dedup"), dedup.DedupConfig())
    partition_job.run_partition(source, str(tmp_path / "partition"), num_shards=3)
    err = capsys.readouterr().err
    # Every stage's last line has seen its whole total (the records counted before the
    # job, the key buckets and shards by construction).
    train = summary["records"][split_protocols.TRAIN]
    for expected in (
        "split: records assigned 40 of 40 (100%),",
        f"dedup: train images fingerprinted {train} of {train} (100%),",
        f"dedup: train_vs_evaluation candidate images verified {train} of {train} (100%),",
        f"dedup: train_vs_evaluation band buckets joined {dedup_batches.BUCKETS} of "
        f"{dedup_batches.BUCKETS} (100%),",
        "partition: records read 40 of 40 (100%),",
        "partition: shards written 3 of 3 (100%),",
    ):
        assert _lines(err, expected), (expected, err)
    # Lines before a stage's end say how long is left.
    unfinished = [line for line in err.splitlines() if ": " in line and "(100%)" not in line]
    assert all(line.endswith(" left") for line in unfinished if " of " in line), unfinished


def _image_folder(root: str) -> None:
    png = schema.encode_png(np.full((6, 6), 9, dtype=np.uint8))
    for user, identity, name, data in [
        ("alice", "a", "0.png", png),
        ("alice", "b", "1.png", png),
        ("bob", "a", "0.png", png),
        ("bob", "a", "broken.png", b"not a png"),
        ("carol", "c", "0.png", png),
    ]:
        os.makedirs(os.path.join(root, user, identity), exist_ok=True)
        with open(os.path.join(root, user, identity, name), "wb") as f:
            f.write(data)
    os.makedirs(os.path.join(root, "dave"))  # an empty user is still a folder read


def _tff_database(path: str, rows: list[tuple[str, str, object]]) -> None:
    with sqlite3.connect(path) as connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)"
        )
        connection.execute(
            "CREATE TABLE client_metadata (client_id TEXT, split_name TEXT, num_examples INTEGER)"
        )
        connection.executemany("INSERT INTO examples VALUES (?, ?, ?)", rows)


def test_ingest_reports_each_readers_progress_against_its_total(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(progress.EVERY_SECONDS_ENV, "0")
    folder = str(tmp_path / "images")
    _image_folder(folder)
    records = str(tmp_path / "records")
    config = synthetic.SyntheticConfig(identities=10, images_per_identity=2, seed=5)
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | synthetic.SyntheticRecords(config) | records_io.WriteRecords(records)
    example = tf.train.Example()
    example.features.feature["pixels"].float_list.value.extend([0.5] * 16)
    example.features.feature["label"].int64_list.value.append(1)
    database = str(tmp_path / "tff.sqlite")
    # Rows of another split are not read, so not counted; a bad row is read and counted.
    rows = [("train", f"c{i % 2}", example.SerializeToString()) for i in range(5)]
    rows += [("train", "c2", 7), ("test", "c3", example.SerializeToString())]
    _tff_database(database, rows)
    readers = [
        ingest.ReadImageFolder(folder),
        ingest.ReadCanonicalTFRecords(records_io.records_pattern(records)),
        ingest.ReadSqlClientData(database, split_name="train", rows_per_read=2),
    ]
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | ingest.IngestToCanonical(readers, max_bad_fraction=1.0)
    err = capsys.readouterr().err
    for expected in (
        "ingest: user folders read 4 of 4 (100%),",
        "ingest: records read 20 of 20 (100%),",
        "ingest: rows read 6 of 6 (100%),",
    ):
        assert _lines(err, expected), (expected, err)
    unfinished = [line for line in _lines(err, "ingest: ") if "(100%)" not in line]
    assert all(line.endswith(" left") for line in unfinished), unfinished


def test_ingest_of_tfrecords_whose_framing_is_corrupt_has_no_total(tmp_path):
    path = tmp_path / "bad.tfrecord"
    path.write_bytes(b"\x05" * 40)
    assert ingest.ReadCanonicalTFRecords(str(path))._records is None

"""Progress lines of the Beam jobs: a pass-through step that counts, and the jobs' lines."""

import io
import re

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import partition_job, progress, records_io, split_protocols, splits, synthetic


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
    line = progress.progress_line("ingest", "images read", 50, 200, 7200.0, None)
    assert line == "ingest: images read 50 of 200 (25%), 0.0069/s, 2 h 0 min"


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


def test_split_and_partition_report_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(progress.EVERY_SECONDS_ENV, "0")
    config = synthetic.SyntheticConfig(identities=20, images_per_identity=2, seed=3)
    source = str(tmp_path / "in")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | synthetic.SyntheticRecords(config) | records_io.WriteRecords(source)
    splits.run_split(source, str(tmp_path / "split"), split_protocols.SplitConfig(0.2, 0.2))
    partition_job.run_partition(source, str(tmp_path / "partition"), num_shards=3)
    err = capsys.readouterr().err
    assert _lines(err, "split: users assigned 20,"), err
    assert _lines(err, "partition: records read 40,"), err
    assert _lines(err, "partition: shards written 3 of 3 (100%),"), err

"""`dp-fedemb run`'s console: a Beam job's progress lines beside the running component."""

import io
import logging

import apache_beam as beam

from beam_jobs import progress, records_io
from pipeline import local_run


def _log(handler: logging.Handler, message: str, *args) -> None:
    handler.emit(logging.LogRecord("absl", logging.INFO, __file__, 0, message, args, None))


def test_a_beam_jobs_progress_lines_follow_the_running_components_label():
    out = io.StringIO()
    components = local_run.ComponentProgress(["ExampleGen", "DeduplicateSplits"], out)
    _log(components, "Component %s is running.", "DeduplicateSplits")
    with (
        progress.lines_to(local_run.BesideComponent(components, out)),
        beam.Pipeline(options=records_io.pipeline_options()) as pipeline,
    ):
        _ = (
            pipeline
            | beam.Create([1, 2, 3])
            | progress.Progress("dedup", "images verified", total=3, every_seconds=0)
        )
    _log(components, "Component %s is finished.", "DeduplicateSplits")
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith("[2/2] DeduplicateSplits: dedup: images verified 3 of 3 (100%), ")
    assert lines[-1].startswith("[2/2] DeduplicateSplits: done in ")
    # Between components a line has no label to follow.
    assert components.running() == ""

"""RenderReport: the HTML report of a run, as a typed artifact in ML Metadata."""

import json
import os

import tensorflow as tf
from tfx import types
from tfx import v1 as tfx
from tfx.types import standard_artifacts

from pipeline.components import artifacts, evaluation, training

REPORT_FILE = "index.html"


def _read_json(artifact: types.Artifact, name: str) -> dict:
    with tf.io.gfile.GFile(os.path.join(artifact.uri, name)) as f:
        return json.load(f)


@tfx.dsl.components.component
def RenderReport(
    model_evaluation: tfx.dsl.components.InputArtifact[standard_artifacts.ModelEvaluation],
    privacy_ledger: tfx.dsl.components.InputArtifact[artifacts.PrivacyLedger],
    training_metrics: tfx.dsl.components.InputArtifact[artifacts.TrainingMetrics],
    schedule_statistics: tfx.dsl.components.InputArtifact[artifacts.ScheduleStatistics],
    dedup_report: tfx.dsl.components.InputArtifact[artifacts.DedupReport],
    pushed_model: tfx.dsl.components.InputArtifact[standard_artifacts.PushedModel],
    report: tfx.dsl.components.OutputArtifact[artifacts.PipelineReport],
    code_fingerprint: tfx.dsl.components.Parameter[str],
) -> None:
    """Renders index.html: outcome, privacy ledger and extrapolation, ROC, recall history."""
    from beam_jobs import dedup, partition
    from pipeline import report as report_lib

    del code_fingerprint
    pushed = pushed_model.get_int_custom_property("pushed") == 1
    page = report_lib.render_report(
        evaluation=_read_json(model_evaluation, evaluation.EVALUATION_FILE),
        ledger=_read_json(privacy_ledger, training.LEDGER_FILE),
        training_metrics=_read_json(training_metrics, training.METRICS_FILE),
        schedule=_read_json(schedule_statistics, partition.PARTICIPATION_FILE),
        dedup=_read_json(dedup_report, dedup.REPORT_FILE),
        pushed_to=pushed_model.get_string_custom_property("pushed_destination") if pushed else None,
    )
    with tf.io.gfile.GFile(os.path.join(report.uri, REPORT_FILE), "w") as f:
        f.write(page)
    report.set_int_custom_property("pushed", int(pushed))

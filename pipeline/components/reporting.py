"""RenderReport: the HTML report of a run and its model card, as a typed artifact.

The model card (pipeline/model_card.py: model_card.json in the Model Card Toolkit
schema's field names, with model_card.md and model_card.html) goes into the report
artifact for every run, and next to the pushed SavedModel (in the Pusher's versioned
directory, beside saved_model.pb) when the model was pushed.
"""

import json
import os

import tensorflow as tf
from tfx import types
from tfx.dsl.component.experimental.annotations import InputArtifact, OutputArtifact, Parameter
from tfx.dsl.component.experimental.decorators import component
from tfx.types import standard_artifacts

from pipeline.components import artifacts, evaluation
from tff_algorithms.base import job_files

REPORT_FILE = "index.html"


def _read_json(artifact: types.Artifact, name: str) -> dict:
    with tf.io.gfile.GFile(os.path.join(artifact.uri, name)) as f:
        return json.load(f)


@component
def RenderReport(
    model_evaluation: InputArtifact[standard_artifacts.ModelEvaluation],
    privacy_ledger: InputArtifact[artifacts.PrivacyLedger],
    training_metrics: InputArtifact[artifacts.TrainingMetrics],
    schedule_statistics: InputArtifact[artifacts.ScheduleStatistics],
    dedup_report: InputArtifact[artifacts.DedupReport],
    pushed_model: InputArtifact[standard_artifacts.PushedModel],
    report: OutputArtifact[artifacts.PipelineReport],
    code_fingerprint: Parameter[str],
) -> None:
    """Renders index.html (privacy statement, outcome, accounting, utility, training
    history, data) and the model card."""
    from beam_jobs import dedup, partition
    from pipeline import model_card
    from pipeline import report as report_lib
    from tff_algorithms.modeling import bounded_decode

    del code_fingerprint
    pushed = pushed_model.get_int_custom_property("pushed") == 1
    pushed_to = pushed_model.get_string_custom_property("pushed_destination") if pushed else None
    inputs = dict(
        evaluation=_read_json(model_evaluation, evaluation.EVALUATION_FILE),
        ledger=_read_json(privacy_ledger, job_files.LEDGER_FILE),
        training_metrics=_read_json(training_metrics, job_files.METRICS_FILE),
        schedule=_read_json(schedule_statistics, partition.PARTICIPATION_FILE),
        composition=_read_json(privacy_ledger, job_files.COMPOSITION_FILE),
    )
    card = model_card.build_model_card(
        **inputs,
        pushed_to=pushed_to,
        version=os.path.basename(pushed_to.rstrip("/")) if pushed_to else None,
        serving_bounds=(bounded_decode.MAX_IMAGE_PIXELS, bounded_decode.MAX_BATCH_PIXELS),
    )
    model_card.write_model_card(card, report.uri)
    card_link = model_card.HTML_FILE
    if pushed_to:
        model_card.write_model_card(card, pushed_to)
        card_link = os.path.join(pushed_to, model_card.HTML_FILE)
    page = report_lib.render_report(
        **inputs,
        dedup=_read_json(dedup_report, dedup.REPORT_FILE),
        pushed_to=pushed_to,
        model_card=card_link,
    )
    with tf.io.gfile.GFile(os.path.join(report.uri, REPORT_FILE), "w") as f:
        f.write(page)
    report.set_int_custom_property("pushed", int(pushed))

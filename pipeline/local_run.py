"""Runs the pipeline with LocalDagRunner and a real ML Metadata store, with progress.

LocalDagRunner runs the nodes one after another in this process and says so in its
absl log ("Component X is running.", "A cached execution N is used."); a log handler
turns those lines into one progress line per component, so the console shows the
pipeline's progress without TFX's INFO flood.

One run at a time per output directory: two LocalDagRunner runs on one ML Metadata store
interleave their executions (and their pushes), so a second run refuses to start while
OUTPUT/`RUN_LOCK_FILE` is locked. The lock is an `fcntl` lock, released by the kernel
when its process ends however it ends, so a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

from absl import logging as absl_logging
from ml_metadata.metadata_store import metadata_store
from tfx.orchestration import pipeline as tfx_pipeline
from tfx.orchestration.local.local_dag_runner import LocalDagRunner

from beam_jobs import progress as beam_progress
from pipeline import budget_records, console, definition, lineage
from pipeline import config as config_lib
from pipeline.components import artifacts, evaluation, reporting


class ComponentProgress(logging.Handler):
    """Prints "[i/n] Component ... done in 12.3 s" (or "reused from cache") lines."""

    def __init__(self, node_ids: list[str], stream: TextIO):
        super().__init__(level=logging.INFO)
        self._node_ids = node_ids
        self._stream = stream
        self._current: str | None = None
        self._cached = False
        self._started = 0.0

    def running(self) -> str:
        """ "[i/n] Component:" of the component running now, or "" between components."""
        if self._current is None:
            return ""
        return f"[{self._node_ids.index(self._current) + 1}/{len(self._node_ids)}] {self._current}:"

    def _line(self, text: str) -> None:
        self._stream.write(text + "\n")
        self._stream.flush()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if message == "Component %s is running.":
            self._current, self._cached, self._started = record.args[0], False, time.monotonic()
        elif message == "A cached execution %d is used.":
            self._cached = True
        elif message == "Component %s is finished." and self._current:
            position = self._node_ids.index(self._current) + 1
            outcome = (
                "reused from cache"
                if self._cached
                else f"done in {time.monotonic() - self._started:.1f} s"
            )
            self._line(f"[{position}/{len(self._node_ids)}] {self._current}: {outcome}")
            self._current = None


class BesideComponent:
    """A stream for the Beam jobs' progress lines (beam_jobs.progress.lines_to): each
    line after the running component's "[i/n] Component:", as its own line will be."""

    def __init__(self, components: ComponentProgress, stream: TextIO):
        self._components, self._stream = components, stream

    def write(self, text: str) -> None:
        running = self._components.running()
        self._stream.write(f"{running} {text}" if running and text.strip() else text)

    def flush(self) -> None:
        self._stream.flush()


@contextlib.contextmanager
def _progress_logging(handler: ComponentProgress | None) -> Iterator[None]:
    """absl INFO goes to the progress handler only; warnings still reach stderr.

    The verbosity is set through absl (not on the logger alone) because TF's SavedModel
    export saves and restores absl's verbosity around its attribute walk.
    """
    if handler is None:
        yield
        return
    absl_logger = absl_logging.get_absl_logger()
    previous = (absl_logging.get_verbosity(), absl_logger.propagate)
    warnings_handler = logging.StreamHandler(sys.stderr)
    warnings_handler.setLevel(logging.WARNING)
    log_file_handler = console.LogFileHandler()
    # Warnings reach the log through stderr already.
    log_file_handler.addFilter(lambda record: record.levelno < logging.WARNING)
    absl_logger.addHandler(handler)
    absl_logger.addHandler(warnings_handler)
    absl_logger.addHandler(log_file_handler)
    absl_logger.propagate = False
    absl_logging.set_verbosity(absl_logging.INFO)
    try:
        yield
    finally:
        absl_logging.set_verbosity(previous[0])
        absl_logger.propagate = previous[1]
        absl_logger.removeHandler(log_file_handler)
        absl_logger.removeHandler(warnings_handler)
        absl_logger.removeHandler(handler)


RUN_LOCK_FILE = "run.lock"


@contextlib.contextmanager
def _only_run_in(output_dir: str) -> Iterator[None]:
    path = os.path.join(output_dir, RUN_LOCK_FILE)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"another dp-fedemb run is using {output_dir} (it holds {path}); "
                "wait for it to end or give another output directory"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    pushed_to: str | None
    epsilon: float
    delta: float
    accounting_convention: str
    neighboring_relation: str
    recall_at_far: dict[str, float]
    # {far: {"difference", "interval"}} over the pretrained start; empty without one.
    gain_over_pretrained: dict[str, dict]
    confidence: float  # of the intervals
    blessed: bool
    not_blessed_because: list[str]
    report_path: str
    metadata_path: str


def _latest_artifact(store: metadata_store.MetadataStore, type_name: str):
    found = store.get_artifacts_by_type(type_name)
    if not found:
        raise RuntimeError(f"the run produced no {type_name} artifact")
    return max(found, key=lambda a: a.id)


def summarize(config: config_lib.PipelineConfig) -> RunSummary:
    """What the last run produced, read from ML Metadata (epsilon by the lineage query)."""
    store = metadata_store.MetadataStore(definition.local_metadata_config(config))
    evaluation_artifact = _latest_artifact(store, "ModelEvaluation")
    with open(os.path.join(evaluation_artifact.uri, evaluation.EVALUATION_FILE)) as f:
        result = json.load(f)
    pushed = _latest_artifact(store, "PushedModel")
    pushed_to, epsilon, delta = None, result["epsilon"], result["delta"]
    convention, relation = result["accounting_convention"], result["neighboring_relation"]
    if pushed.custom_properties["pushed"].int_value == 1:
        privacy = lineage.privacy_of_pushed_model(store, pushed.id)
        pushed_to, epsilon, delta = privacy.pushed_destination, privacy.epsilon, privacy.delta
        convention, relation = privacy.accounting_convention, privacy.neighboring_relation
    report = _latest_artifact(store, artifacts.PipelineReport.TYPE_NAME)
    return RunSummary(
        pushed_to=pushed_to,
        epsilon=epsilon,
        delta=delta,
        accounting_convention=convention,
        neighboring_relation=relation,
        recall_at_far=result["model"]["recall_at_far"],
        gain_over_pretrained=result["model"].get("versus", {}).get("pretrained", {}),
        confidence=result["bootstrap"]["confidence"],
        blessed=result["blessed"],
        not_blessed_because=result["not_blessed_because"],
        report_path=os.path.join(report.uri, reporting.REPORT_FILE),
        metadata_path=definition.metadata_path(config),
    )


def run_pipeline(
    config: config_lib.PipelineConfig,
    from_nodes: tuple[str, ...] = (),
    progress: TextIO | None = sys.stdout,
) -> RunSummary:
    """Runs the whole pipeline, or from `from_nodes` on (reusing the last run upstream)."""
    output_dir = os.path.abspath(config.pipeline.output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with _only_run_in(output_dir):
        console.keep_log_in(output_dir, "run")
        # Before anything is charged: the ledger against ML Metadata's records of it.
        budget_records.check_budget_ledger(config)
        pipeline = definition.build_pipeline(
            config, metadata_connection_config=definition.local_metadata_config(config)
        )
        node_ids = [node.id for node in pipeline.components]
        unknown = sorted(set(from_nodes) - set(node_ids))
        if unknown:
            raise ValueError(f"unknown component {unknown[0]} (components: {', '.join(node_ids)})")
        run_options = tfx_pipeline.RunOptions(from_nodes=list(from_nodes)) if from_nodes else None
        components = ComponentProgress(node_ids, progress) if progress else None
        with (
            _progress_logging(components),
            beam_progress.lines_to(BesideComponent(components, progress) if components else None),
        ):
            LocalDagRunner().run(pipeline, run_options=run_options)
        return summarize(config)

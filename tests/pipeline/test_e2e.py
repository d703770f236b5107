"""The whole pipeline through LocalDagRunner with a real ML Metadata store, on tiny data.

Like TFX's own example e2e tests, runs the pipeline several times against one store and
checks artifacts, lineage, blessing and caching by reading ML Metadata:
1. first run: every component executes; the model is blessed and pushed, and the
   lineage query finds its epsilon (the PrivacyLedger's); the report renders.
2. second run, nothing changed: everything upstream of the evaluation is reused; the
   evaluation runs again because the latest-blessed-model resolver now gives a baseline
   (as in TFX's penguin e2e test), and so do the Pusher and the report downstream.
3. third run, nothing changed: every component is reused.
4. partial run from PrivateTrain with a budget below the model's epsilon: nothing
   upstream runs, the model is not blessed and not pushed.
"""

import json
import os

import pytest
from ml_metadata.proto import metadata_store_pb2

from pipeline import config as config_lib
from pipeline import console, definition, lineage, local_run
from pipeline.components import artifacts, pushing
from tests import support
from tff_algorithms.base import job_files

# One xdist worker runs every module of the session's tiny pipeline run (conftest).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_pipeline")]

UPSTREAM_OF_EVALUATION = (
    definition.EXAMPLE_GEN,
    definition.STATISTICS_GEN,
    definition.SCHEMA_GEN,
    definition.EXAMPLE_VALIDATOR,
    definition.DEDUP,
    definition.PARTITION,
    definition.PRETRAIN,
    definition.PRIVATE_TRAIN,
)
COMPONENTS = (*UPSTREAM_OF_EVALUATION, definition.EVALUATE, definition.PUSHER, definition.REPORT)


def _config(output_dir: str, **section_overrides) -> config_lib.PipelineConfig:
    return config_lib.config_from_dict(support.tiny_pipeline(output_dir, **section_overrides))


def _states(store, nodes, run_index: int) -> dict[str, int]:
    executions = support.executions_by_node(store)
    return {node: executions[node][run_index].last_known_state for node in nodes}


CACHED = metadata_store_pb2.Execution.CACHED
COMPLETE = metadata_store_pb2.Execution.COMPLETE


@pytest.fixture(scope="module")
def first_run(tiny_pipeline_first_run):
    return tiny_pipeline_first_run


def test_first_run_blesses_pushes_and_records_epsilon(first_run):
    config, summary, store, _ = first_run
    for node, state in _states(store, COMPONENTS, 0).items():
        assert state == COMPLETE, node
    # Typed artifacts in ML Metadata.
    for type_name in (
        "Examples",
        "ExampleStatistics",
        "Schema",
        "ExampleAnomalies",
        artifacts.DedupReport.TYPE_NAME,
        artifacts.VirtualClientPartition.TYPE_NAME,
        artifacts.ScheduleStatistics.TYPE_NAME,
        artifacts.PrivacyLedger.TYPE_NAME,
        artifacts.TrainingMetrics.TYPE_NAME,
        "ModelEvaluation",
        "ModelBlessing",
        "PushedModel",
        artifacts.PipelineReport.TYPE_NAME,
    ):
        assert store.get_artifacts_by_type(type_name), type_name
    [ledger] = store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME)
    with open(os.path.join(ledger.uri, job_files.LEDGER_FILE)) as f:
        ledger_json = json.load(f)
    assert [entry["round"] for entry in ledger_json["history"]] == [1, 2]
    epsilon = ledger.custom_properties[artifacts.EPSILON].double_value
    assert epsilon == pytest.approx(ledger_json["history"][-1]["epsilon"])
    assert 0 < epsilon <= config.evaluate.privacy_budget_epsilon
    # The pushed model: in the versioned serving directory, a SavedModel, epsilon by lineage.
    [pushed] = lineage.pushed_models(store)
    privacy = lineage.privacy_of_pushed_model(store, pushed.id)
    assert privacy.epsilon == epsilon and privacy.delta == pytest.approx(1e-3)
    assert privacy.ledger_uri == ledger.uri
    # What the epsilon means travels with it: strict accounting, substitute-one.
    assert (privacy.accounting_convention, privacy.neighboring_relation) == (
        "strict",
        "replace_one",
    )
    assert ledger_json["spec"]["convention"] == "strict"
    assert (summary.accounting_convention, summary.neighboring_relation) == (
        "strict",
        "replace_one",
    )
    assert os.path.dirname(privacy.pushed_destination) == os.path.abspath(config.serving_dir)
    assert os.path.isfile(os.path.join(privacy.pushed_destination, "saved_model.pb"))
    # Its model card beside it (pipeline/model_card.py), pointing at it.
    with open(os.path.join(privacy.pushed_destination, "model_card.json")) as f:
        card = json.load(f)
    assert card["model_details"]["path"] == privacy.pushed_destination
    assert os.path.isfile(os.path.join(privacy.pushed_destination, "model_card.html"))
    assert summary.pushed_to == privacy.pushed_destination and summary.epsilon == epsilon
    assert set(summary.recall_at_far) == {"0.1", "0.01", "0.001"}
    # Every recall with its bootstrap interval; the gain over the pretrained start paired.
    [evaluation] = store.get_artifacts_by_type("ModelEvaluation")
    with open(os.path.join(evaluation.uri, "evaluation.json")) as f:
        evaluation_json = json.load(f)
    trained, pretrained = evaluation_json["model"], evaluation_json["pretrained"]
    assert evaluation_json["bootstrap"] == {"resamples": 1000, "confidence": 0.95}
    assert summary.gain_over_pretrained == trained["versus"]["pretrained"]
    for far, recall in summary.recall_at_far.items():
        low, high = trained["recall_at_far_interval"][far]
        assert 0 <= low <= high <= 1 and pretrained["recall_at_far_interval"][far][0] <= 1
        gain = summary.gain_over_pretrained[far]
        assert gain["difference"] == pytest.approx(recall - pretrained["recall_at_far"][far])
        assert -1 <= gain["interval"][0] <= gain["interval"][1] <= 1
    # Only the serving SavedModel is published: no checkpoints, no work directories.
    [model] = [
        m
        for m in store.get_artifacts_by_type("Model")
        if m.custom_properties.get("algorithm") is not None
    ]
    assert os.listdir(model.uri) == ["Format-Serving"]
    work_root = os.path.join(os.path.dirname(os.path.dirname(model.uri)), ".work")
    assert not os.path.exists(work_root) or not os.listdir(work_root)
    assert os.path.isfile(summary.report_path)


def test_first_run_shows_only_the_products_lines(first_run):
    """`dp-fedemb run` prints component progress, each training round and the summary;
    the libraries' noise goes to the full log only, and nothing at all to stderr."""
    config, _, _, process = first_run
    assert process.stderr == ""
    lines = process.stdout.splitlines()
    assert not [line for line in lines if console.is_noise(line)]
    assert "Traceback" not in process.stdout and "Warning" not in process.stdout
    rounds = config.train_job_dict()["rounds"]
    for step in (definition.PRETRAIN, definition.PRIVATE_TRAIN, definition.REPORT):
        assert any(f"] {step}: done in " in line for line in lines), step
    assert any(
        line.startswith(f"{definition.PRIVATE_TRAIN} round {rounds}/{rounds}  ") and "ε " in line
        for line in lines
    )
    # What the data steps found, in words.
    for found in ("    read ", "    train: removed ", " training users; "):
        assert any(found in line for line in lines), found
    # The full log holds what the console left out.
    [log_path] = [line.split(" full log in ", 1)[1] for line in lines if " full log in " in line]
    assert os.path.dirname(log_path) == os.path.join(config.pipeline.output_dir, console.LOG_DIR)
    with open(log_path) as f:
        logged = f.read().splitlines()
    assert any(console.is_noise(line) for line in logged)
    assert any(f"Component {definition.PRIVATE_TRAIN} is running" in line for line in logged)


def _scalars(run_dir: str) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the TensorBoard event files in run_dir."""
    import tensorflow as tf

    scalars: dict[str, dict[int, float]] = {}
    for path in tf.io.gfile.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, {})[event.step] = number
    return scalars


def test_tensorboard_shows_each_training_round(first_run):
    config, _, store, _ = first_run
    root = definition.tensorboard_dir(config)
    [private_run] = os.listdir(os.path.join(root, definition.PRIVATE_TRAIN))
    scalars = _scalars(os.path.join(root, definition.PRIVATE_TRAIN, private_run))
    rounds = config.train_job_dict()["rounds"]
    steps = list(range(1, rounds + 1))
    for tag in ("privacy/epsilon", "privacy/noise_multiplier", "time/round_seconds"):
        assert sorted(scalars[tag]) == steps, tag
    assert sorted(scalars["validation/recall_at_far_0.001"]) == steps  # evaluate_every 1
    assert any(tag.startswith("operations/") for tag in scalars)
    # The last round's epsilon is the model's (its PrivacyLedger's in ML Metadata).
    ledger = min(store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME), key=lambda a: a.id)
    assert scalars["privacy/epsilon"][rounds] == pytest.approx(
        ledger.custom_properties["epsilon"].double_value
    )
    # Pretraining is non-private: no privacy scalars, but its rounds and recall.
    [pretrain_run] = os.listdir(os.path.join(root, definition.PRETRAIN))
    pretrain = _scalars(os.path.join(root, definition.PRETRAIN, pretrain_run))
    assert "privacy/epsilon" not in pretrain and "validation/recall_at_far_0.001" in pretrain


def test_unchanged_reruns_reuse_cached_results(first_run):
    config, _, store, _ = first_run
    serving = os.path.abspath(config.serving_dir)
    pushed_before = sorted(os.listdir(serving))
    # Other modules share this store and may run the pipeline too: the newest push.
    first_push = max(store.get_artifacts_by_type("PushedModel"), key=lambda a: a.id)
    assert first_push.custom_properties["pushed"].int_value == 1
    local_run.run_pipeline(config, progress=None)
    for node, state in _states(store, UPSTREAM_OF_EVALUATION, 1).items():
        assert state == CACHED, node
    # The resolver now yields the first run's blessed model as the baseline: new inputs.
    for node, state in _states(store, (definition.EVALUATE, definition.PUSHER), 1).items():
        assert state == COMPLETE, node
    # Blessed again, the same model is recorded as pushed where it already is: no new
    # serving version (pipeline/components/pushing.py).
    assert sorted(os.listdir(serving)) == pushed_before
    second_push = max(store.get_artifacts_by_type("PushedModel"), key=lambda a: a.id)
    assert second_push.id != first_push.id
    assert second_push.custom_properties["pushed"].int_value == 1
    assert second_push.custom_properties[pushing.ALREADY_SERVED].int_value == 1
    destination = "pushed_destination"
    assert (
        second_push.custom_properties[destination].string_value
        == first_push.custom_properties[destination].string_value
    )
    assert lineage.privacy_of_pushed_model(store, second_push.id).epsilon == (
        lineage.privacy_of_pushed_model(store, first_push.id).epsilon
    )
    artifact_count = len(store.get_artifacts())
    local_run.run_pipeline(config, progress=None)
    for node, state in _states(store, COMPONENTS, 2).items():
        assert state == CACHED, node
    assert len(store.get_artifacts()) == artifact_count


def test_partial_run_over_budget_is_not_blessed_or_pushed(first_run):
    config, _, store, _ = first_run
    serving = os.path.abspath(config.serving_dir)
    pushed_before = sorted(os.listdir(serving))
    seen = {e.id for executions in support.executions_by_node(store).values() for e in executions}
    [ledger] = store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME)
    epsilon = ledger.custom_properties[artifacts.EPSILON].double_value
    over_budget = _config(
        config.pipeline.output_dir, evaluate={"privacy_budget_epsilon": epsilon / 2}
    )
    summary = local_run.run_pipeline(
        over_budget, from_nodes=(definition.PRIVATE_TRAIN,), progress=None
    )
    new = {
        node: [e.last_known_state for e in executions if e.id not in seen]
        for node, executions in support.executions_by_node(store).items()
    }
    # Upstream of PrivateTrain nothing runs: the partial run records its reuse of the
    # last run's artifacts as cached executions.
    for node in UPSTREAM_OF_EVALUATION[:-1]:
        assert all(state == CACHED for state in new[node]), node
    # PrivateTrain is unchanged (cached); the evaluation runs with the new budget.
    assert new[definition.PRIVATE_TRAIN] == [CACHED]
    assert new[definition.EVALUATE] == [COMPLETE]
    assert not summary.blessed and summary.pushed_to is None
    assert "exceeds the privacy budget" in summary.not_blessed_because[0]
    latest_blessing = max(store.get_artifacts_by_type("ModelBlessing"), key=lambda a: a.id)
    assert latest_blessing.custom_properties["blessed"].int_value == 0
    latest_push = max(store.get_artifacts_by_type("PushedModel"), key=lambda a: a.id)
    assert latest_push.custom_properties["pushed"].int_value == 0
    assert sorted(os.listdir(serving)) == pushed_before
    with pytest.raises(ValueError, match="records no push"):
        lineage.privacy_of_pushed_model(store, latest_push.id)


def test_report_renders_in_headless_chromium(first_run, tmp_path):
    browser = support.chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    _, summary, _, _ = first_run
    with open(summary.report_path) as f:
        page = f.read()
    assert page.count("<img") >= 4 and "ROC" in page
    assert "gain over the pretrained start at FAR=0.01" in page and "bootstrap intervals" in page
    assert '<p class="statement">' in page and "Model card:" in page
    # A blank page is one shade; a rendered report has text and plots in many.
    shades = support.screenshot_shades(
        browser, str(tmp_path / "profile"), summary.report_path, "1000,2400"
    )
    assert shades is None or shades > 50

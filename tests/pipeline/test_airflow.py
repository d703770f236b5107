"""The compiled Airflow DAG run by a real Airflow 2.7 (issue 28).

Airflow lives in its own environment, .venv-airflow (`make airflow-setup`, from
requirements/airflow-lock.txt), so the tests drive its `airflow` command: a temporary
AIRFLOW_HOME with SQLite, the DAG of `dp-fedemb compile --target airflow` on the tiny
config of test_pipeline_e2e, `airflow dags list-import-errors` and `airflow dags test`.
One run goes to a pushed model whose epsilon is read back through ML Metadata lineage;
a second DAG whose first step fails must fail its run, with the step's one-line error in
the log. CI installs the environment (.ci/run); elsewhere the module is skipped without it.
"""

import json
import os
import sqlite3
import subprocess

import pytest
from ml_metadata.metadata_store import metadata_store
from tfx.orchestration import metadata

from pipeline import compile_targets, definition, lineage
from pipeline import config as config_lib
from pipeline.components import artifacts
from tests import paths, support
from tff_algorithms.base import job_files

REPO = str(paths.REPO)
AIRFLOW = os.path.join(REPO, ".venv-airflow", "bin", "airflow")
LOGICAL_DATE = "2024-01-02"
RUN_ID = "manual__2024-01-02T00:00:00+00:00"

if not os.access(AIRFLOW, os.X_OK):
    if os.environ.get("CI"):
        raise RuntimeError(f"CI runs the Airflow test: {AIRFLOW} is missing (make airflow-setup)")
    pytest.skip(
        f"Airflow environment not installed ({AIRFLOW}); `make airflow-setup` installs it",
        allow_module_level=True,
    )

pytestmark = pytest.mark.slow


def _tiny_values(output_dir: str, **sections) -> dict:
    """TINY without its fixed test seeds: compiled pipelines refuse them."""
    values = support.tiny_pipeline(output_dir, **sections)
    del values["train"]["noise_seed"], values["train"]["testing_fixed_noise"]
    return values


class _Airflow:
    def __init__(self, home: str) -> None:
        self.home = home
        self.dags = os.path.join(home, "dags")
        os.makedirs(self.dags)
        self.env = dict(
            os.environ,
            AIRFLOW_HOME=home,
            AIRFLOW__CORE__DAGS_FOLDER=self.dags,
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            # Airflow's default, named so that a slow DAG file fails here as it would there.
            AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT="30",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home}/airflow.db",
        )

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [AIRFLOW, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def compile(self, values: dict, file_name: str) -> None:
        config = config_lib.config_from_dict(values)
        root = os.path.join(values["pipeline"]["output_dir"], "pipeline_root")
        compile_targets.compile_airflow(config, os.path.join(self.dags, file_name), root)

    def query(self, sql: str, *params) -> list[tuple]:
        with sqlite3.connect(os.path.join(self.home, "airflow.db")) as db:
            return db.execute(sql, params).fetchall()


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    base = tmp_path_factory.mktemp("airflow")
    af = _Airflow(str(base / "home"))
    good_out = str(base / "good")
    af.compile(_tiny_values(good_out, pipeline={"name": "dp-fedemb"}), "dp_fedemb.py")
    # A DAG whose first step fails: an input folder with no images.
    empty = base / "no-images"
    empty.mkdir()
    af.compile(
        _tiny_values(
            str(base / "bad"),
            pipeline={"name": "dp-fedemb-failing"},
            data={"inputs": [str(empty)]},
            split={"public_fraction": 0.3},
        ),
        "dp_fedemb_failing.py",
    )
    migrated = af("db", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    return af, good_out


def test_dags_load_without_import_errors(airflow):
    af, _ = airflow
    errors = af("dags", "list-import-errors", "--output", "json")
    assert errors.returncode == 0, errors.stderr[-3000:]
    assert json.loads(errors.stdout or "[]") == []
    listed = af("dags", "list", "--output", "json")
    assert {d["dag_id"] for d in json.loads(listed.stdout)} == {"dp-fedemb", "dp-fedemb-failing"}


def test_dag_run_pushes_a_model_with_epsilon_in_lineage(airflow):
    af, out = airflow
    run = af("dags", "test", "dp-fedemb", LOGICAL_DATE, timeout=840)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    [(state,)] = af.query("SELECT state FROM dag_run WHERE dag_id = ?", "dp-fedemb")
    tasks = dict(af.query("SELECT task_id, state FROM task_instance WHERE run_id = ?", RUN_ID))
    assert state == "success" and set(tasks.values()) == {"success"}, tasks
    # Every node of the pipeline ran as its own task.
    nodes = definition.build_pipeline(config_lib.config_from_dict(_tiny_values(out))).components
    assert {node.id for node in nodes} <= set(tasks)
    # TFF's executor no longer prints a traceback when the process exits.
    assert "Exception ignored" not in log and "Popen" not in log
    store = metadata_store.MetadataStore(
        metadata.sqlite_metadata_connection_config(
            os.path.join(out, "pipeline_root", "metadata.sqlite")
        )
    )
    # The artifacts LocalDagRunner records (tests/pipeline/test_e2e.py), from this one run:
    # Examples from ExampleGen and dedup, Models from PretrainBackbone and PrivateTrain.
    counts = {t.name: len(store.get_artifacts_by_type(t.name)) for t in store.get_artifact_types()}
    assert counts == {
        "Examples": 2,
        "ExampleStatistics": 1,
        "Schema": 1,
        "ExampleAnomalies": 1,
        artifacts.DedupReport.TYPE_NAME: 1,
        artifacts.VirtualClientPartition.TYPE_NAME: 1,
        artifacts.ScheduleStatistics.TYPE_NAME: 1,
        "Model": 2,
        artifacts.TrainingMetrics.TYPE_NAME: 2,
        artifacts.PrivacyLedger.TYPE_NAME: 1,
        "ModelEvaluation": 1,
        "ModelBlessing": 1,
        "PushedModel": 1,
        artifacts.PipelineReport.TYPE_NAME: 1,
    }, counts
    # PretrainBackbone's and PrivateTrain's metrics: same type, names unique per output.
    metrics = store.get_artifacts_by_type(artifacts.TrainingMetrics.TYPE_NAME)
    assert sorted(a.name.split(":")[0] for a in metrics) == ["backbone_metrics", "training_metrics"]
    [pushed] = lineage.pushed_models(store)
    privacy = lineage.privacy_of_pushed_model(store, pushed.id)
    assert os.path.isdir(privacy.pushed_destination)
    with open(os.path.join(privacy.ledger_uri, job_files.LEDGER_FILE)) as f:
        ledger = json.load(f)
    assert privacy.epsilon == pytest.approx(ledger["history"][-1]["epsilon"])
    assert 0 < privacy.epsilon <= 100.0 and privacy.delta == pytest.approx(1e-3)
    [report] = store.get_artifacts_by_type(artifacts.PipelineReport.TYPE_NAME)
    assert os.path.isfile(os.path.join(report.uri, "index.html"))


def test_failing_step_fails_the_run_with_its_error(airflow):
    af, _ = airflow
    run = af("dags", "test", "dp-fedemb-failing", LOGICAL_DATE, timeout=600)
    log = run.stdout + run.stderr
    [(state,)] = af.query("SELECT state FROM dag_run WHERE dag_id = ?", "dp-fedemb-failing")
    assert state == "failed", log[-5000:]
    tasks = dict(
        af.query("SELECT task_id, state FROM task_instance WHERE dag_id = ?", "dp-fedemb-failing")
    )
    assert tasks["CanonicalExampleGen"] == "failed"
    assert tasks["PrivateTrain"] == "upstream_failed"
    [line] = [x for x in log.splitlines() if "dp-fedemb: CanonicalExampleGen failed:" in x][:1]
    assert "no-images" in line, line

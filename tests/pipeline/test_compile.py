"""`dp-fedemb compile`: the Kubeflow V2 JSON and the Airflow DAG file of the same pipeline."""

import ast
import json
import os
import subprocess
import sys

from pipeline import cli, definition
from pipeline import config as config_lib
from tests import paths

IMAGE = "registry.example/dp-fedemb:1.2"
# (task, tasks it must depend on): the DAG edges of docs/design.md section 7.
EDGES = {
    definition.STATISTICS_GEN: {definition.EXAMPLE_GEN},
    definition.SCHEMA_GEN: {definition.STATISTICS_GEN},
    definition.EXAMPLE_VALIDATOR: {definition.STATISTICS_GEN, definition.SCHEMA_GEN},
    definition.DEDUP: {definition.EXAMPLE_GEN, definition.EXAMPLE_VALIDATOR},
    definition.PARTITION: {definition.DEDUP},
    definition.PRETRAIN: {definition.DEDUP},
    definition.PRIVATE_TRAIN: {definition.PARTITION, definition.DEDUP, definition.PRETRAIN},
    definition.EVALUATE: {definition.PRIVATE_TRAIN, definition.DEDUP, definition.PRETRAIN},
    definition.PUSHER: {definition.PRIVATE_TRAIN, definition.EVALUATE},
    definition.REPORT: {definition.EVALUATE, definition.PUSHER, definition.PRIVATE_TRAIN},
}


def _constant(task: dict, name: str):
    value = task["inputs"]["parameters"][name]["runtimeValue"]["constantValue"]
    return next(iter(value.values()))


def test_kubeflow_v2_json(tmp_path, capsys):
    out = tmp_path / "pipeline.json"
    code = cli.main(
        [
            "dp-fedemb",
            "compile",
            "--target=kubeflow",
            f"--out={out}",
            f"--image={IMAGE}",
            "--pipeline-root=gs://bucket/root",
            "--set",
            "train.rounds=12",
            "--set",
            "evaluate.privacy_budget_epsilon=3.5",
        ]
    )
    assert code == 0 and capsys.readouterr().out.strip() == str(out)
    spec = json.loads(out.read_text())
    assert spec["runtimeConfig"]["gcsOutputDirectory"] == "gs://bucket/root"
    pipeline_spec = spec["pipelineSpec"]
    tasks = pipeline_spec["root"]["dag"]["tasks"]
    for task, upstream in EDGES.items():
        assert upstream <= set(tasks[task].get("dependentTasks", [])), task
    resolver_tasks = [t for t in tasks if t.startswith(definition.BASELINE_RESOLVER)]
    assert resolver_tasks and any(
        t in tasks[definition.EVALUATE]["dependentTasks"] for t in resolver_tasks
    )
    executors = pipeline_spec["deploymentSpec"]["executors"]
    images = {e["container"]["image"] for e in executors.values() if "container" in e}
    assert images == {IMAGE}
    # Components are referenced by importable module path.
    train_executor = json.dumps(executors[f"{definition.PRIVATE_TRAIN}_executor"])
    assert "pipeline.components.training" in train_executor
    assert (
        json.loads(_constant(tasks[definition.PRIVATE_TRAIN], "train_job_config"))["rounds"] == 12
    )
    assert _constant(tasks[definition.EVALUATE], "privacy_budget_epsilon") == 3.5
    assert int(_constant(tasks[definition.PARTITION], "rounds")) == 12  # intValue is a string
    assert len(_constant(tasks[definition.PRIVATE_TRAIN], "code_fingerprint")) == 64


def _airflow_file(tmp_path) -> str:
    out = tmp_path / "dp_fedemb_dag.py"
    code = cli.main(
        [
            "dp-fedemb",
            "compile",
            "--target=airflow",
            f"--out={out}",
            f"--image={IMAGE}",
            "--pipeline-root=/airflow/dp-fedemb",
            "--set",
            "train.rounds=12",
        ]
    )
    assert code == 0
    return str(out)


def test_airflow_dag_file_text(tmp_path):
    path = _airflow_file(tmp_path)
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source, path)
    assert "airflow_tasks.run_component(" in source
    assert f"IMAGE = {IMAGE!r}" in source
    assert "PIPELINE_ROOT = '/airflow/dp-fedemb'" in source
    # Airflow parses the file within its 30 s dagbag_import_timeout: at the top level it
    # imports only Airflow and the standard library; TF, TFX and the project load in tasks.
    top_level = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            top_level.add(node.module.split(".")[0])
    assert top_level == {"datetime", "airflow"}
    # The embedded config is the validated one, with the override applied; TASKS are the
    # pipeline's nodes and edges.
    namespace: dict = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id in ("CONFIG", "TASKS"):
            exec(ast.unparse(node), namespace)  # noqa: S102 - our own generated literals
    assert namespace["CONFIG"]["train"]["rounds"] == 12
    for task, upstream in EDGES.items():
        assert upstream <= set(namespace["TASKS"][task]), task
    assert list(namespace["TASKS"])[0] == definition.EXAMPLE_GEN


def test_output_artifacts_are_unique_per_type_and_key():
    """TFX's Airflow driver names an output artifact "<output key>:<run id>" and ML
    Metadata keeps (type, name) unique: two nodes with an output of the same type under
    the same key would fail the second one's run (issue 28)."""
    from tfx import v1 as tfx

    config = config_lib.config_from_dict({"pipeline": {"output_dir": "/tmp/unused"}})
    seen: dict[tuple[str, str], str] = {}
    for node in definition.build_pipeline(config).components:
        if isinstance(node, tfx.dsl.Resolver):
            continue  # it passes existing artifacts on, and creates none
        for key, channel in node.outputs.items():
            owner = seen.setdefault((channel.type_name, key), node.id)
            assert owner == node.id, f"{owner} and {node.id} both output {key}"


def test_tfx_beam_components_are_told_where_the_direct_runners_code_is():
    """TFX's StatisticsGen packages TFX for Beam's workers unless the arguments say where
    their code comes from; the DirectRunner never reads that package (definition.py)."""
    from tfx.utils import dependency_utils

    direct = definition.tfx_beam_args(config_lib.load_config())
    assert direct[-1] == f"--sdk_container_image={config_lib.IMAGE}"
    # TFX then adds no package of its own (it would build an sdist and name it here).
    assert dependency_utils.make_beam_dependency_flags(direct) == direct
    own_image = ["--runner=DirectRunner", "--sdk_container_image=registry.example/beam:1"]
    dataflow = [
        "--runner=DataflowRunner",
        "--project=p",
        "--region=europe-west1",
        "--temp_location=gs://bucket/tmp",
    ]
    for given in (own_image, dataflow):
        config = config_lib.load_config(overrides=[f"pipeline.beam_args=[{', '.join(given)}]"])
        assert definition.tfx_beam_args(config) == given


def test_building_and_running_the_pipeline_does_not_import_tfx_v1s_cloud_extensions():
    """`from tfx import v1` imports every TFX extension, Google Cloud's AI Platform client
    among them (2.2 s at every start of `dp-fedemb run`); the pipeline imports TFX's own
    modules instead. A fresh interpreter, as the CLI starts."""
    probe = (
        "import sys\n"
        "from pipeline import config, definition, local_run\n"
        "definition.build_pipeline(config.load_config())\n"
        "print(sorted(m for m in ('tfx.v1', 'google.cloud.aiplatform') if m in sys.modules))\n"
        "sys.modules['tff_algorithms.federated.runtime'].release_import_time_context()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(paths.REPO)},
    )
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", (
        done.stdout + done.stderr[-2000:]
    )

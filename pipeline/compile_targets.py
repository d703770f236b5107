"""Deployable definitions of the pipeline: Kubeflow Pipelines V2 JSON and an Airflow DAG file.

Both are built from the same `definition.build_pipeline`. The Kubeflow target compiles
with TFX's KubeflowV2DagRunner: every component runs in `image`, where this project
is installed, and components are referenced by module path. The Airflow target writes a
DAG file: the pipeline's steps and edges as Airflow tasks, importing only Airflow; each
task rebuilds the pipeline from the embedded config and launches its component as TFX's
AirflowDagRunner would (pipeline/airflow_tasks.py; Airflow itself is needed only there).

Neither holds a schedule or noise seed: configs that fix one (the testing flags) are
refused, and otherwise training draws both from OS entropy when it runs.
"""

from __future__ import annotations

import json
import os
import sys

from pipeline import config as config_lib
from pipeline import definition


def _refuse_fixed_seeds(config: config_lib.PipelineConfig) -> None:
    """A deployable definition never fixes the secret seeds: compiled files are shared."""
    train = config.train_job_dict()
    fixed = [name for name in ("testing_fixed_schedule", "testing_fixed_noise") if train[name]]
    if fixed:
        raise ValueError(
            f"config train.{fixed[0]} is for tests only: a deployable pipeline draws its "
            "schedule and noise seeds from OS entropy at run time"
        )


def _release_tff() -> None:
    """Building the pipeline imports TFF: its import-time context would print a traceback
    at exit (tff_algorithms.federated.runtime.release_import_time_context)."""
    if "tensorflow_federated" in sys.modules:
        from tff_algorithms.federated import runtime

        runtime.release_import_time_context()


def compile_kubeflow(config: config_lib.PipelineConfig, out_file: str, pipeline_root: str) -> str:
    from tfx import v1 as tfx

    _refuse_fixed_seeds(config)
    pipeline = definition.build_pipeline(config, root=pipeline_root)
    runner = tfx.orchestration.experimental.KubeflowV2DagRunner(
        config=tfx.orchestration.experimental.KubeflowV2DagRunnerConfig(
            default_image=config.pipeline.image
        ),
        output_dir=os.path.dirname(os.path.abspath(out_file)),
        output_filename=os.path.basename(out_file),
    )
    try:
        runner.run(pipeline, write_out=True)
    finally:
        _release_tff()
    return out_file


_AIRFLOW_TEMPLATE = '''\
"""Airflow DAG of the dp-fedemb pipeline, written by `dp-fedemb compile --target airflow`.

Put this file in the DAGs folder of an Airflow whose workers have dp-fedemb installed
(container image {image}; `make airflow-setup` locally). This file imports only Airflow,
so the scheduler parses it fast; each task rebuilds the pipeline from CONFIG with the
code the local runner uses and runs its one TFX component
(pipeline/airflow_tasks.py). Re-run the compile command to change CONFIG or the steps.
"""

import datetime

from airflow import models
from airflow.operators.python import PythonOperator

IMAGE = {image!r}
PIPELINE_ROOT = {pipeline_root!r}
METADATA_PATH = {metadata_path!r}
CONFIG = {config}

# Each step and the steps it waits for, in the pipeline's order.
TASKS = {tasks}


def run_component(component_id, run_id):
    from pipeline import airflow_tasks  # TensorFlow, TFX and TFF load here, in the task

    airflow_tasks.run_component(CONFIG, PIPELINE_ROOT, METADATA_PATH, component_id, run_id)


with models.DAG(
    dag_id={dag_id!r},
    schedule=None,
    start_date=datetime.datetime(2024, 1, 1),
    catchup=False,
) as DAG:
    _operators = {{
        _task_id: PythonOperator(
            task_id=_task_id,
            python_callable=run_component,
            op_kwargs={{"component_id": _task_id, "run_id": "{{{{ run_id }}}}"}},
        )
        for _task_id in TASKS
    }}
    for _task_id, _upstream in TASKS.items():
        for _before in _upstream:
            _operators[_before] >> _operators[_task_id]
'''


def _python_literal(value, sort_keys: bool = True) -> str:
    """JSON text as a Python literal (the config holds only JSON types)."""
    text = json.dumps(value, indent=4, sort_keys=sort_keys)
    return (
        text.replace(": true", ": True").replace(": false", ": False").replace(": null", ": None")
    )


def airflow_dag_source(config: config_lib.PipelineConfig, pipeline_root: str) -> str:
    from pipeline import airflow_tasks

    pipeline = definition.build_pipeline(config, root=pipeline_root)
    return _AIRFLOW_TEMPLATE.format(
        image=config.pipeline.image,
        pipeline_root=pipeline_root,
        metadata_path=os.path.join(pipeline_root, "metadata.sqlite"),
        config=_python_literal(config.to_dict()),
        tasks=_python_literal(airflow_tasks.dag_tasks(pipeline), sort_keys=False),
        dag_id=config.pipeline.name,
    )


def compile_airflow(config: config_lib.PipelineConfig, out_file: str, pipeline_root: str) -> str:
    _refuse_fixed_seeds(config)
    try:
        source = airflow_dag_source(config, pipeline_root)
    finally:
        _release_tff()
    compile(source, out_file, "exec")  # a syntax error here is a bug, not a user error
    with open(out_file, "w", encoding="utf-8") as f:
        f.write(source)
    return out_file

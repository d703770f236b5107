"""Deployable definitions of the pipeline: Kubeflow Pipelines V2 JSON and an Airflow DAG file.

Both are built from the same `definition.build_pipeline`. The Kubeflow target compiles
with TFX's KubeflowV2DagRunner: every component runs in `image`, where this project
is installed, and components are referenced by module path. The Airflow target writes a
DAG file: Python that, on the Airflow scheduler, rebuilds the pipeline from the embedded
config and hands it to TFX's AirflowDagRunner (Airflow itself is needed only there).

Neither holds a schedule or noise seed: configs that fix one (the testing flags) are
refused, and otherwise training draws both from OS entropy when it runs.
"""

from __future__ import annotations

import json
import os

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
    runner.run(pipeline, write_out=True)
    return out_file


_AIRFLOW_TEMPLATE = '''\
"""Airflow DAG of the dp-fedemb pipeline, written by `dp-fedemb compile --target airflow`.

Put this file in the DAGs folder of an Airflow whose workers have dp-fedemb installed
(container image {image}). The pipeline is rebuilt from CONFIG with the same code the
local runner uses; edit CONFIG or re-run the compile command to change it.
"""

import datetime

from tfx.orchestration import metadata
from tfx.orchestration.airflow.airflow_dag_runner import AirflowDagRunner, AirflowPipelineConfig

from pipeline import config as config_lib
from pipeline import definition

IMAGE = {image!r}
PIPELINE_ROOT = {pipeline_root!r}
METADATA_PATH = {metadata_path!r}
CONFIG = {config}

AIRFLOW_DAG_CONFIG = {{
    "schedule_interval": None,
    "start_date": datetime.datetime(2024, 1, 1),
}}

DAG = AirflowDagRunner(AirflowPipelineConfig(airflow_dag_config=AIRFLOW_DAG_CONFIG)).run(
    definition.build_pipeline(
        config_lib.config_from_dict(CONFIG),
        root=PIPELINE_ROOT,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(METADATA_PATH),
    )
)
'''


def airflow_dag_source(config: config_lib.PipelineConfig, pipeline_root: str) -> str:
    config_literal = json.dumps(config.to_dict(), indent=4, sort_keys=True)
    # JSON literals that differ from Python's.
    config_literal = (
        config_literal.replace(": true", ": True")
        .replace(": false", ": False")
        .replace(": null", ": None")
    )
    return _AIRFLOW_TEMPLATE.format(
        image=config.pipeline.image,
        pipeline_root=pipeline_root,
        metadata_path=os.path.join(pipeline_root, "metadata.sqlite"),
        config=config_literal,
    )


def compile_airflow(config: config_lib.PipelineConfig, out_file: str, pipeline_root: str) -> str:
    _refuse_fixed_seeds(config)
    source = airflow_dag_source(config, pipeline_root)
    compile(source, out_file, "exec")  # a syntax error here is a bug, not a user error
    with open(out_file, "w", encoding="utf-8") as f:
        f.write(source)
    return out_file

"""Runs one component of the dp-fedemb pipeline inside an Airflow task.

The DAG file that `dp-fedemb compile --target airflow` writes imports only Airflow and
the standard library, so the scheduler parses it in well under Airflow's default
`dagbag_import_timeout` (30 s). Its task ids and edges are fixed when it is compiled;
each task calls `run_component`, which imports TensorFlow, TFX and the project,
rebuilds the pipeline from the embedded config and launches that one component as
TFX's `AirflowDagRunner` does (the same launcher, driver and ML Metadata records).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

_LOG = logging.getLogger(__name__)


def dag_tasks(pipeline) -> dict[str, list[str]]:  # noqa: ANN001 - a tfx.dsl.Pipeline
    """Every node id and the ids it waits for, in the pipeline's topological order."""
    return {node.id: sorted(up.id for up in node.upstream_nodes) for node in pipeline.components}


def _release_tff_at_exit() -> None:
    """TFF's import-time context fails noisily in `__del__` at interpreter shutdown.

    Released by an exit hook, not after each task: `airflow dags test` runs every task in
    one process, and later tasks may still use TFF as they do under LocalDagRunner. No
    runtime is left to stop: a training task's `runtime.session` stops the one it started.
    """
    if "tensorflow_federated" in sys.modules:
        from tff_algorithms.federated import runtime

        runtime.release_import_time_context()


_exit_hook_registered = False


def run_component(
    config_dict: Mapping[str, Any],
    pipeline_root: str,
    metadata_path: str,
    component_id: str,
    run_id: str,
) -> None:
    """Launches `component_id` of the pipeline for Airflow DAG run `run_id`."""
    from tfx.dsl.components.base import base_component
    from tfx.orchestration import data_types, metadata
    from tfx.orchestration.config import config_utils, pipeline_config

    from pipeline import config as config_lib
    from pipeline import definition

    pipeline = definition.build_pipeline(
        config_lib.config_from_dict(dict(config_dict)),
        root=pipeline_root,
        metadata_connection_config=metadata.sqlite_metadata_connection_config(metadata_path),
    )
    nodes = {node.id: node for node in pipeline.components}
    if component_id not in nodes:
        raise ValueError(
            f"the DAG's task {component_id} is not a node of the pipeline its config builds "
            f"({', '.join(nodes)}): compile the DAG again with this dp-fedemb"
        )
    component = nodes[component_id]
    if isinstance(component, base_component.BaseComponent):
        component._resolve_pip_dependencies(pipeline_root)  # noqa: SLF001 - as AirflowDagRunner
    launcher_class, component_config = config_utils.find_component_launch_info(
        pipeline_config.PipelineConfig(), component
    )
    additional_args = dict(pipeline.additional_pipeline_args)
    additional_args.setdefault("tmp_dir", os.path.join(pipeline_root, ".temp", ""))
    launcher = launcher_class.create(
        component=component,
        pipeline_info=data_types.PipelineInfo(
            pipeline_name=pipeline.pipeline_info.pipeline_name,
            pipeline_root=pipeline_root,
            run_id=run_id,
        ),
        driver_args=data_types.DriverArgs(enable_cache=pipeline.enable_cache),
        metadata_connection=metadata.Metadata(pipeline.metadata_connection_config),
        beam_pipeline_args=pipeline.beam_pipeline_args,
        additional_pipeline_args=additional_args,
        component_config=component_config,
    )
    try:
        launcher.launch()
    except Exception as e:
        # One line that names the step, above Airflow's traceback in the task log.
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        _LOG.error("dp-fedemb: %s failed: %s", component_id, message)
        raise
    finally:
        global _exit_hook_registered
        if not _exit_hook_registered and "tensorflow_federated" in sys.modules:
            # Registered once TFF is loaded, so it runs before TFF's own exit hooks.
            atexit.register(_release_tff_at_exit)
            _exit_hook_registered = True

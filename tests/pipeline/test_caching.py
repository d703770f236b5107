"""Caching sees code changes: code fingerprints, and their effect in a real LocalDagRunner.

TFX 1.15 keys the cache of a Python function component on its class path, inputs and
parameters, not on its code; pipeline.fingerprint adds a hash of the code to every
component's parameters. This test runs one component on a real MLMD store three times.
"""

import dataclasses
import json

import pytest
from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2
from tfx import v1 as tfx

from pipeline import config as config_lib
from pipeline import fingerprint
from pipeline.components import data


def test_fingerprint_covers_the_library_code_a_component_calls():
    closure = fingerprint.module_closure("pipeline.components.training")
    assert "tff_algorithms.jobs.train_job" in closure and "beam_jobs.partition" in closure
    assert "beam_jobs.dedup" in fingerprint.module_closure("pipeline.components.data")
    assert fingerprint.code_fingerprint("pipeline.components.data") != fingerprint.code_fingerprint(
        "pipeline.components.training"
    )
    assert fingerprint.code_fingerprint("pipeline.components.data") == (
        fingerprint.code_fingerprint("pipeline.components.data")
    )


def _run_example_gen(tmp_path, code: str) -> list[int]:
    synthetic = config_lib.SyntheticSection(identities=8, images_per_identity=3)
    example_gen = data.CanonicalExampleGen(
        input_sources="[]",
        public_input_sources="[]",
        evaluation_input_sources="[]",
        synthetic_config=json.dumps(dataclasses.asdict(synthetic)),
        synthetic_public_config="null",
        split_config=json.dumps(dataclasses.asdict(config_lib.SplitSection(public_fraction=0.0))),
        max_bad_fraction=0.0,
        identity_feature="",
        max_image_pixels=0,
        beam_args=json.dumps(["--runner=DirectRunner"]),
        code_fingerprint=code,
    )
    connection = tfx.orchestration.metadata.sqlite_metadata_connection_config(
        str(tmp_path / "metadata.sqlite")
    )
    pipeline = tfx.dsl.Pipeline(
        pipeline_name="caching",
        pipeline_root=str(tmp_path / "root"),
        components=[example_gen],
        enable_cache=True,
        metadata_connection_config=connection,
    )
    tfx.orchestration.LocalDagRunner().run(pipeline)
    store = metadata_store.MetadataStore(connection)
    return [e.last_known_state for e in sorted(store.get_executions(), key=lambda e: e.id)]


@pytest.mark.slow
def test_changed_code_fingerprint_invalidates_the_cache(tmp_path):
    code = fingerprint.code_fingerprint(data.__name__)
    complete, cached = metadata_store_pb2.Execution.COMPLETE, metadata_store_pb2.Execution.CACHED
    assert _run_example_gen(tmp_path, code) == [complete]
    assert _run_example_gen(tmp_path, code) == [complete, cached]
    # The same component and parameters, other code: executed again.
    assert _run_example_gen(tmp_path, code + "-edited") == [complete, cached, complete]

"""A two-component TFX pipeline on LocalDagRunner with a real ML Metadata store."""

import os

import tensorflow as tf
from ml_metadata.metadata_store import metadata_store
from tfx import v1 as tfx


def _write_examples(directory: str, n: int) -> None:
    os.makedirs(directory)
    with tf.io.TFRecordWriter(os.path.join(directory, "data.tfrecord")) as writer:
        for i in range(n):
            example = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "user_id": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[f"u{i % 7}".encode()])
                        ),
                        "identity": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[f"id{i % 5}".encode()])
                        ),
                    }
                )
            )
            writer.write(example.SerializeToString())


def test_import_example_gen_then_statistics_gen(tmp_path):
    data_dir = str(tmp_path / "data")
    _write_examples(data_dir, 40)
    metadata_path = str(tmp_path / "metadata.sqlite")
    example_gen = tfx.components.ImportExampleGen(input_base=data_dir)
    statistics_gen = tfx.components.StatisticsGen(examples=example_gen.outputs["examples"])
    pipeline = tfx.dsl.Pipeline(
        pipeline_name="smoke",
        pipeline_root=str(tmp_path / "root"),
        components=[example_gen, statistics_gen],
        metadata_connection_config=tfx.orchestration.metadata.sqlite_metadata_connection_config(
            metadata_path
        ),
        beam_pipeline_args=["--runner=DirectRunner", "--direct_num_workers=1"],
    )
    tfx.orchestration.LocalDagRunner().run(pipeline)

    store = metadata_store.MetadataStore(
        tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path)
    )
    examples = store.get_artifacts_by_type("Examples")
    statistics = store.get_artifacts_by_type("ExampleStatistics")
    assert len(examples) == 1 and len(statistics) == 1
    # Lineage: the statistics were computed by an execution that consumed the examples.
    [stats_event] = [
        e for e in store.get_events_by_artifact_ids([statistics[0].id]) if e.type == e.OUTPUT
    ]
    inputs = store.get_events_by_execution_ids([stats_event.execution_id])
    assert examples[0].id in {e.artifact_id for e in inputs if e.type == e.INPUT}
    split_files = tf.io.gfile.listdir(statistics[0].uri)
    assert {"Split-train", "Split-eval"} <= {f.rstrip("/") for f in split_files}

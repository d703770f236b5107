"""The Beam data jobs are runner-independent: options pass through, results do not move.

Synthetic records go through split -> dedup -> partition with `dp-fedemb data`, twice:
on the DirectRunner in memory (one process) and in multi_processing mode with two SDK
worker processes, which pickles every function to the workers and shares no module
state with them. What each job promises:
- split, dedup: the same set of records per output directory (the number of shards is
  the runner's choice) and byte-identical JSON summaries and reports;
- partition: byte-identical files (users sorted within shards).
(Each multi_processing job costs two worker processes importing TensorFlow, so the slow
test keeps to these three jobs; ingest ran the same way when this was written.)
"""

import glob
import json
import os
import threading

import numpy as np
import pytest
import tensorflow as tf
from apache_beam.options import pipeline_options as beam_options

from beam_jobs import records_io, schema, splits, synthetic
from pipeline import cli
from pipeline import config as config_lib

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=3, seed=4)
SPLIT_FLAGS = ["--validation-fraction", "0.2", "--test-fraction", "0.2", "--seed", "1"]
SPLIT = splits.SplitConfig(validation_fraction=0.2, test_fraction=0.2, seed=1)
IN_MEMORY = "--direct_num_workers=1 --direct_running_mode=in_memory"
TWO_PROCESSES = "--direct_num_workers=2 --direct_running_mode=multi_processing"


def _sdk_worker_children() -> set[int]:
    """PIDs of this process's children running Beam's SDK worker."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"sdk_worker_main" in command:
            found.add(int(entry))
    return found


class _WorkerWatch:
    """Collects the SDK worker processes started while it runs (polls /proc)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(0.2):
            self.seen |= _sdk_worker_children()

    def __enter__(self) -> "_WorkerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()


def _data(capsys, *args: str) -> dict:
    code = cli.main(["dp-fedemb", "data", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def _synthetic_records_with_duplicates(root: str) -> str:
    """Synthetic canonical records plus two training records holding evaluation images
    (one exact copy, one shifted by a pixel), so dedup has work to do."""
    records = list(synthetic.records_for_identities(SYNTH, 0, SYNTH.identities))
    held_out = next(r for r in records if splits.identity_split(r.identity, SPLIT) != splits.TRAIN)
    trainee = next(r for r in records if splits.identity_split(r.identity, SPLIT) == splits.TRAIN)
    pixels = tf.io.decode_png(held_out.image).numpy()[..., 0]
    for image in (held_out.image, schema.encode_png(np.roll(pixels, 1, axis=1))):
        records.append(schema.CanonicalRecord(trainee.user_id, trainee.identity, image))
    directory = os.path.join(root, "synthetic")
    os.makedirs(directory)
    with tf.io.TFRecordWriter(os.path.join(directory, "records-00000-of-00001.tfrecord")) as w:
        for record in records:
            w.write(schema.serialize(record))
    return directory


def _run_data_jobs(capsys, records: str, out: str, beam_args: str) -> dict:
    beam = ["--runner", "DirectRunner", "--beam-args", beam_args]
    return {
        "split": _data(
            capsys, "split", "--input", records, "--out", f"{out}/split", *SPLIT_FLAGS, *beam
        ),
        "dedup": _data(capsys, "dedup", "--input", f"{out}/split", "--out", f"{out}/dedup", *beam),
        "partition": _data(
            capsys,
            "partition",
            "--input",
            f"{out}/dedup/train",
            "--out",
            f"{out}/partition",
            "--num-shards",
            "3",
            "--users-per-virtual-client",
            "2",
            "--virtual-clients-per-round",
            "2",
            "--rounds",
            "4",
            *beam,
        ),
    }


def _records(directory: str) -> list[bytes]:
    files = sorted(glob.glob(records_io.records_pattern(directory)))
    assert files, f"no records in {directory}"
    return sorted(r.numpy() for r in tf.data.TFRecordDataset(files))


def _files(directory: str) -> dict[str, bytes]:
    contents = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                contents[os.path.relpath(path, directory)] = f.read()
    return contents


@pytest.mark.slow
def test_two_process_direct_runner_gives_the_in_memory_results(tmp_path, capsys):
    records = _synthetic_records_with_duplicates(str(tmp_path))
    single_dir, multi_dir = str(tmp_path / "in_memory"), str(tmp_path / "two_processes")
    single = _run_data_jobs(capsys, records, single_dir, IN_MEMORY)
    with _WorkerWatch() as watch:
        multi = _run_data_jobs(capsys, records, multi_dir, TWO_PROCESSES)
    # The jobs ran in SDK worker processes: the options reached the runner.
    assert len(watch.seen) >= 2, f"SDK worker processes seen: {sorted(watch.seen)}"
    removed = single["dedup"]["train_vs_evaluation"]
    assert removed["removed_exact"] >= 1 and removed["removed_exact"] + removed["removed_near"] >= 2
    assert multi == single
    assert (
        _files(f"{multi_dir}/split")["split_summary.json"]
        == _files(f"{single_dir}/split")["split_summary.json"]
    )
    assert (
        _files(f"{multi_dir}/dedup")["dedup_report.json"]
        == _files(f"{single_dir}/dedup")["dedup_report.json"]
    )
    record_dirs = [f"{stage}/{name}" for stage in ("split", "dedup") for name in SPLIT.splits]
    for directory in record_dirs:
        assert _records(f"{multi_dir}/{directory}") == _records(f"{single_dir}/{directory}"), (
            directory
        )
    partition_files = _files(f"{single_dir}/partition")
    assert any(name.endswith(".tfrecord") for name in partition_files)
    assert _files(f"{multi_dir}/partition") == partition_files


# The invocations docs/scaling.md shows, as `--beam-args` values (keep the two in step).
RUNNER_ARGS = {
    "DataflowRunner": (
        "--project=my-project --region=europe-west1 --temp_location=gs://my-bucket/tmp "
        "--sdk_container_image=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1 "
        "--max_num_workers=50",
        beam_options.GoogleCloudOptions,
        {"project": "my-project", "region": "europe-west1"},
    ),
    "FlinkRunner": (
        "--flink_master=flink-jobmanager:8081 --environment_type=DOCKER "
        "--environment_config=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1 --parallelism=32",
        beam_options.FlinkRunnerOptions,
        {"flink_master": "flink-jobmanager:8081", "parallelism": 32},
    ),
    "SparkRunner": (
        "--spark_master_url=spark://spark-master:7077 --environment_type=DOCKER "
        "--environment_config=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1",
        beam_options.SparkRunnerOptions,
        {"spark_master_url": "spark://spark-master:7077"},
    ),
}


@pytest.mark.parametrize("runner", sorted(RUNNER_ARGS))
def test_documented_runner_options_reach_the_jobs_options(runner):
    import shlex

    args, options_class, expected = RUNNER_ARGS[runner]
    options = records_io.pipeline_options([f"--runner={runner}", *shlex.split(args)])
    assert options.view_as(beam_options.StandardOptions).runner == runner
    view = options.view_as(options_class)
    assert {name: getattr(view, name) for name in expected} == expected


@pytest.mark.parametrize(
    "beam_args, message",
    [
        ("--direct_num_wokers=2", "unknown Beam pipeline option --direct_num_wokers"),
        ("stray", "look like --name=value"),
    ],
)
def test_bad_beam_options_are_one_error_line(tmp_path, capsys, beam_args, message):
    (tmp_path / "in").mkdir()
    code = cli.main(
        ["dp-fedemb", "data", "split", "--input", str(tmp_path / "in")]
        + ["--out", str(tmp_path / "o"), "--beam-args", beam_args]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and message in err[0], err


def test_unknown_runner_is_one_error_line(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    with tf.io.TFRecordWriter(str(tmp_path / "in" / "records-00000-of-00001.tfrecord")) as w:
        w.write(schema.serialize(next(synthetic.records_for_identities(SYNTH, 0, 1))))
    code = cli.main(
        ["dp-fedemb", "data", "split", "--input", str(tmp_path / "in")]
        + ["--out", str(tmp_path / "out"), "--runner", "NoSuchRunner"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "NoSuchRunner" in err[-1], err


def test_pipeline_config_reaches_every_beam_job_tfx_component_and_the_tff_workers():
    from pipeline import definition

    beam_args = ["--runner=DirectRunner", *TWO_PROCESSES.split()]
    config = config_lib.load_config(
        overrides=[
            f"pipeline.beam_args=[{', '.join(beam_args)}]",
            "runtime.worker_addresses=[10.0.0.5:8000, 10.0.0.6:8000]",
            "runtime.worker_ca=/tls/ca.pem",
            "runtime.worker_cert=/tls/trainer.pem",
            "runtime.worker_key=/tls/trainer.key",
        ]
    )
    components = definition.build_components(config)
    passed = {
        c.id: json.loads(c.exec_properties["beam_args"])
        for c in components
        if "beam_args" in c.exec_properties
    }
    assert passed == {
        definition.EXAMPLE_GEN: beam_args,
        definition.DEDUP: beam_args,
        definition.PARTITION: beam_args,
        definition.PRETRAIN: beam_args,
    }
    # TFX's own Beam components (StatisticsGen, ...) take the pipeline-level args.
    pipeline = definition.build_pipeline(config, root="/tmp/unused-root")
    assert pipeline.beam_pipeline_args == beam_args
    # Private training connects to the configured TFF workers (tests/tff_algorithms/federated/test_multi_worker.py).
    private_train = next(c for c in components if c.id == definition.PRIVATE_TRAIN)
    assert json.loads(private_train.exec_properties["runtime_config"]) == {
        "worker_addresses": ["10.0.0.5:8000", "10.0.0.6:8000"],
        "local_workers": 1,
        "worker_ca": "/tls/ca.pem",
        "worker_cert": "/tls/trainer.pem",
        "worker_key": "/tls/trainer.key",
        "allow_insecure_workers": False,
    }


@pytest.mark.parametrize(
    "override, message",
    [
        ("pipeline.beam_args=[--direct_num_wokers=2]", "unknown Beam pipeline option"),
        ("runtime.local_workers=0", "config runtime: local_workers must be >= 1"),
    ],
)
def test_pipeline_config_refuses_bad_beam_args_and_workers(override, message):
    with pytest.raises(ValueError, match=message):
        config_lib.load_config(overrides=[override])

"""A secret sample: production runs draw the schedule seed from OS entropy (issue 8).

Sampling amplification assumes nobody knows which users trained in which round, so the
seed that decides it is drawn inside the training job, kept only with its checkpoints
(OUT/train_job.json) and never published: not in metrics.json, the ledger, an ML Metadata
property or execution parameter, nor a compiled pipeline. Checked here:
- a fixed schedule seed needs the testing flag (library, pipeline config, command line),
  and `dp-fedemb compile` refuses the testing seed flags;
- the partition's participation statistics need no seed;
- two production runs on the same data sample different users, the recorded seed is
  the one a run trained with (replayed with it, a testing run trains the same model bit
  for bit), and a resumed run re-uses it;
- the tiny pipeline run (conftest): PrivateTrain drew its seed in the executor, ML
  Metadata holds none, and its private work directory is gone.
The seed's absence from ML Metadata, files and logs by value, after a pipeline was
killed inside PrivateTrain and resumed, is checked in tests/tff_algorithms/jobs/test_crash_safety.py.
"""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from beam_jobs import partition, schedule, synthetic
from pipeline import cli, compile_targets, definition
from pipeline import config as config_lib
from pipeline.components import artifacts
from tests import support
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.jobs import job_outputs, train_job

# One xdist worker runs every module of the session's tiny pipeline run (conftest).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_pipeline")]

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=11)
TRAIN_IDENTITIES = 20
# Production schedule; the noise is fixed (its own testing flag, tests/tff_algorithms/jobs/test_noise_seed.py)
# so that runs can differ by their schedule only.
PRODUCTION = job_config.TrainJobConfig(
    rounds=2,
    noise_multiplier=0.5,
    users_per_virtual_client=2,
    virtual_clients_per_round=2,
    client_learning_rate=0.05,
    batch_size=8,
    head_capacity=4,
    embedding_size=16,
    evaluate_every=0,
    noise_seed=7,
    testing_fixed_noise=True,
)


def test_a_fixed_schedule_seed_needs_the_testing_flag():
    with pytest.raises(ValueError, match="for tests only") as refused:
        dataclasses.replace(PRODUCTION, schedule_seed=5)
    assert "\n" not in str(refused.value)
    fixed = dataclasses.replace(PRODUCTION, schedule_seed=5, testing_fixed_schedule=True)
    assert fixed.schedule_seed == 5
    # The flag alone fixes nothing: the seed still comes from OS entropy.
    assert dataclasses.replace(PRODUCTION, testing_fixed_schedule=True).schedule_seed is None
    with pytest.raises(ValueError, match="must be a boolean"):
        dataclasses.replace(PRODUCTION, testing_fixed_schedule=1)
    with pytest.raises(ValueError, match="schedule_seed must be >= 0"):
        dataclasses.replace(PRODUCTION, schedule_seed=-1, testing_fixed_schedule=True)
    with pytest.raises(ValueError, match="config train: a fixed schedule_seed"):
        config_lib.load_config(overrides=["train.schedule_seed=3"])
    config = config_lib.load_config(
        overrides=["train.schedule_seed=3", "train.testing_fixed_schedule=true"]
    )
    assert config.train_job_dict()["schedule_seed"] == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--data", "/nonexistent", "--output", "/x", "--schedule-seed=3"], "tests only"),
        (["run", "--set", "train.schedule_seed=3"], "tests only"),
        (
            ["compile", "--target=kubeflow", "--out=/nonexistent/p.json"]
            + ["--set", "train.schedule_seed=3", "--set", "train.testing_fixed_schedule=true"],
            "testing_fixed_schedule is for tests only",
        ),
        (
            ["compile", "--target=airflow", "--out=/nonexistent/dag.py"]
            + ["--set", "train.noise_seed=3", "--set", "train.testing_fixed_noise=true"],
            "testing_fixed_noise is for tests only",
        ),
    ],
)
def test_command_line_refuses_fixed_schedule_seeds_in_one_line(capsys, args, message):
    code = cli.main(["dp-fedemb", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("mode", schedule.MODES)
def test_participation_statistics_are_the_same_for_every_seed(mode):
    shape = schedule.ScheduleShape(103, 3, 5, mode)
    seeded = [schedule.VirtualClientSchedule(103, 3, 5, seed, mode) for seed in (0, 1, 2**61)]
    # The seeds do draw different rounds, so equal statistics are not a coincidence.
    assert len({plan.round_user_indices(0).tobytes() for plan in seeded}) == len(seeded)
    for rounds in (1, 7, 40):
        stats = shape.participation_stats(rounds)
        assert all(plan.participation_stats(rounds) == stats for plan in seeded)
        assert "seed" not in json.dumps(stats.to_dict())
    # What the partition job publishes is the shape's statistics.
    spec = partition.ScheduleSpec(3, 5, 40, mode)
    assert partition.participation({"users": 103}, spec) == shape.participation_stats(40).to_dict()


def test_compiled_pipelines_hold_no_schedule_seed(tmp_path):
    config = config_lib.config_from_dict({"pipeline": {"output_dir": str(tmp_path / "run")}})
    out = str(tmp_path / "pipeline.json")
    compile_targets.compile_kubeflow(config, out, "gs://bucket/root")
    with open(out) as f:
        tasks = json.load(f)["pipelineSpec"]["root"]["dag"]["tasks"]
    jobs = {
        name: json.loads(next(iter(job["runtimeValue"]["constantValue"].values())))
        for name, task in tasks.items()
        if (job := task.get("inputs", {}).get("parameters", {}).get("train_job_config"))
    }
    assert set(jobs) == {definition.CHECK_SCHEDULE, definition.PRETRAIN, definition.PRIVATE_TRAIN}
    for job in jobs.values():
        assert job["schedule_seed"] is None and job["testing_fixed_schedule"] is False
        assert job["noise_seed"] is None and job["testing_fixed_noise"] is False
    dag = compile_targets.airflow_dag_source(config, "gs://bucket/root")
    assert "schedule_seed" not in dag and "noise_seed" not in dag


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("seed_data"), SYNTH, TRAIN_IDENTITIES
    )


def _recorded_seed(output_dir: str) -> int:
    with open(os.path.join(output_dir, job_files.JOB_FILE)) as f:
        return json.load(f)["schedule_seed"]


def _users_per_round(seed: int) -> list[list[int]]:
    plan = job_plan.schedule_for(PRODUCTION, TRAIN_IDENTITIES, seed)
    return [sorted(plan.round_user_indices(r).ravel().tolist()) for r in range(PRODUCTION.rounds)]


def _assert_same_weights(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_production_runs_sample_different_users_and_a_resume_keeps_its_seed(
    tff_runtime, data, tmp_path
):
    runs = [train_job.run_train_job(PRODUCTION, *data, str(tmp_path / f"p{i}")) for i in (0, 1)]
    seeds = [_recorded_seed(run.output_dir) for run in runs]
    assert seeds[0] != seeds[1]
    assert _users_per_round(seeds[0]) != _users_per_round(seeds[1])
    weights = [support.saved_backbone(run.saved_model_dir) for run in runs]
    # Initialisation, heads and noise are seeded alike: the schedule alone differs.
    assert any(not np.array_equal(a, b) for a, b in zip(*weights, strict=True))
    for run in runs:
        assert run.metrics["schedule_seed_source"] == "os-entropy"
        assert "TESTING ONLY: fixed schedule" not in run.metrics["privacy"]
        published = [run.metrics_path, run.ledger_path]
        assert all(str(_recorded_seed(run.output_dir)) not in open(p).read() for p in published)

    # The recorded seed is the one the run trained with.
    replay = dataclasses.replace(PRODUCTION, schedule_seed=seeds[0], testing_fixed_schedule=True)
    replayed = train_job.run_train_job(replay, *data, str(tmp_path / "replay"))
    _assert_same_weights(weights[0], support.saved_backbone(replayed.saved_model_dir))
    assert replayed.metrics["schedule_seed_source"] == "fixed (testing)"
    assert "TESTING ONLY: fixed schedule seed" in replayed.metrics["privacy"]

    # What a kill after round 1 leaves: the same job resumes with the recorded seed.
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(runs[0].output_dir, resumed_dir)
    support.remove_checkpoint(os.path.join(resumed_dir, job_files.CHECKPOINT_DIR), 2)
    shutil.rmtree(os.path.join(resumed_dir, job_files.SAVED_MODEL_DIR))
    resumed = train_job.run_train_job(PRODUCTION, *data, resumed_dir)
    assert resumed.metrics["resumed_from_round"] == 1
    assert _recorded_seed(resumed_dir) == seeds[0]
    _assert_same_weights(weights[0], support.saved_backbone(resumed.saved_model_dir))


def test_a_job_record_without_a_schedule_seed_is_refused(tmp_path, data):
    output = str(tmp_path / "out")
    os.makedirs(output)
    reader = partition.PartitionReader(data[0])
    record = {**job_outputs.job_record(PRODUCTION, reader), "run_id": "r"}
    with open(os.path.join(output, job_files.JOB_FILE), "w") as f:
        json.dump(record, f)
    with pytest.raises(ValueError, match="records no schedule seed; use a new output directory"):
        train_job.run_train_job(PRODUCTION, *data, output)


def _property_texts(store) -> dict[str, str]:
    """Every property and custom property of every execution, artifact and context."""
    texts = {}
    for kind, nodes in (
        ("execution", store.get_executions()),
        ("artifact", store.get_artifacts()),
        ("context", store.get_contexts()),
    ):
        for node in nodes:
            for properties in (node.properties, node.custom_properties):
                for name, value in properties.items():
                    field = value.WhichOneof("value")
                    texts[f"{kind} {node.id} {name}"] = str(getattr(value, field, ""))
    return texts


@pytest.mark.slow
def test_pipeline_draws_the_schedule_seed_in_private_train_and_metadata_holds_none(
    tiny_pipeline_first_run,
):
    config, _, store, _ = tiny_pipeline_first_run
    # Other tests may have run the same pipeline again (cached or partial re-runs).
    executions = support.executions_by_node(store)[definition.PRIVATE_TRAIN]
    assert executions
    for execution in executions:
        parameters = {**execution.properties, **execution.custom_properties}
        job = json.loads(parameters["train_job_config"].string_value)
        assert job["schedule_seed"] is None and job["testing_fixed_schedule"] is False
    texts = _property_texts(store)
    with_seed_field = {where: text for where, text in texts.items() if "schedule_seed" in text}
    assert with_seed_field  # the training configs, PrivateTrain's and PretrainBackbone's
    for where, text in with_seed_field.items():
        assert json.loads(text)["schedule_seed"] is None, where
    # Both trainings (pretraining and private) drew their seeds inside the executor.
    algorithms = []
    for metrics in store.get_artifacts_by_type(artifacts.TrainingMetrics.TYPE_NAME):
        with open(os.path.join(metrics.uri, job_files.METRICS_FILE)) as f:
            trained = json.load(f)
        assert trained["schedule_seed_source"] == "os-entropy"
        algorithms.append(trained["algorithm"])
    assert set(algorithms) == {"centralized", job["algorithm"]}
    work = os.path.join(definition.pipeline_root(config), definition.PRIVATE_TRAIN, ".work")
    assert not os.path.exists(work) or os.listdir(work) == []

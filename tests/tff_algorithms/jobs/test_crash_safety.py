"""Crash safety: SIGKILLed training resumes to the uninterrupted result; torn checkpoints.

- `dp-fedemb train` is SIGKILLed after the checkpoint of a random round (seeded), the
  partial files of a save killed midway (TensorFlow's temporary folder, values without
  their index) are added, and it is re-run to the end: the model and the privacy ledger
  equal those of an uninterrupted run bit for bit. (A save takes milliseconds, too
  short for a test to kill it inside without a timing race.) (A kill right after a round is reported is the
  every-algorithm test's, below, and SIGTERM is tests/pipeline/test_train_cli.py's.)
- A newest checkpoint that does not read back (what a machine crash can leave after
  the rename: files never flushed, or a rename interrupted on an object store) is
  removed, and training resumes from the version before it, to the same end.
- Every registered algorithm's tiny job (`tests/crash_child.py`) is SIGKILLed at a
  random (seeded) step in a child process, its newest checkpoint then torn, and
  resumed: it equals one uninterrupted run, model, ledger and history, bit for bit.
- A pipeline SIGKILLed inside PrivateTrain re-runs with finished components cached and
  training resumed; the schedule seed PrivateTrain drew lives in its work directory
  only, and after the resumed run it is in no file of the run (ML Metadata included)
  and not in the killed run's log.
"""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import synthetic
from tests import crash_child, paths, support
from tff_algorithms.algorithms import registry
from tff_algorithms.base import job_files
from tff_algorithms.jobs import train_job

CLI_ROUNDS = 4
KILL_SEED = 20240611


@pytest.fixture(scope="module")
def process(tff_runtime):
    return support.toy_process()


def _tear(prefix: str, how: str) -> None:
    if how == "missing_index":  # renamed, nothing flushed
        os.remove(f"{prefix}.index")
        return
    [path] = tf.io.gfile.glob(f"{prefix}.index" if how == "truncated_index" else f"{prefix}.data-*")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("how", ["missing_index", "truncated_index", "truncated_data"])
def test_torn_newest_checkpoint_is_removed_and_training_resumes_from_the_previous(
    process, tmp_path, how
):
    straight = support.train_toy_rounds(process, str(tmp_path / "straight"), support.TOY_ROUNDS)
    directory = str(tmp_path / "torn")
    support.train_toy_rounds(process, directory, 2)
    _tear(os.path.join(directory, "ckpt-2"), how)

    resumed = support.train_toy_rounds(process, directory, support.TOY_ROUNDS)

    assert resumed.resumed_from_round == 1
    for a, b in zip(support.toy_weights(straight), support.toy_weights(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    assert resumed.ledger.to_json() == straight.ledger.to_json()
    # Round 2 was trained again; the newest two are kept, whole.
    assert tf.train.latest_checkpoint(directory).endswith("ckpt-4")
    assert os.path.exists(os.path.join(directory, "ckpt-3.index"))


def test_checkpoint_that_reads_but_does_not_fit_is_an_error_not_a_torn_write(process, tmp_path):
    directory = str(tmp_path / "ckpt")
    support.train_toy_rounds(process, directory, 1)
    wrong_structure = {"state": process.initialize(), "other": 1}
    with pytest.raises(ValueError, match="reads back but does not fit this job"):
        support.train_toy_rounds(process, directory, 2, initial_state=wrong_structure)
    assert os.path.exists(os.path.join(directory, "ckpt-1.index"))


# Every algorithm: SIGKILL in a child at a random step, and a torn newest checkpoint.

REPOSITORY = str(paths.REPO)


@pytest.fixture(scope="module")
def crash_data(tmp_path_factory):
    return support.small_job_inputs(tmp_path_factory.mktemp("crash-data"))


def test_every_registered_algorithm_has_a_crash_job():
    assert set(crash_child.CRASH_JOBS) == set(registry.names())


def _tear_newest_checkpoint(checkpoint_dir: str) -> int:
    """Truncates the newest checkpoint's variable values to half (a save whose data was
    never flushed); returns its step."""
    steps = [
        int(m.group(1))
        for name in os.listdir(checkpoint_dir)
        if (m := re.match(r"^ckpt-(\d+)\.index$", name))
    ]
    newest = max(steps)
    data = tf.io.gfile.glob(os.path.join(checkpoint_dir, f"ckpt-{newest}.data-*"))
    assert data, os.listdir(checkpoint_dir)
    for path in data:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    return newest


@pytest.mark.slow  # eight end-to-end jobs, each killed, resumed and run uninterrupted
@pytest.mark.timeout(600)
# Two xdist groups (conftest keeps a module on one worker otherwise), so make test-slow's
# two workers share the eight jobs; each builds `crash_data` once.
@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param(name, marks=pytest.mark.xdist_group(f"crash_safety_{i % 2}"))
        for i, name in enumerate(registry.names())
    ],
)
def test_killed_at_a_random_step_with_a_torn_newest_checkpoint_resumes_to_the_same_end(
    algorithm, crash_data, tff_runtime, tmp_path
):
    # Killed at step k (before its save), then the newest checkpoint, of step k - 1, torn:
    # the resumed run must drop it and go on from step k - 2 (k >= 3: a real checkpoint).
    config = crash_child.CRASH_JOBS[algorithm]
    rounds = crash_child.CRASH_ROUNDS
    kill_step = random.Random(f"{KILL_SEED}-{algorithm}").randint(3, rounds)
    killed_dir, log_path = str(tmp_path / "killed"), str(tmp_path / "killed.log")
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_child", algorithm, *crash_data, killed_dir]
            + [str(kill_step)],
            stdout=log,
            stderr=log,
            cwd=REPOSITORY,
            env=_environment(str(tmp_path)),
        )
    try:
        # The uninterrupted run, while the child trains.
        reference = train_job.run_train_job(config, *crash_data, str(tmp_path / "reference"))
        child.wait(300)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL, open(log_path).read()[-3000:]
    checkpoints = os.path.join(killed_dir, job_files.CHECKPOINT_DIR)
    assert _tear_newest_checkpoint(checkpoints) == kill_step - 1

    resumed = train_job.run_train_job(config, *crash_data, killed_dir)

    assert resumed.metrics["resumed_from_round"] == kill_step - 2
    support.assert_same_trained_outputs(reference, resumed)


# SIGKILL of the command line.


def _command(data: str, output: str) -> list[str]:
    flags = support.train_cli_flags(CLI_ROUNDS)
    return [support.CONSOLE_SCRIPT, "train", "--data", data, "--output", output, *flags]


def _environment(tmp_dir: str) -> dict[str, str]:
    # A SIGKILLed run cannot remove its temporary worker-log directory: keep it here.
    return {**os.environ, "TMPDIR": tmp_dir}


def _run_to_completion(data: str, output: str, tmp_dir: str) -> dict:
    done = subprocess.run(
        _command(data, output), capture_output=True, text=True, env=_environment(tmp_dir)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kill_after_checkpoint(data: str, output: str, tmp_dir: str, round_num: int) -> int:
    """Starts training, SIGKILLs it once round `round_num`'s checkpoint is saved (its
    index exists), and returns the newest round whose checkpoint the kill left."""
    log_path = os.path.join(tmp_dir, f"killed-after-{round_num}.log")
    checkpoints = os.path.join(output, job_files.CHECKPOINT_DIR)
    index = os.path.join(checkpoints, f"ckpt-{round_num}.index")
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            _command(data, output), stdout=log, stderr=log, env=_environment(tmp_dir)
        )
    try:
        deadline = time.monotonic() + 600
        while not os.path.exists(index):
            assert child.poll() is None, open(log_path).read()[-3000:]
            assert time.monotonic() < deadline, f"round {round_num} not reached in time"
            time.sleep(0.005)
    finally:
        child.kill()
        child.wait(60)
    return max(
        int(m.group(1))
        for name in os.listdir(checkpoints)
        if (m := re.match(r"^ckpt-(\d+)\.index$", name))
    )


def _leave_an_interrupted_save(checkpoints: str, saved: int) -> None:
    """What a kill inside the next round's save leaves: TensorFlow's temporary folder
    with part of the values, and a values file whose index was never written."""
    [values] = tf.io.gfile.glob(os.path.join(checkpoints, f"ckpt-{saved}.data-*"))
    with open(values, "rb") as f:
        half = f.read()[: os.path.getsize(values) // 2]
    temporary = os.path.join(checkpoints, f"ckpt-{saved + 1}_temp")
    os.makedirs(temporary, exist_ok=True)  # the kill may have left one
    for path in (
        os.path.join(temporary, "part-00000-of-00001.data-00000-of-00001"),
        os.path.join(checkpoints, f"ckpt-{saved + 1}.data-00000-of-00001"),
    ):
        with open(path, "wb") as f:
            f.write(half)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # three `dp-fedemb train` processes, one with data preparation
def test_sigkilled_training_resumes_to_exactly_the_uninterrupted_result(tmp_path):
    data, output, tmp_dir = str(tmp_path / "raw"), str(tmp_path / "out"), str(tmp_path / "tmp")
    os.makedirs(tmp_dir)
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    # The uninterrupted run. Virtual-client ids name the partition's files, so the
    # interrupted runs reuse its prepared data at the same path, not a copy.
    _run_to_completion(data, output, tmp_dir)
    reference_dir = str(tmp_path / "reference")
    os.makedirs(reference_dir)
    for name in (job_files.SAVED_MODEL_DIR, job_files.LEDGER_FILE, job_files.METRICS_FILE):
        shutil.move(os.path.join(output, name), reference_dir)
    for name in (job_files.CHECKPOINT_DIR, job_files.JOB_FILE):
        shutil.move(os.path.join(output, name), os.path.join(tmp_dir, f"reference-{name}"))

    # Killed once a random round k >= 2 is saved, a later save's partial files added: the
    # re-run removes them and resumes from the newest whole checkpoint.
    saved_round = _kill_after_checkpoint(
        data, output, tmp_dir, random.Random(KILL_SEED).randint(2, CLI_ROUNDS - 1)
    )
    checkpoints = os.path.join(output, job_files.CHECKPOINT_DIR)
    _leave_an_interrupted_save(checkpoints, saved_round)
    summary = _run_to_completion(data, output, tmp_dir)

    assert summary["resumed_from_round"] == saved_round
    for a, b in zip(
        support.saved_backbone(os.path.join(reference_dir, job_files.SAVED_MODEL_DIR)),
        support.saved_backbone(os.path.join(output, job_files.SAVED_MODEL_DIR)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    with open(os.path.join(reference_dir, job_files.LEDGER_FILE)) as f:
        reference_ledger = f.read()
    with open(os.path.join(output, job_files.LEDGER_FILE)) as f:
        assert f.read() == reference_ledger
    with open(os.path.join(reference_dir, job_files.METRICS_FILE)) as f:
        reference_history = json.load(f)["history"]
    with open(os.path.join(output, job_files.METRICS_FILE)) as f:
        history = support.without_round_seconds(json.load(f)["history"])
    assert history == support.without_round_seconds(reference_history)
    leftovers = [
        e for e in os.listdir(os.path.join(output, job_files.CHECKPOINT_DIR)) if "temp" in e
    ]
    assert not leftovers


# SIGKILL of the pipeline while PrivateTrain runs.


def _pipeline_config(output_dir: str, **overrides) -> dict:
    values = support.tiny_pipeline(output_dir)
    values["pretrain"] = {"source": "none"}
    values["train"].update(rounds=3, trainable_layers=["*"])  # from a random start
    # Below any run's epsilon: training starts only on the explicit override.
    values["budget"] = {"dataset_epsilon": 0.01, "override": True}
    for section, fields in overrides.items():
        values[section].update(fields)
    return values


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the pipeline once killed, once complete, once refused
def test_pipeline_killed_in_private_train_reruns_without_redoing_finished_components(
    tmp_path, capsys
):
    from ml_metadata.metadata_store import metadata_store
    from ml_metadata.proto import metadata_store_pb2

    from pipeline import cli, definition, local_run
    from pipeline import config as config_lib
    from pipeline.components import artifacts
    from tff_algorithms.privacy import budget

    output, tmp_dir = str(tmp_path / "run"), str(tmp_path / "tmp")
    os.makedirs(tmp_dir)
    config_path = str(tmp_path / "config.json")
    with open(config_path, "w") as f:
        json.dump(_pipeline_config(output), f)
    checkpoint = os.path.join(
        output,
        "pipeline_root",
        definition.PRIVATE_TRAIN,
        ".work",
        "*",
        "checkpoints",
        "ckpt-1.index",
    )
    with open(os.path.join(tmp_dir, "killed.log"), "w") as log:
        child = subprocess.Popen(
            [support.CONSOLE_SCRIPT, "run", "--config", config_path],
            stdout=log,
            stderr=log,
            env=_environment(tmp_dir),
        )
    try:
        deadline = time.monotonic() + 900
        while not tf.io.gfile.glob(checkpoint):
            assert child.poll() is None, open(os.path.join(tmp_dir, "killed.log")).read()[-3000:]
            assert time.monotonic() < deadline, "PrivateTrain saved no checkpoint in time"
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait(60)

    config = config_lib.config_from_dict(_pipeline_config(output))
    store = metadata_store.MetadataStore(definition.local_metadata_config(config))
    killed = {node: [e.id for e in ex] for node, ex in support.executions_by_node(store).items()}
    # The resolver of the last blessed model runs anew every time by design.
    finished_before_kill = [
        node
        for node, ids in killed.items()
        if node not in (definition.PRIVATE_TRAIN, definition.BASELINE_RESOLVER) and ids
    ]
    assert definition.PARTITION in finished_before_kill
    # The schedule seed PrivateTrain drew from OS entropy, kept next to its checkpoints.
    [job_file] = tf.io.gfile.glob(
        os.path.join(os.path.dirname(os.path.dirname(checkpoint)), job_files.JOB_FILE)
    )
    with open(job_file) as f:
        schedule_seed = str(json.load(f)["schedule_seed"]).encode()

    summary = local_run.run_pipeline(config, progress=None)

    states = {
        node: [e.last_known_state for e in executions if e.id not in killed.get(node, [])]
        for node, executions in support.executions_by_node(store).items()
    }
    cached, complete = metadata_store_pb2.Execution.CACHED, metadata_store_pb2.Execution.COMPLETE
    for node in finished_before_kill:
        assert states[node] == [cached], node
    assert states[definition.PRIVATE_TRAIN] == [complete]
    [metrics] = store.get_artifacts_by_type(artifacts.TrainingMetrics.TYPE_NAME)
    with open(os.path.join(metrics.uri, job_files.METRICS_FILE)) as f:
        trained = json.load(f)
    assert trained["resumed_from_round"] >= 1 and trained["rounds"] == 3
    assert summary.recall_at_far
    # The work directory went with success; 62 random bits match no other digits.
    assert not os.path.exists(job_file)
    run_files = [os.path.join(d, n) for d, _, names in os.walk(output) for n in names]
    leaks = [
        path
        for path in [*run_files, os.path.join(tmp_dir, "killed.log")]
        if schedule_seed in pathlib.Path(path).read_bytes()
    ]
    assert any(p.endswith("metadata.sqlite") for p in run_files) and leaks == []

    # The budget: charged once across kill and resume, the override in lineage.
    policy = config.budget_policy_dict()
    with open(policy["ledger_path"]) as f:
        [dataset] = json.load(f)["datasets"].values()
    assert len(dataset["runs"]) == 1 and dataset["runs"][0]["overridden"]
    [ledger] = store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME)
    properties = ledger.custom_properties
    assert properties[artifacts.BUDGET_OVERRIDDEN].int_value == 1
    assert properties[artifacts.DATASET_EPSILON].double_value == pytest.approx(
        properties[artifacts.EPSILON].double_value
    )
    assert properties[artifacts.DATASET_BUDGET_EPSILON].double_value == 0.01
    fingerprint = properties[artifacts.DATASET_FINGERPRINT].string_value
    assert budget.dataset_spent(policy["ledger_path"], fingerprint, trained["delta"]) > 0
    [train_execution] = [
        e
        for e in support.executions_by_node(store)[definition.PRIVATE_TRAIN]
        if e.last_known_state == complete
    ]
    assert json.loads(train_execution.custom_properties["budget_policy"].string_value)["override"]

    # Training again without the override is refused, in one line, before training.
    code = cli.main(
        [
            "dp-fedemb",
            "run",
            "--config",
            config_path,
            "--set",
            "budget.override=false",
            "--from-component",
            definition.PRIVATE_TRAIN,
        ]
    )
    errors = [
        line
        for line in capsys.readouterr().err.splitlines()
        if line.startswith("dp-fedemb run: error:")
    ]
    assert code != 0
    assert len(errors) == 1 and "dataset privacy budget exceeded" in errors[0], errors
    with open(policy["ledger_path"]) as f:
        [dataset] = json.load(f)["datasets"].values()
    assert len(dataset["runs"]) == 1

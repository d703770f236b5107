"""`dp-fedemb train` / `evaluate` through the console script: end to end, resume, bad input."""

import json
import os
import signal
import subprocess
import time

import pytest
from absl import flags

from beam_jobs import synthetic
from pipeline import cli
from pipeline.commands import train, train_config
from tests import support
from tff_algorithms.base import job_files

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
# One xdist worker for the whole module: its module fixture (minutes) is then built once,
# not once on each worker (tests/conftest.py leaves slow modules ungrouped).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_cli")]

TRAIN_FLAGS = support.train_cli_flags(rounds=3)


def _train_command(data: str, output: str, *extra: str) -> list[str]:
    flags = [*TRAIN_FLAGS, *extra]
    return [support.CONSOLE_SCRIPT, "train", "--data", data, "--output", output, *flags]


def _wait_for(path: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        assert process.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A training run stopped by SIGTERM after its first checkpoint, then re-run to the end."""
    root = tmp_path_factory.mktemp("cli")
    data, output = str(root / "raw"), str(root / "out")
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    with open(root / "first.log", "wb") as log:
        first = subprocess.Popen(_train_command(data, output), stdout=log, stderr=log)
        try:
            _wait_for(os.path.join(output, "checkpoints", "ckpt-1.index"), first, 300)
        finally:
            first.send_signal(signal.SIGTERM)
            first.wait(60)
    second = subprocess.run(_train_command(data, output), capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    return data, output, first.returncode, summary, second.stderr


def test_rerunning_train_resumes_and_finishes(trained):
    _, output, first_code, summary, progress = trained
    assert first_code != 0  # stopped, not finished
    assert summary["resumed_from_round"] >= 1 and summary["rounds"] == 3
    metrics = json.loads(open(os.path.join(output, job_files.METRICS_FILE)).read())
    assert set(metrics["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert metrics["epsilon"] > 0 and metrics["rounds"] == 3 and metrics["wall_seconds"] > 0
    assert os.path.exists(os.path.join(output, "saved_model", "saved_model.pb"))
    ledger = json.loads(open(os.path.join(output, job_files.LEDGER_FILE)).read())
    assert [entry["round"] for entry in ledger["history"]] == [1, 2, 3]
    # Progress: one line per round trained in this run, ending with the last round.
    assert "round 3/3" in progress


def test_rerunning_a_finished_job_changes_no_file(trained):
    data, output, _, summary, _ = trained
    before = support.files_with_times(output)
    again = subprocess.run(_train_command(data, output), capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished: nothing trained or written" in again.stderr
    rerun = json.loads(again.stdout.strip().splitlines()[-1])
    assert rerun["already_finished"] and not summary["already_finished"]
    assert {k: v for k, v in rerun.items() if k != "already_finished"} == {
        k: v for k, v in summary.items() if k != "already_finished"
    }
    after = support.files_with_times(output)
    assert sorted(after) == sorted(before)
    changed = [path for path in before if after[path] != before[path]]
    assert not changed, changed


def test_evaluate_loads_the_trained_model(trained):
    _, output, _, summary, _ = trained
    result = subprocess.run(
        [
            support.CONSOLE_SCRIPT,
            "evaluate",
            "--model",
            summary["saved_model"],
            "--data",
            summary["test_data"],
            "--compare",
            summary["saved_model"],
            "--bootstrap-resamples",
            "200",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(evaluation["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert evaluation["images"] > 0 and evaluation["genuine_pairs"] > 0
    # The split summary beside --data gives the mode (the library default here).
    assert evaluation["split_mode"] == summary["split_mode"] == "identity_and_user"
    for far in evaluation["recall_at_far"]:
        low, high = evaluation["recall_at_far_interval"][far]
        assert 0 <= low <= high <= 1
        # A model compared with itself: every paired resample differs by exactly zero.
        assert evaluation["versus"]["compare"][far] == {"difference": 0.0, "interval": [0.0, 0.0]}
    assert "Exception ignored" not in result.stderr


def test_train_and_evaluate_on_shared_landmarks_in_held_out_images_mode(tmp_path):
    # 40 photographers each holding 3 of 10 landmarks (Zipf-like): identity_and_user
    # would drop most records; held_out_images keeps each photographer whole.
    data, output = str(tmp_path / "raw"), str(tmp_path / "out")
    shared = synthetic.SyntheticConfig(
        identities=10, images_per_identity=2, identities_per_user=3, users_sharing_identities=40
    )
    synthetic.write_image_folder(data, shared)
    flags = [f for f in support.train_cli_flags(rounds=2) if not f.startswith("--rounds")]
    command = [support.CONSOLE_SCRIPT, "train", "--data", data, "--output", output, *flags]
    # Two photographers hold up to 6 landmarks: the local head needs that many rows.
    trained = subprocess.run(
        [*command, "--rounds=2", "--split-mode=held_out_images", "--head-capacity=6"],
        capture_output=True,
        text=True,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads(trained.stdout.strip().splitlines()[-1])
    assert summary["split_mode"] == "held_out_images"
    evaluated = subprocess.run(
        [
            support.CONSOLE_SCRIPT,
            "evaluate",
            "--model",
            summary["saved_model"],
            "--data",
            summary["test_data"],
            "--bootstrap-resamples",
            "50",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["split_mode"] == "held_out_images"
    assert result["genuine_pairs_across_users_only"] and result["genuine_pairs"] > 0


def _error_line(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["dp-fedemb", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, lines


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--virtual-clients-per-round=100"], "cannot fill a round"),
        (["--max-epsilon=0.5"], "over budget"),
        (["--noise-multiplier=-1"], "--noise-multiplier must be in [0, 1e+06]"),
        (["--algorithm=fedsgd"], "--algorithm must be one of"),
        (["--head-init=zeros"], "--head-init must be one of"),
        (["--head-loss=triplet"], "--head-loss must be one of"),
        (["--head-loss=cosfase"], "did you mean cosface?"),
        (["--target-epsilon=5"], "at most one of --noise-multiplier and --target-epsilon"),
    ],
)
def test_bad_hyperparameters_give_one_error_line(trained, capsys, extra, message):
    data, output, _, _, _ = trained
    code, lines = _error_line(
        capsys, "train", "--data", data, "--output", output, *TRAIN_FLAGS, *extra
    )
    assert code != 0
    assert len(lines) == 1 and message in lines[0], lines


def test_an_unknown_split_mode_gives_one_error_line(tmp_path, capsys):
    code, lines = _error_line(
        capsys,
        "train",
        "--data",
        str(tmp_path),
        "--output",
        str(tmp_path / "o"),
        "--split-mode=held_out_image",
    )
    assert code != 0 and len(lines) == 1, lines
    assert "--split-mode must be one of" in lines[0] and "held_out_images" in lines[0], lines


def test_missing_inputs_give_one_error_line(tmp_path, capsys):
    code, lines = _error_line(
        capsys, "train", "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "o")
    )
    assert code != 0 and len(lines) == 1 and "--data" in lines[0], lines
    assert "does not exist" in lines[0], lines
    code, lines = _error_line(
        capsys, "evaluate", "--model", str(tmp_path / "none"), "--data", str(tmp_path)
    )
    assert code != 0 and len(lines) == 1 and "--model" in lines[0], lines
    assert "does not exist" in lines[0], lines
    code, lines = _error_line(capsys, "evaluate", "--model", str(tmp_path), "--data", str(tmp_path))
    assert code != 0 and len(lines) == 1 and "not a SavedModel" in lines[0], lines


def test_renamed_flags_still_work_with_one_deprecation_line_each(tmp_path, capsys):
    code, lines = _error_line(
        capsys,
        "train",
        "--data",
        str(tmp_path / "missing"),
        "--output",
        str(tmp_path / "o"),
        "--client-lr=0.05",
        "--server-lr",
        "-1",
        "--client-lr=0.1",
    )
    assert code != 0
    assert lines == [
        "dp-fedemb train: warning: --client-lr is deprecated; use --client-learning-rate",
        "dp-fedemb train: warning: --server-lr is deprecated; use --server-learning-rate",
        # The old spelling's value reached the new flag, and errors name the new flag.
        "dp-fedemb train: error: --server-learning-rate must be > 0, got -1",
    ]


def _job_config(*args: str):  # noqa: ANN202 - a TrainJobConfig
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(
        ["dp-fedemb train", *cli.renamed_flags("train", train.RENAMED_FLAGS, flag_values, args)]
    )
    return train_config.job_config({name: flag_values[name].value for name in flag_values})


def test_renamed_flags_set_the_same_fields_as_their_new_names(capsys):
    old = _job_config("--client-lr=0.07", "--server-lr", "0.4", "--rounds=5")
    new = _job_config("--client-learning-rate=0.07", "--server-learning-rate", "0.4", "--rounds=5")
    assert old == new
    assert (new.client_learning_rate, new.server_learning_rate) == (0.07, 0.4)
    assert capsys.readouterr().err.count("deprecated") == 2
    # A value that looks like an old flag is a value: --beam-args takes it whole.
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    args = ["--beam-args", "--client-lr=1"]
    assert cli.renamed_flags("train", train.RENAMED_FLAGS, flag_values, args) == args


def test_server_optimizer_flag_sets_the_field_and_refuses_other_names(tmp_path, capsys):
    assert _job_config("--algorithm=dp-fedavg", "--server-optimizer=lamb").server_optimizer == (
        "lamb"
    )
    code, lines = _error_line(
        capsys,
        "train",
        "--data",
        str(tmp_path / "missing"),
        "--output",
        str(tmp_path / "o"),
        "--server-optimizer=adamw",
    )
    assert code != 0
    assert len(lines) == 1 and "--server-optimizer must be one of sgd, adam, lamb" in lines[0], (
        lines
    )

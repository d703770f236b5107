"""FDML as a training job (issue 27 item 3): outputs, epsilon, refusals, budget
(resume: tests/tff_algorithms/jobs/test_crash_safety.py)."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from absl import flags

from beam_jobs import synthetic
from pipeline import cli, report
from pipeline.commands import train, train_config
from tests import support
from tff_algorithms.algorithms.fdml import privacy as fdml_privacy
from tff_algorithms.algorithms.fdml import protocol as fdml
from tff_algorithms.algorithms.fdml import run as fdml_run
from tff_algorithms.algorithms.fdml import training as fdml_training
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.jobs import train_job
from tff_algorithms.privacy import accounting, accounting_spec, budget

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

TRAIN_IDENTITIES = support.SMALL_JOB_TRAIN_IDENTITIES  # one user each, 6 images
# Two groups of two users a round, four images each.
CONFIG = job_config.TrainJobConfig(
    algorithm=job_config.FDML,
    rounds=2,
    noise_multiplier=1.0,
    clip_norm=1.0,
    users_per_virtual_client=2,
    virtual_clients_per_round=2,
    settings={"samples_per_user": 4, "derivative_clip": 0.5},
    server_learning_rate=0.01,
    embedding_size=16,
    evaluate_every=1,
    seed=1,
    noise_seed=7,
    testing_fixed_noise=True,
)
DELTA = TRAIN_IDENTITIES**-1.1


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.small_job_inputs(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def straight_run(data, tmp_path_factory):
    return train_job.run_train_job(CONFIG, *data, str(tmp_path_factory.mktemp("straight")))


def _cli_lines(capsys, *args: str) -> tuple[int, list[str], str]:
    code = cli.main(["dp-fedemb", *args])
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()], captured.out


def test_job_writes_metrics_ledger_and_saved_model(straight_run):
    summary = straight_run.metrics
    assert summary["algorithm"] == "fdml" and summary["rounds"] == 2
    assert summary["private"] is True and "FDML" in summary["privacy"]
    assert set(summary["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    # The paper's EER accuracy on the held-out identities (6 images each: split 2/1/1).
    eer = summary["eer_accuracy"]
    assert 0 <= eer["accuracy"] <= 1 and 0 <= eer["balanced_accuracy"] <= 1
    assert eer["split"] == {"template": 2, "threshold": 1, "test": 1}
    assert eer["paper_split"] is False
    ledger = json.loads(open(straight_run.ledger_path).read())
    assert ledger["spec"]["mechanism"] == accounting_spec.Mechanism.FDML.value
    assert [e["round"] for e in ledger["history"]] == [1, 2]
    assert os.path.exists(os.path.join(straight_run.saved_model_dir, "saved_model.pb"))
    # Nothing the server computed on training data without noise is recorded.
    for record in summary["history"]:
        assert not set(record) & set(fdml.UNPRIVATE_METRICS)
        assert record["applied"] == 1 and record["selected"] == 4


def test_report_shows_the_eer_accuracy(straight_run):
    note = report.eer_note(straight_run.metrics)
    accuracy = straight_run.metrics["eer_accuracy"]["accuracy"]
    assert "Alg. 4" in note and f"{accuracy:.4f}" in note and "smaller split" in note
    assert report.eer_note({"recall_at_far": {}}) == ""


def test_epsilon_equals_the_privacy_command_and_fdml_privacy(straight_run, capsys):
    summary = straight_run.metrics
    code, _, out = _cli_lines(
        capsys,
        "privacy",
        "--mechanism=fdml",
        f"--users={TRAIN_IDENTITIES}",
        "--users-per-round=4",
        "--rounds=2",
        "--noise-multiplier=1.0",
        f"--delta={DELTA!r}",
        "--json",
    )
    assert code == 0
    assert summary["epsilon"] == pytest.approx(json.loads(out)["epsilon"], rel=1e-12)
    # The noise the process adds, accounted by fdml_privacy's own two-release events.
    process_config = fdml_training.fdml_config(CONFIG, noise_seed=0)
    spec = fdml_run.privacy_spec(
        process_config, population=TRAIN_IDENTITIES, selected_per_round=4, rounds=2
    )
    # fdml_privacy's events go to dp_accounting's RDP: the job's RDP cross-check; its
    # (default) tight PLD epsilon is below it.
    rdp = fdml_privacy.compute_epsilon(spec, DELTA)
    assert summary["epsilon_rdp"] == pytest.approx(rdp, rel=1e-9)
    assert summary["epsilon"] < rdp


def test_too_few_users_with_s_images_is_refused_before_any_round(data, tmp_path):
    # Every user holds 6 images: none can fill 7 rows.
    with pytest.raises(ValueError, match="only 0 users hold samples_per_user=7") as e:
        train_job.run_train_job(
            dataclasses.replace(CONFIG, settings={"samples_per_user": 7}),
            *data,
            str(tmp_path / "out"),
        )
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out")


def test_train_command_refuses_too_few_users_in_one_line(tmp_path, capsys):
    images = str(tmp_path / "images")
    synthetic.write_image_folder(images, support.TRAIN_CLI_DATA)
    code, lines, _ = _cli_lines(
        capsys,
        "train",
        "--data",
        images,
        "--output",
        str(tmp_path / "out"),
        "--algorithm=fdml",
        "--rounds=1",
        "--fdml-users-per-group=2",
        "--fdml-groups-per-round=2",
        "--fdml-samples-per-user=7",
        "--noise-multiplier=1",
    )
    assert code != 0
    assert len(lines) == 1 and "hold samples_per_user=7 images" in lines[0], lines


def test_train_flags_set_the_fdml_fields():
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(
        [
            "dp-fedemb train",
            "--algorithm=fdml",
            "--fdml-samples-per-user=5",
            "--fdml-derivative-clip=0.3",
            "--fdml-derivative-noise-share=0.25",
            "--fdml-triplet-strategy=semi_hard",
            "--fdml-triplet-margin=0.4",
            "--fdml-groups-per-round=3",
            "--fdml-users-per-group=2",
        ]
    )
    config = train_config.job_config({name: flag_values[name].value for name in flag_values})
    assert config.algorithm == "fdml"
    settings = config.settings
    assert (settings.samples_per_user, settings.derivative_clip) == (5, 0.3)
    assert (settings.derivative_noise_share, settings.triplet_strategy) == (0.25, "semi_hard")
    assert settings.triplet_margin == 0.4
    # The triplet groups set the shared schedule's counts.
    assert (config.virtual_clients_per_round, config.users_per_virtual_client) == (3, 2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"settings": {"samples_per_user": 1}}, "fdml.samples_per_user"),
        ({"settings": {"derivative_noise_share": 1.0}}, "fdml.derivative_noise_share"),
        ({"settings": {"derivative_clip": 0.0}}, "fdml.derivative_clip"),
        ({"settings": {"triplet_strategy": "hardest"}}, "fdml.triplet_strategy must be one of"),
        ({"failure_injection_rate": 0.1}, "failure_injection_rate applies to DP-FedEmb"),
    ],
)
def test_config_refusals_are_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as e:
        dataclasses.replace(CONFIG, **changes)
    assert "\n" not in str(e.value)


def test_an_unreachable_target_epsilon_names_the_triplet_groups():
    # fdml's virtual_clients_per_round counts triplet groups: the refusal says so.
    config = dataclasses.replace(CONFIG, noise_multiplier=None, target_epsilon=0.05, delta=1e-5)
    with pytest.raises(ValueError, match="above the 2 triplet groups per round;") as e:
        config.calibrated_for(TRAIN_IDENTITIES)
    assert "virtual clients" not in str(e.value) and "\n" not in str(e.value)


def test_other_algorithms_records_do_not_change():
    # Jobs recorded before fdml's section existed still resume (train_job.json compares).
    assert "fdml" not in support.SMALL_JOB.to_dict()
    fdml = CONFIG.to_dict()["fdml"]
    assert (fdml["groups_per_round"], fdml["users_per_group"], fdml["samples_per_user"]) == (
        2,
        2,
        4,
    )
    assert "virtual_clients_per_round" not in CONFIG.to_dict()


def test_budget_and_the_accountant_refuse_the_paper_convention(tmp_path, capsys):
    paper = accounting_spec.AccountingSpec(
        TRAIN_IDENTITIES, 4, 2, 1.0, DELTA, mechanism="fdml", convention="paper"
    )
    policy = budget.BudgetPolicy(str(tmp_path / "budget.json"), total_epsilon=100.0)
    with pytest.raises(ValueError, match="paper-convention run cannot count") as e:
        budget.charge_run(policy, "f" * 64, TRAIN_IDENTITIES, "run", paper)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="Theorem V.1, per sample and per round"):
        accounting.compute_privacy(paper)
    paper_flags = [
        "privacy",
        "--mechanism=fdml",
        "--convention=paper",
        "--users=32",
        "--users-per-round=4",
        "--rounds=2",
        "--delta=1e-5",
    ]
    code, lines, _ = _cli_lines(capsys, *paper_flags, "--noise-multiplier=1")
    assert code != 0 and len(lines) == 1 and "needs --derivative-bound" in lines[0], lines


THEOREM_V1_FLAGS = [
    "privacy",
    "--mechanism=fdml",
    "--convention=paper",
    "--users=32",
    "--users-per-round=4",
    "--rounds=2",
    "--delta=1e-5",
    "--embedding-drop-rate=0.5",
    "--derivative-bound=1",
    "--laplace-scale=2",
]


def test_privacy_command_shows_theorem_v1_labelled_as_a_comparison(capsys):
    code, _, out = _cli_lines(capsys, *THEOREM_V1_FLAGS, "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["user_level"] is False and shown["per"] == "sample and round"
    assert shown["analysis"] == fdml_privacy.PAPER_THEOREM_V1_LABEL
    # ln[(1 - r) e^{2T/b} + r] with r = 0.5, T = 1, b = 2.
    assert shown["epsilon"] == pytest.approx(np.log(0.5 * np.e + 0.5))
    code, _, out = _cli_lines(capsys, *THEOREM_V1_FLAGS)
    assert code == 0 and "PER SAMPLE AND PER ROUND" in out and "not a user-level" in out


def test_budget_charges_and_target_epsilon_calibrates_the_strict_fdml_spec(straight_run, tmp_path):
    spec = job_plan.accounting_spec_for(CONFIG, TRAIN_IDENTITIES)
    policy = budget.BudgetPolicy(str(tmp_path / "budget.json"), total_epsilon=100.0)
    charge = budget.charge_run(policy, "f" * 64, TRAIN_IDENTITIES, "run", spec)
    assert charge.to_dict()["run_epsilon"] == pytest.approx(straight_run.metrics["epsilon"])
    target = dataclasses.replace(CONFIG, noise_multiplier=None, target_epsilon=2.0)
    calibrated, source = target.calibrated_for(TRAIN_IDENTITIES)
    assert source["source"] == "calibrated"
    epsilon = accounting.compute_privacy(
        job_plan.accounting_spec_for(calibrated, TRAIN_IDENTITIES)
    ).epsilon
    assert 2.0 * (1 - 1e-2) <= epsilon <= 2.0


def _flat_layout(config: dict) -> dict:
    """A job config as the release before sections recorded it: fdml's settings flat,
    its triplet groups in the shared schedule's keys."""
    config = dict(config)
    section = config.pop("fdml")
    config["virtual_clients_per_round"] = section.pop("groups_per_round")
    config["users_per_virtual_client"] = section.pop("users_per_group")
    return {**config, **section}


def _rewrite_config(path: str, layout) -> None:  # noqa: ANN001 - a dict -> dict
    with open(path) as f:
        record = json.load(f)
    record["config"] = layout(record["config"])
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)


def _old_release_copy(straight_run, root: str, layout=_flat_layout) -> str:  # noqa: ANN001
    """The finished job's output directory as the release before left it (flat keys
    in train_job.json and metrics.json)."""
    shutil.copytree(straight_run.output_dir, root)
    _rewrite_config(os.path.join(root, job_files.JOB_FILE), layout)
    _rewrite_config(os.path.join(root, job_files.METRICS_FILE), layout)
    return root


def test_a_finished_job_of_the_release_before_is_finished_and_rewritten_not(
    data, straight_run, tmp_path
):
    output = _old_release_copy(straight_run, str(tmp_path / "old"))
    assert "virtual_clients_per_round" in open(os.path.join(output, job_files.JOB_FILE)).read()
    before = support.files_with_times(output)
    again = train_job.run_train_job(CONFIG, *data, output)
    assert again.already_finished
    assert support.files_with_times(output) == before


def test_a_job_of_the_release_before_with_other_settings_is_refused_naming_them(
    data, straight_run, tmp_path
):
    def three_groups(config: dict) -> dict:
        return {**_flat_layout(config), "virtual_clients_per_round": 3}

    output = _old_release_copy(straight_run, str(tmp_path / "old"), three_groups)
    with pytest.raises(
        ValueError, match=r"holds a training job with different fdml.groups_per_round;"
    ) as e:
        train_job.run_train_job(CONFIG, *data, output)
    assert "\n" not in str(e.value)

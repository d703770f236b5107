"""Each algorithm's own settings in its own section (issue 39, item 3; issue 64, item 4):
`dp_fedemb`, `fdml`, `logit_dp`, `dp_sgd`, declared by the registry and read through it by the job config,
the pipeline config and `dp-fedemb train`; the flat keys and flags of the release
before accepted with one deprecation line, refused when they disagree with the new
ones. Fast: no training (old output directories: tests/tff_algorithms/algorithms/fdml/test_fdml_job.py)."""

import dataclasses

import pytest

from pipeline import cli
from pipeline import config as config_lib
from pipeline.commands import train, train_config
from tff_algorithms import algorithms
from tff_algorithms.algorithms.fdml import fields as fdml_fields
from tff_algorithms.config import job_config

FDML = job_config.FDML
LOGIT_DP = job_config.LOGIT_DP
DP_SGD = job_config.DP_SGD_CENTRALIZED
DP_FTRL = job_config.DP_FTRL_FEDEMB


@pytest.fixture(autouse=True)
def fresh_deprecations(monkeypatch):
    # The pipeline shows each deprecation line once a process; each test is one command.
    monkeypatch.setattr(config_lib, "_SHOWN_DEPRECATIONS", set())


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_registry_declares_each_section_and_its_users():
    sections = algorithms.registry.sections()
    assert set(sections) == {"dp_fedemb", "fdml", "logit_dp", "dp_sgd"}
    assert algorithms.registry.section_users("dp_sgd") == (DP_SGD, job_config.DP_LAST_LAYER)
    assert algorithms.registry.section_users("dp_fedemb") == (
        job_config.DP_FEDEMB,
        job_config.DP_FEDAVG,
        DP_FTRL,
    )
    assert sections["fdml"].keys()[:2] == ("groups_per_round", "users_per_group")
    assert algorithms.get(job_config.CENTRALIZED).section is None


@pytest.mark.parametrize(
    "algorithm, section, counts",
    [
        (FDML, {"groups_per_round": 3, "users_per_group": 2, "samples_per_user": 4}, (2, 3)),
        (LOGIT_DP, {"users_per_step": 20, "scale": 0.5}, (1, 20)),
        (DP_SGD, {"users_per_step": 40}, (1, 40)),
        (DP_FTRL, {"restart_every_epoch": True, "max_local_steps": 5}, (8, 32)),
    ],
)
def test_a_section_sets_the_settings_and_the_schedule_counts_and_is_recorded(
    algorithm, section, counts
):
    name = algorithms.get(algorithm).section.name
    config = job_config.TrainJobConfig.from_dict(
        {"algorithm": algorithm, "noise_multiplier": 1.0, name: section}
    )
    assert (config.users_per_virtual_client, config.virtual_clients_per_round) == counts
    record = config.to_dict()
    assert {k: record[name][k] for k in section} == section
    # The schedule's counts are recorded in the algorithm's words only (the DP-FedEmb
    # family's words for them are the shared ones: virtual clients).
    if algorithms.get(algorithm).section.shape:
        assert not {"users_per_virtual_client", "virtual_clients_per_round"} & set(record)
    assert job_config.TrainJobConfig.from_dict(record) == config


@pytest.mark.parametrize(
    "algorithm, section, message",
    [
        (FDML, {"samples_per_user": 1}, "fdml.samples_per_user must be >= 2, got 1"),
        (FDML, {"triplet_strategy": "hardest"}, "fdml.triplet_strategy must be one of"),
        (FDML, {"group_per_round": 3}, "unknown setting fdml.group_per_round (did you mean"),
        (LOGIT_DP, {"scale": 0}, "logit_dp.scale must be finite and in (0, 100)"),
        (LOGIT_DP, {"users_per_step": 8}, "(logit_dp.users_per_step): Logit-DP sensitivity"),
        (LOGIT_DP, {"optimizer": "nadam"}, "logit_dp.optimizer must be one of sgd, adam, lamb"),
        (LOGIT_DP, {"adam_epsilon": 0}, "logit_dp.adam_epsilon must be finite and in (0, 1)"),
        (LOGIT_DP, {"weight_decay": 0.1}, "logit_dp.weight_decay applies to the adam and lamb"),
        (DP_SGD, {"optimizer": "lamb", "adam_beta1": -0.1}, "dp_sgd.adam_beta1 must be finite"),
        (DP_SGD, {"users_per_step": 0}, "virtual_clients_per_round must be >= 1"),
        (DP_FTRL, {"max_client_seconds": -1}, "dp_fedemb.max_client_seconds must be finite"),
        (
            job_config.DP_FEDAVG,
            {"restart_every_epoch": True},
            "dp_fedemb.restart_every_epoch applies only to dp-ftrl-fedemb, not dp-fedavg",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(algorithm, section, message):
    name = algorithms.get(algorithm).section.name
    with pytest.raises(ValueError) as e:
        job_config.TrainJobConfig.from_dict(
            {"algorithm": algorithm, "noise_multiplier": 1.0, name: section}
        )
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_job_is_checked_by_its_own_algorithms_rules_only(monkeypatch):
    checked = []
    original = fdml_fields.FdmlSettings.__post_init__

    def counted(settings):  # noqa: ANN001, ANN202
        checked.append(settings)
        original(settings)

    monkeypatch.setattr(fdml_fields.FdmlSettings, "__post_init__", counted)
    for algorithm in (job_config.DP_FEDEMB, job_config.CENTRALIZED, DP_SGD, DP_FTRL):
        config = job_config.TrainJobConfig(algorithm=algorithm, users_per_virtual_client=1)
        assert config.settings is None or not isinstance(config.settings, fdml_fields.FdmlSettings)
    assert checked == []
    job_config.TrainJobConfig(algorithm=FDML)
    assert len(checked) == 1
    # Settings are refused for an algorithm without a section, not ignored.
    with pytest.raises(ValueError, match="centralized has no settings of its own") as e:
        job_config.TrainJobConfig(algorithm=job_config.CENTRALIZED, settings={"seed": 4})
    assert "\n" not in str(e.value)


def test_another_algorithm_s_default_section_is_dropped_and_a_set_one_refused():
    # `dataclasses.replace(job, algorithm=...)` carries the job's section along.
    federated = job_config.TrainJobConfig()
    assert dataclasses.replace(federated, algorithm=job_config.CENTRALIZED).settings is None
    assert dataclasses.replace(federated, algorithm=FDML).settings == fdml_fields.FdmlSettings()
    restarting = job_config.TrainJobConfig(
        algorithm=DP_FTRL, settings={"restart_every_epoch": True}
    )
    with pytest.raises(ValueError) as e:
        dataclasses.replace(restarting, algorithm=job_config.CENTRALIZED)
    assert "settings hold dp_fedemb.restart_every_epoch" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_record_of_the_release_before_reads_as_the_same_job():
    config = job_config.TrainJobConfig(
        algorithm=LOGIT_DP,
        users_per_virtual_client=1,
        virtual_clients_per_round=20,
        noise_multiplier=1.0,
        settings={"scale": 0.5},
    )
    record = config.to_dict()
    flat = {k: v for k, v in record.items() if k != "logit_dp"}
    flat.update(users_per_virtual_client=1, virtual_clients_per_round=20, logit_scale=0.5)
    assert job_config.current_layout(flat) == record
    assert job_config.TrainJobConfig.from_dict(flat) == config
    # A section recorded before its optimizer keys existed (issue 42) is the same job.
    dp_sgd = job_config.TrainJobConfig.from_dict({"algorithm": DP_SGD, "noise_multiplier": 1.0})
    record = dp_sgd.to_dict()
    before = {**record, "dp_sgd": {"users_per_step": record["dp_sgd"]["users_per_step"]}}
    assert job_config.current_layout(before) == record


@pytest.mark.parametrize("algorithm", [job_config.DP_FEDEMB, DP_FTRL, LOGIT_DP, FDML])
def test_a_flat_record_of_the_dp_fedemb_family_s_settings_reads_as_the_same_job(algorithm):
    # Every record before the `dp_fedemb` section held these flat keys, whatever its
    # algorithm: the family's jobs read them as their section, the others drop them.
    config = job_config.TrainJobConfig.from_dict({"algorithm": algorithm, "noise_multiplier": 1.0})
    if algorithm == DP_FTRL:
        config = dataclasses.replace(config, settings={"restart_every_epoch": True})
    record = config.to_dict()
    own = record.get("dp_fedemb", {"restart_every_epoch": False})
    flat = {k: v for k, v in record.items() if k != "dp_fedemb"}
    flat.update(
        restart_every_epoch=own["restart_every_epoch"],
        max_local_steps=None,
        max_client_seconds=None,
    )
    assert job_config.current_layout(flat) == record
    assert job_config.TrainJobConfig.from_dict(flat) == config


# The pipeline's config file.


def test_a_pipeline_section_sets_fdml_and_the_old_keys_give_one_line_each(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(
        "train:\n  algorithm: fdml\n  virtual_clients_per_round: 4\n  samples_per_user: 3\n"
    )
    # A command reads its config twice (quick checks, then everything): one line each.
    config_lib.check_config(str(path))
    job = config_lib.load_config(str(path)).train_job_dict()
    lines = _stderr_lines(capsys)
    assert lines == [
        "dp-fedemb: warning: config train.virtual_clients_per_round is deprecated for fdml: "
        "use train.fdml.groups_per_round (the old name is refused after release 0.1.0)",
        "dp-fedemb: warning: config train.samples_per_user is deprecated for fdml: use "
        "train.fdml.samples_per_user (the old name is refused after release 0.1.0)",
    ]
    # The same job as the new keys give; the recipe's users per virtual client are fdml's
    # users per group, as before.
    new = config_lib.load_config(
        None, ["train.algorithm=fdml", "train.fdml={groups_per_round: 4, samples_per_user: 3}"]
    )
    assert new.train_job_dict() == job
    assert (job["fdml"]["groups_per_round"], job["fdml"]["users_per_group"]) == (4, 8)
    assert _stderr_lines(capsys) == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "train.algorithm=fdml",
                "train.virtual_clients_per_round=4",
                "train.fdml.groups_per_round=5",
            ],
            "config train.virtual_clients_per_round 4 and train.fdml.groups_per_round 5 "
            "disagree: give train.fdml.groups_per_round alone",
        ),
        (
            ["train.samples_per_user=4"],
            "config train.samples_per_user is a setting of fdml (now train.fdml.samples_per_user), "
            "not of dp-fedemb: drop it",
        ),
        (
            ["train.fdml.groups_per_round=4"],
            "config train.fdml holds the settings of fdml, not of dp-fedemb: drop it",
        ),
        (
            ["train.algorithm=fdml", "train.fdml.groups=4"],
            "unknown config key train.fdml.groups (did you mean groups_per_round?",
        ),
        (
            ["pretrain.source=private_contrastive", "pretrain.job.users_per_virtual_client=2"],
            "config pretrain.job.users_per_virtual_client does not apply to logit-dp",
        ),
    ],
)
def test_pipeline_section_errors_are_one_line(overrides, message, capsys):
    with pytest.raises(ValueError) as e:
        config_lib.check_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not [line for line in _stderr_lines(capsys) if "deprecated" in line]


def test_the_pretraining_job_reads_logit_dp_s_section(capsys):
    config = config_lib.load_config(
        None,
        [
            "pretrain.source=private_contrastive",
            "pretrain.job.logit_dp.users_per_step=40",
            "pretrain.job.logit_scale=0.5",
        ],
    )
    job = config.pretrain_job_dict()
    assert job["logit_dp"]["users_per_step"] == 40 and job["logit_dp"]["scale"] == 0.5
    assert job["logit_dp"]["optimizer"] == "sgd"
    assert _stderr_lines(capsys) == [
        "dp-fedemb: warning: config pretrain.job.logit_scale is deprecated for logit-dp: use "
        "pretrain.job.logit_dp.scale (the old name is refused after release 0.1.0)"
    ]


# `dp-fedemb train`.


def _train_lines(capsys, tmp_path, *flags: str) -> tuple[int, list[str]]:
    # A missing --data stops the command after its flags are checked: nothing trains.
    code = cli.main(
        [
            "dp-fedemb",
            "train",
            "--data",
            str(tmp_path / "missing"),
            "--output",
            str(tmp_path / "o"),
            *flags,
        ]
    )
    return code, _stderr_lines(capsys)


def test_the_old_tree_restart_flag_gives_one_deprecation_line_and_the_same_job(tmp_path, capsys):
    code, lines = _train_lines(capsys, tmp_path, f"--algorithm={DP_FTRL}", "--restart-every-epoch")
    assert code != 0
    assert lines == [
        f"dp-fedemb train: warning: --restart-every-epoch is deprecated for {DP_FTRL}: use "
        "--dp-fedemb-restart-every-epoch (the old name is refused after release 0.1.0)",
        f"dp-fedemb train: error: --data {tmp_path / 'missing'} does not exist",
    ]
    old = _flag_job(f"--algorithm={DP_FTRL}", "--restart-every-epoch")
    assert old == _flag_job(f"--algorithm={DP_FTRL}", "--dp-fedemb-restart-every-epoch")
    assert old.settings.restart_every_epoch


def test_an_old_flag_gives_one_deprecation_line(tmp_path, capsys):
    code, lines = _train_lines(
        capsys,
        tmp_path,
        "--algorithm=logit-dp",
        "--virtual-clients-per-round=20",
        "--logit-scale=0.5",
    )
    assert code != 0
    assert lines == [
        "dp-fedemb train: warning: --virtual-clients-per-round is deprecated for logit-dp: use "
        "--logit-dp-users-per-step (the old name is refused after release 0.1.0)",
        "dp-fedemb train: warning: --logit-scale is deprecated for logit-dp: use "
        "--logit-dp-scale (the old name is refused after release 0.1.0)",
        f"dp-fedemb train: error: --data {tmp_path / 'missing'} does not exist",
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--algorithm=dp-sgd-centralized",
                "--virtual-clients-per-round=20",
                "--dp-sgd-users-per-step=30",
            ],
            "--virtual-clients-per-round 20 and --dp-sgd-users-per-step 30 disagree: give "
            "--dp-sgd-users-per-step alone",
        ),
        (
            ["--triplet-margin=0.3"],
            "--triplet-margin is a setting of fdml (now --fdml-triplet-margin), not of dp-fedemb",
        ),
        (["--algorithm=fdml", "--fdml-samples-per-user=1"], "fdml.samples_per_user must be >= 2"),
    ],
)
def test_flag_errors_are_one_line(tmp_path, capsys, flags, message):
    code, lines = _train_lines(capsys, tmp_path, *flags)
    assert code != 0 and len(lines) == 1 and message in lines[0], lines


def _flag_job(*args: str) -> job_config.TrainJobConfig:
    from absl import flags as absl_flags

    flag_values = absl_flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(["dp-fedemb train", *args])
    return train_config.job_config({name: flag_values[name].value for name in flag_values})


def test_old_and_new_flags_give_the_same_job_and_recipes_keep_their_counts():
    old = _flag_job("--algorithm=fdml", "--virtual-clients-per-round=5", "--derivative-clip=0.3")
    new = _flag_job("--algorithm=fdml", "--fdml-groups-per-round=5", "--fdml-derivative-clip=0.3")
    assert old == new and new.virtual_clients_per_round == 5
    assert new.settings == dataclasses.replace(fdml_fields.FdmlSettings(), derivative_clip=0.3)
    # What each algorithm started from before: the recipe's counts, its own recipe's.
    assert _flag_job("--algorithm=fdml").virtual_clients_per_round == 48
    assert _flag_job("--algorithm=fdml", "--recipe=paper").virtual_clients_per_round == 32
    assert _flag_job("--algorithm=logit-dp").virtual_clients_per_round == 32
    assert _flag_job("--algorithm=dp-last-layer").virtual_clients_per_round == 1024
    assert (
        _flag_job("--algorithm=dp-sgd-centralized").settings
        == algorithms.user_dp_sgd.DpSgdSettings()
    )


def test_help_lists_each_section_s_flags_with_their_defaults():
    defaults = train.help_defaults()
    assert defaults["fdml-groups-per-round"] == (
        "48 (fdml --recipe=default), 32 (fdml --recipe=paper)"
    )
    assert defaults["dp-sgd-users-per-step"].startswith("256 (dp-sgd-centralized --recipe=default")
    assert defaults["logit-dp-scale"] == "1.0"


def test_a_section_name_is_one_set_of_settings():
    @dataclasses.dataclass(frozen=True)
    class Other:
        pass

    spec = dataclasses.replace(
        algorithms.get(FDML), name="fdml-copy", section=algorithms.registry.Section("fdml", Other)
    )
    with pytest.raises(ValueError, match="section 'fdml' is another algorithm's") as e:
        algorithms.register(spec)
    assert "\n" not in str(e.value) and algorithms.find("fdml-copy") is None


def test_a_schedule_the_users_cannot_fill_is_named_in_the_section_s_words():
    config = job_config.TrainJobConfig.from_dict(
        {"algorithm": DP_SGD, "noise_multiplier": 1.0, "dp_sgd": {"users_per_step": 20}}
    )
    with pytest.raises(ValueError) as e:
        config.calibrated_for(5)
    assert "set dp_sgd.users_per_step to at most 5 (or auto)" in str(e.value)
    assert "virtual_clients_per_round" not in str(e.value) and "\n" not in str(e.value)

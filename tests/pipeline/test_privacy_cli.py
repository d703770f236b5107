"""Tests of `dp-fedemb privacy` through the installed console script (docs/design.md section 6)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli

DP_FEDEMB = str(Path(sys.executable).parent / "dp-fedemb")
TABLE1 = ["--users", "10000000", "--users-per-round", "131072", "--rounds", "800"]


def privacy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DP_FEDEMB, "privacy", *args], capture_output=True, text=True, timeout=120
    )


def test_json_reproduces_table1_dp_fedemb_only_under_the_paper_convention():
    table1 = (*TABLE1, "--noise-multiplier", "1.28", "--delta", "1e-7", "--json")
    done = privacy(*table1, "--convention", "paper")
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.strip().splitlines()  # exactly one JSON object
    output = json.loads(line)
    assert round(output["epsilon"], 2) == 3.90
    assert output["delta"] == 1e-7
    assert output["zcdp_rho"] is None
    assert output["sampling"] == "uniform" and output["neighboring_relation"] == "replace_one"
    assert output["convention"] == "paper" and output["sensitivity_in_clips"] == 1.0
    # The default is strict: the same schedule under the 2 x clip sensitivity, accounted
    # with the tight PLD of fixed-size sampling, RDP's value beside it as a cross-check.
    strict = json.loads(privacy(*table1).stdout)
    assert strict["convention"] == "strict" and strict["sensitivity_in_clips"] == 2.0
    assert strict["accountant"] == "pld" and round(strict["epsilon"], 2) == 10.40
    assert round(strict["epsilon_rdp"], 2) == 14.50
    rdp = json.loads(privacy(*table1, "--accountant", "rdp").stdout)
    assert rdp["accountant"] == "rdp" and round(rdp["epsilon"], 2) == 14.50
    assert rdp["epsilon_rdp"] is None


def test_human_summary():
    done = privacy(
        *TABLE1, "--noise-multiplier", "0.96", "--delta", "1e-7", "--convention", "paper"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("epsilon = 5.623 at delta = 1e-07")
    assert "PAPER CONVENTION" in done.stdout
    assert len(done.stdout.splitlines()) <= 4


def test_target_epsilon_calibrates():
    done = privacy(
        "--users", "9275", "--users-per-round", "128", "--rounds", "400", "--delta", "1e-4",
        "--users-per-virtual-client", "4", "--target-epsilon", "16.06", "--json",
        "--calibration-tolerance", "0.05", "--convention", "paper",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout)
    assert output["target_epsilon"] == 16.06
    assert output["epsilon"] <= 16.06
    assert 0.5 <= output["noise_multiplier"] <= 0.5 / (1 - 0.05)


def test_dpftrl_restart_reports_zcdp():
    done = privacy(
        "--users", "1000", "--users-per-round", "100", "--rounds", "40", "--delta", "1e-5",
        "--noise-multiplier", "4", "--mechanism", "dpftrl", "--users-per-virtual-client", "2",
        "--restart-every-epoch", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    output = json.loads(done.stdout)
    # 4 epochs of 10 rounds, depth 4 each; virtual clients halve z to 2.
    assert output["zcdp_rho"] == pytest.approx(16 / (2 * 2.0**2))
    assert output["effective_noise_multiplier"] == 2.0
    assert output["epsilon"] > 0


def test_dpftrl_without_restart_in_process(capsys):
    # In-process: this analysis imports TensorFlow (via TF Privacy), which the accounting
    # tests have usually loaded already; a subprocess would pay for it again.
    argv = ["dp-fedemb", "privacy", "--users", "100", "--users-per-round", "10", "--rounds",
            "35", "--delta", "1e-5", "--noise-multiplier", "2", "--mechanism", "dpftrl",
            "--users-per-virtual-client", "2", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["zcdp_rho"] > 0 and output["epsilon"] > 0
    assert output["restart_every_epoch"] is False


@pytest.mark.parametrize(
    "overrides, extra, message",
    [
        ({"--users-per-round": "200"}, ["--noise-multiplier", "1"], "exceeds the population"),
        ({}, ["--noise-multiplier", "-1"], "non-negative"),
        ({"--delta": "1"}, ["--noise-multiplier", "1"], "--delta must be in [1e-100, 1)"),
        ({}, ["--noise-multiplier", "1e308"], "--noise-multiplier must be in [0, 1e+06]"),
        ({}, ["--target-epsilon", "1e300"], "--target-epsilon must be in (0, 100]"),
        ({"--rounds": "1000000001"}, ["--noise-multiplier", "1"], "--rounds must be in"),
        ({}, ["--noise-multiplier", "nan"], "finite"),
        ({}, ["--noise-multiplier", "1", "--target-epsilon", "2"], "exactly one of"),
        ({}, [], "exactly one of"),
        ({}, ["--noise-multiplier", "0.01", "--accountant", "pld"], "use the RDP accountant"),
        ({}, ["--noise-multiplier", "1", "--restart-every-epoch"], "only to the dpftrl"),
        ({}, ["--noise-multiplier", "1", "--mechanism", "sgd"], "--mechanism"),
        ({"--delta": None}, ["--noise-multiplier", "1"], "--delta"),
    ],
)
def test_nonsense_input_is_one_error_line(overrides, extra, message):
    flags = {"--users": "100", "--users-per-round": "10", "--rounds": "5", "--delta": "1e-5"}
    flags.update(overrides)
    argv = [item for flag, value in flags.items() if value is not None for item in (flag, value)]
    done = privacy(*argv, *extra)
    assert done.returncode != 0
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("dp-fedemb privacy: error:") and message in line

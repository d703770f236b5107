"""Unpredictable noise: production runs draw the noise seed from OS entropy.

A fixed noise seed is accepted only behind the explicit testing flag, in the library,
the `dp-fedemb train` flags and the pipeline config alike.
"""

import dataclasses
import json

import numpy as np
import pytest

from beam_jobs import synthetic
from pipeline import cli
from pipeline import config as config_lib
from tests import support
from tff_algorithms.config import job_config, loop_schedule
from tff_algorithms.jobs import train_job

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=8)
# Production noise. The schedule is fixed (its own testing flag, tests/pipeline/test_seed_secrecy.py)
# so that runs can differ by their noise only.
PRODUCTION = job_config.TrainJobConfig(
    rounds=1,
    noise_multiplier=1.0,
    users_per_virtual_client=2,
    virtual_clients_per_round=2,
    batch_size=8,
    head_capacity=4,
    embedding_size=16,
    evaluate_every=0,
    schedule_seed=0,
    testing_fixed_schedule=True,
)
TESTING = dataclasses.replace(PRODUCTION, noise_seed=5, testing_fixed_noise=True)


def test_a_job_without_a_fixed_noise_seed_draws_a_fresh_one_each_start():
    seeds = {loop_schedule.job_noise_seed(None) for _ in range(4)}
    assert all(isinstance(s, int) and 0 <= s < 2**62 for s in seeds) and len(seeds) == 4
    assert loop_schedule.job_noise_seed(5) == 5


def test_a_fixed_noise_seed_needs_the_testing_flag():
    with pytest.raises(ValueError, match="for tests only") as refused:
        dataclasses.replace(PRODUCTION, noise_seed=5)
    assert "\n" not in str(refused.value)
    assert TESTING.noise_seed == 5
    # The flag alone fixes nothing: the seed still comes from OS entropy.
    assert dataclasses.replace(PRODUCTION, testing_fixed_noise=True).noise_seed is None
    with pytest.raises(ValueError, match="must be a boolean"):
        dataclasses.replace(PRODUCTION, testing_fixed_noise=1)


def test_pipeline_config_refuses_a_noise_seed_without_the_testing_flag():
    with pytest.raises(ValueError, match="config train: a fixed noise_seed") as refused:
        config_lib.load_config(overrides=["train.noise_seed=3"])
    assert "\n" not in str(refused.value)
    config = config_lib.load_config(
        overrides=["train.noise_seed=3", "train.testing_fixed_noise=true"]
    )
    assert config.train_job_dict()["noise_seed"] == 3


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--data", "/nonexistent", "--output", "/nonexistent/o", "--noise-seed=3"],
        ["run", "--set", "train.noise_seed=3"],
    ],
)
def test_command_line_refuses_a_noise_seed_without_the_testing_flag(capsys, args):
    code = cli.main(["dp-fedemb", *args])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code != 0
    assert len(lines) == 1 and "for tests only" in lines[0], lines


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("noise_data"), SYNTH, train_identities=20
    )


def _trained_backbone(config, data, output_dir) -> list[np.ndarray]:
    result = train_job.run_train_job(config, *data, output_dir)
    metrics = json.loads(open(result.metrics_path).read())
    expected_source = "os-entropy" if config.noise_seed is None else "fixed (testing)"
    assert metrics["noise_seed_source"] == expected_source
    assert "noise_seed" not in metrics["config"]
    return support.saved_backbone(result.saved_model_dir)


def test_production_runs_differ_and_testing_runs_with_one_seed_are_equal(
    tff_runtime, small_data, tmp_path
):
    # Everything but the noise is seeded identically (schedule, initialisation, heads),
    # so a difference between the production runs can only come from the noise.
    production = [
        _trained_backbone(PRODUCTION, small_data, str(tmp_path / f"production{i}"))
        for i in range(2)
    ]
    testing = [
        _trained_backbone(TESTING, small_data, str(tmp_path / f"testing{i}")) for i in range(2)
    ]
    for a, b in zip(*testing, strict=True):
        np.testing.assert_array_equal(a, b)
    differing = [not np.array_equal(a, b) for a, b in zip(*production, strict=True)]
    assert all(differing), "production runs share noise"
    # Noise at z=1 is large: each production run differs from the seeded one as much.
    assert not np.array_equal(production[0][0], testing[0][0])

"""Secret files (schedule seed, noise state, ledgers) are owner-only, replaced
atomically, and never written through a symlink planted at their path."""

import json
import os
import stat

import pytest

from beam_jobs import synthetic
from tests import support
from tff_algorithms.base import job_files, secret_files
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.jobs import train_job
from tff_algorithms.privacy import budget

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow
# The tests of the module's trained job on one xdist worker, so `trained` trains once
# (tests/conftest.py spreads slow tests one by one).
ON_TRAINED = pytest.mark.xdist_group("secret_files_trained")

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=9)
TRAIN_IDENTITIES = 18
CONFIG = job_config.TrainJobConfig(
    algorithm=job_config.DP_FEDEMB,
    rounds=2,
    noise_multiplier=0.5,
    clip_norm=1.0,
    users_per_virtual_client=2,
    virtual_clients_per_round=2,
    client_learning_rate=0.05,
    server_learning_rate=1.0,
    head_lr_scale=10.0,
    batch_size=8,
    embedding_size=16,
    evaluate_every=0,
    seed=1,
)
PRECIOUS = "someone else's file\n"


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


@pytest.fixture(scope="module")
def trained(tff_runtime, data, tmp_path_factory):
    """A real two-round job charged to a budget ledger in a directory not yet there."""
    root = tmp_path_factory.mktemp("job")
    output_dir, ledger_path = str(root / "out"), str(root / "budget" / "budget.json")
    policy = budget.BudgetPolicy(ledger_path=ledger_path, total_epsilon=1e6)
    train_job.run_train_job(CONFIG, *data, output_dir, budget=policy)
    return output_dir, ledger_path


@ON_TRAINED
def test_a_training_job_leaves_its_secrets_owner_only(trained):
    output_dir, budget_ledger = trained
    checkpoints = os.path.join(output_dir, job_files.CHECKPOINT_DIR)
    for directory in (output_dir, checkpoints, os.path.dirname(budget_ledger)):
        assert _mode(directory) == 0o700, directory
    for name in (job_files.JOB_FILE, job_files.LEDGER_FILE, job_files.METRICS_FILE):
        assert _mode(os.path.join(output_dir, name)) == 0o600, name
    assert _mode(budget_ledger) == _mode(f"{budget_ledger}.lock") == 0o600
    assert json.loads(open(budget_ledger).read())["datasets"], "the run was not charged"
    # No temporary file left next to the secrets.
    assert not [e for e in os.listdir(output_dir) if ".tmp-" in e]


@ON_TRAINED
def test_resuming_tightens_a_loosened_checkpoint_directory(tff_runtime, data, trained, tmp_path):
    output_dir, _ = trained
    checkpoints = os.path.join(output_dir, job_files.CHECKPOINT_DIR)
    os.chmod(checkpoints, 0o755)
    # The finished job re-run: it trains and writes nothing, but still tightens.
    train_job.run_train_job(CONFIG, *data, output_dir)
    assert _mode(checkpoints) == 0o700


def test_a_symlink_at_train_job_json_is_refused_and_its_target_untouched(
    tff_runtime, data, tmp_path
):
    target = tmp_path / "target.json"
    target.write_text(PRECIOUS)
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / job_files.JOB_FILE).symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        train_job.run_train_job(CONFIG, *data, str(output_dir))
    assert target.read_text() == PRECIOUS
    assert os.path.islink(output_dir / job_files.JOB_FILE)
    assert not (output_dir / job_files.CHECKPOINT_DIR).exists()


def test_a_symlink_at_the_budget_ledger_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "target.json"
    target.write_text(PRECIOUS)
    ledger_path = tmp_path / "budget.json"
    ledger_path.symlink_to(target)
    policy = budget.BudgetPolicy(ledger_path=str(ledger_path), total_epsilon=1e6)
    spec = job_plan.accounting_spec_for(CONFIG, TRAIN_IDENTITIES)
    with pytest.raises(ValueError, match="is a symbolic link"):
        budget.charge_run(policy, "f" * 64, TRAIN_IDENTITIES, "run-1", spec)
    assert target.read_text() == PRECIOUS


def test_a_symlink_at_the_lock_or_checkpoint_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.chmod(target, 0o755)
    (tmp_path / "checkpoints").symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        secret_files.private_dir(str(tmp_path / "checkpoints"), tighten_existing=True)
    (tmp_path / "budget.json.lock").symlink_to(target / "lock")
    with pytest.raises(ValueError, match="is a symbolic link"):
        secret_files.open_lock(str(tmp_path / "budget.json.lock"))
    assert os.listdir(target) == [] and _mode(target) == 0o755


def test_a_write_that_fails_midway_leaves_the_old_content(tmp_path):
    path = str(tmp_path / "ledger.json")
    secret_files.write_text(path, '{"old": true}')
    # A lone surrogate cannot be encoded: the write fails after the temporary file was
    # created and partly written, before the rename.
    with pytest.raises(UnicodeEncodeError):
        secret_files.write_text(path, '{"new": "' + "x" * 100_000 + '\udc80"}')
    assert open(path).read() == '{"old": true}'
    assert os.listdir(tmp_path) == ["ledger.json"]
    assert _mode(path) == 0o600

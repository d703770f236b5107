"""The training job: no head anywhere, outputs, refusals (resume: tests/tff_algorithms/jobs/test_crash_safety.py)."""

import collections
import dataclasses
import itertools
import json
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from tests import support
from tff_algorithms.base import job_files
from tff_algorithms.config import client_config, job_config, job_plan
from tff_algorithms.jobs import job_outputs, local_heads, train_job
from tff_algorithms.privacy import accounting, calibration

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow
# The tests of the module's trained job on one xdist worker, so `straight_run` trains
# once (tests/conftest.py spreads slow tests one by one).
ON_STRAIGHT_RUN = pytest.mark.xdist_group("train_job_straight_run")

SYNTH = support.TRAIN_CLI_DATA
TRAIN_IDENTITIES = support.SMALL_JOB_TRAIN_IDENTITIES  # identities 32..39 are held out
CONFIG = support.SMALL_JOB
HEAD_SHAPE = (CONFIG.embedding_size, CONFIG.head_capacity)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


@pytest.fixture(scope="module")
def straight_run(tff_runtime, data, tmp_path_factory):
    output_dir = str(tmp_path_factory.mktemp("straight"))
    return train_job.run_train_job(CONFIG, *data, output_dir)


@ON_STRAIGHT_RUN
def test_metrics_ledger_and_saved_model_are_written(straight_run):
    summary = json.loads(open(straight_run.metrics_path).read())
    assert set(summary["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert all(0.0 <= v <= 1.0 for v in summary["recall_at_far"].values())
    assert summary["rounds"] == 3 and summary["private"] is True
    assert summary["wall_seconds"] > 0
    # Epsilon is the accountant's for the planned schedule, at the documented default delta.
    spec = job_plan.accounting_spec_for(CONFIG, TRAIN_IDENTITIES)
    assert summary["delta"] == pytest.approx(TRAIN_IDENTITIES**-1.1)
    assert summary["epsilon"] == pytest.approx(accounting.compute_privacy(spec).epsilon)
    assert [r["round"] for r in summary["history"] if "eval" in r] == [0, 2, 3]
    # The schedule and noise seeds are never published.
    assert not {"schedule_seed", "noise_seed"} & set(summary["config"])
    assert summary["schedule_seed_source"] == "os-entropy"
    # What the held-out records are, by the split mode they were made by (the default).
    assert summary["evaluation"]["split_mode"] == "identity_and_user"
    assert summary["evaluation"]["held_out"] == (
        "held-out identities and their users, none of them in training"
    )
    ledger = json.loads(open(straight_run.ledger_path).read())
    assert [e["round"] for e in ledger["history"]] == [1, 2, 3]
    assert ledger["history"][-1]["epsilon"] == pytest.approx(summary["epsilon"])


@ON_STRAIGHT_RUN
def test_no_head_variable_in_checkpoint_or_export(straight_run):
    checkpoint = os.path.join(straight_run.output_dir, job_files.CHECKPOINT_DIR, "ckpt-3")
    exported = os.path.join(straight_run.saved_model_dir, "variables", "variables")
    for path in (checkpoint, exported):
        shapes = {tuple(shape) for _, shape in tf.train.list_variables(path)}
        assert (3136, CONFIG.embedding_size) in shapes  # the backbone's embedding layer is there
        assert HEAD_SHAPE not in shapes and HEAD_SHAPE[::-1] not in shapes


def test_centralized_oracle_writes_the_same_outputs_marked_non_private(data, tmp_path):
    config = dataclasses.replace(
        CONFIG, algorithm=job_config.CENTRALIZED, rounds=2, server_learning_rate=0.05
    )
    result = train_job.run_train_job(config, *data, str(tmp_path / "central"))
    summary = json.loads(open(result.metrics_path).read())
    assert summary["epsilon"] is None and summary["private"] is False
    assert summary["privacy"].startswith("non-private")
    assert math.isinf(result.epsilon)
    assert set(summary["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert os.path.exists(os.path.join(result.saved_model_dir, "saved_model.pb"))
    assert [e["epsilon"] for e in json.loads(open(result.ledger_path).read())["history"]] == [
        None,
        None,
    ]


def _exported_weights(result: job_outputs.TrainJobResult) -> dict[str, np.ndarray]:
    path = os.path.join(result.saved_model_dir, "variables", "variables")
    return {name: tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)}


def test_head_lr_scale_defaults_follow_the_paper():
    def scale(**changes):
        config = dataclasses.replace(CONFIG, head_lr_scale=None, **changes)
        return config.client_config().head_learning_rate_scale

    # DP-FedEmb's local heads learn 100x faster (section 3.3); DP-FedAvg trains backbone
    # and global head with one client optimizer (Alg. 2).
    assert scale() == scale(algorithm=job_config.DP_FTRL_FEDEMB) == 100.0
    assert scale(algorithm=job_config.DP_FEDAVG) == 1.0
    assert dataclasses.replace(
        CONFIG, algorithm=job_config.DP_FEDAVG, head_lr_scale=10.0
    ).client_config().head_learning_rate == pytest.approx(10.0 * CONFIG.client_learning_rate)


def test_head_loss_reaches_local_heads_and_the_oracle(data, tmp_path):
    cosface = {"head_loss": "cosface", "head_loss_scale": 16.0, "head_loss_margin": 0.2}
    assert dataclasses.replace(
        CONFIG, **cosface
    ).client_config().head_loss == client_config.HeadLossConfig("cosface", 16.0, 0.2)
    oracle = dataclasses.replace(
        CONFIG, algorithm=job_config.CENTRALIZED, rounds=1, server_learning_rate=0.05
    )
    runs = {
        name: _exported_weights(
            train_job.run_train_job(
                dataclasses.replace(oracle, **changes), *data, str(tmp_path / name)
            )
        )
        for name, changes in (("softmax", {}), ("softmax again", {}), ("cosface", cosface))
    }
    # Same data, seeds and steps: the oracle is repeatable, and only the loss on its
    # global head tells the cosface run apart.
    names = runs["softmax"].keys()
    assert all(np.array_equal(runs["softmax"][n], runs["softmax again"][n]) for n in names)
    assert not all(np.array_equal(runs["softmax"][n], runs["cosface"][n]) for n in names)


def test_over_budget_job_refuses_to_start(data, tmp_path):
    config = dataclasses.replace(CONFIG, max_epsilon=0.5)
    output_dir = str(tmp_path / "refused")
    with pytest.raises(ValueError, match="over budget"):
        train_job.run_train_job(config, *data, output_dir)
    assert not os.path.exists(output_dir)
    with pytest.raises(ValueError, match="infinite"):
        train_job.run_train_job(
            dataclasses.replace(config, noise_multiplier=0.0), *data, output_dir
        )


def test_target_epsilon_calibrates_the_noise_from_the_training_users(data, tmp_path):
    """The noise multiplier is found when the job starts, from the partition's real user
    count: the smallest z (within the calibration tolerance) whose schedule costs at most
    the target, under the strict convention; metrics.json says where z came from."""
    target = 8.0
    config = dataclasses.replace(
        CONFIG, noise_multiplier=None, target_epsilon=target, rounds=1, evaluate_every=0
    )
    result = train_job.run_train_job(config, *data, str(tmp_path / "calibrated"))
    source = result.metrics["noise_multiplier_source"]
    assert source["source"] == "calibrated" and source["target_epsilon"] == target
    assert source["training_users"] == TRAIN_IDENTITIES
    z = source["noise_multiplier"]
    assert result.metrics["config"]["noise_multiplier"] == z
    assert result.metrics["accounting"]["convention"] == "strict"
    assert result.metrics["accounting"]["sensitivity_in_clips"] == 2.0
    assert result.epsilon <= target
    fixed = dataclasses.replace(config, target_epsilon=None, noise_multiplier=z)
    spec = job_plan.accounting_spec_for(fixed, TRAIN_IDENTITIES)
    assert accounting.compute_privacy(spec).epsilon == pytest.approx(result.epsilon)
    lower = spec.with_noise_multiplier(z * (1 - calibration.CALIBRATION_RELATIVE_TOLERANCE))
    assert accounting.compute_privacy(lower).epsilon > target


def test_an_unreachable_target_epsilon_is_refused_before_training(data, tmp_path):
    # Reachable only with z above the 3 virtual clients per round: noise larger than any
    # update on every coordinate of the average.
    config = dataclasses.replace(CONFIG, noise_multiplier=None, target_epsilon=0.05, delta=1e-5)
    output_dir = str(tmp_path / "refused")
    with pytest.raises(ValueError, match="out of reach for this schedule.*more users"):
        train_job.run_train_job(config, *data, output_dir)
    assert not os.path.exists(output_dir)


@ON_STRAIGHT_RUN
def test_a_different_job_in_the_same_output_dir_is_refused(data, straight_run):
    changed = dataclasses.replace(CONFIG, noise_multiplier=0.7)
    with pytest.raises(ValueError, match="different noise_multiplier"):
        train_job.run_train_job(changed, *data, straight_run.output_dir)


def test_too_few_users_for_a_round_is_refused(data, tmp_path):
    config = dataclasses.replace(CONFIG, virtual_clients_per_round=20)
    with pytest.raises(ValueError, match="cannot fill a round"):
        train_job.run_train_job(config, *data, str(tmp_path / "x"))


def test_auto_virtual_clients_resolve_from_the_population():
    config = dataclasses.replace(
        CONFIG, virtual_clients_per_round=job_config.AUTO, users_per_virtual_client=4
    )
    resolved, source = config.calibrated_for(41)
    assert resolved.virtual_clients_per_round == 10
    assert source["virtual_clients_per_round"] == job_config.AUTO
    # Before any round, a population that cannot fill one is one line naming the setting.
    with pytest.raises(ValueError, match="set virtual_clients_per_round to at most 2"):
        dataclasses.replace(
            CONFIG, virtual_clients_per_round=9, users_per_virtual_client=4
        ).calibrated_for(11)
    with pytest.raises(ValueError, match="must be an integer or 'auto'"):
        dataclasses.replace(CONFIG, virtual_clients_per_round="many")


def test_config_round_trips_and_keeps_paper_momentum():
    assert job_config.TrainJobConfig.from_dict(CONFIG.to_dict()) == CONFIG
    assert job_config.TrainJobConfig().client_momentum == 0.9
    with pytest.raises(ValueError, match="unknown training config fields: bogus"):
        job_config.TrainJobConfig.from_dict({"bogus": 1})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"algorithm": "fedsgd"}, "algorithm"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"noise_multiplier": float("nan")}, "noise_multiplier"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"rounds": 0}, "rounds"),
        ({"client_momentum": 1.0}, "client_momentum"),
        ({"delta": 1.0}, "delta"),
        ({"head_capacity": 0}, "head_capacity"),
        ({"max_epsilon": 0.0}, "max_epsilon"),
        (
            {"settings": {"restart_every_epoch": True}},
            "dp_fedemb.restart_every_epoch applies only to",
        ),
        ({"settings": {"max_local_steps": 0}}, "dp_fedemb.max_local_steps must be >= 1"),
        ({"architecture": "mobilenet_v2"}, "32x32"),
        ({"users_per_virtual_client": 2.5}, "integer"),
        ({"head_lr_scale": 0.0}, "head_lr_scale"),
        ({"head_loss": "triplet"}, "head_loss must be one of"),
        ({"head_loss_scale": 0.0}, "head_loss_scale"),
        ({"head_loss_margin": 2.0}, "head_loss_margin"),
        ({"head_loss_margin": "0.3"}, "head_loss_margin must be a number"),
        ({"target_epsilon": 5.0}, "give noise_multiplier or target_epsilon, not both"),
        ({"noise_multiplier": None, "target_epsilon": 0.0}, "target_epsilon"),
        (
            {"noise_multiplier": None, "target_epsilon": 5.0, "max_epsilon": 4.0},
            "exceeds max_epsilon",
        ),
        (
            {"noise_multiplier": None, "target_epsilon": 5.0, "algorithm": "centralized"},
            "centralized has no noise",
        ),
    ],
)
def test_config_rejects_nonsense(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **changes)


def test_local_heads_too_small_for_shared_identities_are_refused_before_training(tmp_path):
    from beam_jobs import partition_job, synthetic

    # 20 users each holding 3 of 15 shared identities: two users may hold 6 together.
    shared = synthetic.SyntheticConfig(
        identities=15, images_per_identity=2, identities_per_user=3, users_sharing_identities=20
    )
    inputs = partition_job.write_training_inputs(
        str(tmp_path / "data"),
        synthetic.records_for_units(shared, 0, shared.units),
        synthetic.records_for_identities(SYNTH, TRAIN_IDENTITIES, SYNTH.identities),
        num_shards=2,
    )
    for capacity in (None, 5):
        config = dataclasses.replace(CONFIG, head_capacity=capacity)
        output_dir = str(tmp_path / f"refused-{capacity}")
        with pytest.raises(ValueError, match="set head_capacity .* to at least 6$"):
            train_job.run_train_job(config, *inputs, output_dir)
        assert not os.path.exists(output_dir)  # nothing claimed, no budget charged
    # Faces-like data (one identity a user) fits one row per user.
    one_row_per_user = dataclasses.replace(CONFIG, head_capacity=None)
    local_heads.check_local_heads_fit(one_row_per_user, {"1": 32})
    # DP-FedAvg's head is global: no local head to fit.
    fedavg = dataclasses.replace(CONFIG, algorithm=job_config.DP_FEDAVG, head_capacity=None)
    local_heads.check_local_heads_fit(fedavg, {"3": 20})


def test_shared_identities_bound_a_virtual_client_by_the_identities_there_are():
    """Issue 67: 270 writers of 62 characters (an identity split leaves 48 in training),
    each writer holding all 48: 8 writers hold 48 distinct characters, not 8 x 48 = 384.
    Checked against every 8-writer subset's union of a small shared population too."""
    default = job_config.TrainJobConfig(client_learning_rate=0.01)
    local_heads.check_local_heads_fit(default, {"48": 270}, identities=48)
    with pytest.raises(ValueError, match="set head_capacity .* to at least 384$"):
        local_heads.check_local_heads_fit(default, {"48": 270})  # identities not counted
    with pytest.raises(ValueError, match=r"70 identities \(the training data's identities"):
        local_heads.check_local_heads_fit(default, {"48": 270}, identities=70)
    # The bound is never below what some virtual client really holds.
    rng = np.random.default_rng(3)
    small = dataclasses.replace(default, users_per_virtual_client=3)
    for _ in range(20):
        pool = int(rng.integers(2, 9))
        held = [
            set(rng.choice(pool, int(rng.integers(1, pool + 1)), replace=False)) for _ in range(7)
        ]
        histogram = collections.Counter(len(h) for h in held)
        bound, _ = local_heads.identities_a_client_may_hold(
            small, {str(n): c for n, c in histogram.items()}, len(set().union(*held))
        )
        truth = max(len(set().union(*group)) for group in itertools.combinations(held, 3))
        assert bound >= truth


def test_the_default_head_capacity_is_the_client_configs_and_fits_eight_of_eight():
    """The job's default (the pipeline's too: no recipe sets it) is ClientConfig's 64 rows,
    enough for 8 users holding 8 shared identities each; 9 each are refused."""
    default = job_config.TrainJobConfig(client_learning_rate=0.01)
    assert default.head_capacity == client_config.ClientConfig.head_capacity == 64
    assert default.client_config().head_capacity == 64
    local_heads.check_local_heads_fit(default, {"6": 100, "8": 700})
    with pytest.raises(ValueError, match="set head_capacity .* to at least 72$"):
        local_heads.check_local_heads_fit(default, {"9": 8})

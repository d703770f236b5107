"""Shared negatives (issue 22, items 2 and 4): fixed negative head rows, the DPLC releases'
accounting, and a real DP-FedEmb run with them.

The composed epsilons are checked against dp_accounting directly (events built here,
not through tff_algorithms.privacy.accounting or dplc_releases).
"""

import dataclasses
import json
import math
import os

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

from tests import support
from tff_algorithms.algorithms.dp_fedemb import shared_negatives, shared_negatives_config
from tff_algorithms.base import job_files
from tff_algorithms.config import client_config, job_config, job_plan
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling.identity_heads import MASKED_LOGIT, head_logits, head_loss
from tff_algorithms.privacy import accounting, accounting_spec, budget, calibration, dplc_releases
from tff_algorithms.privacy.ledger import PrivacyLedger

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------
# Independent accounting: dp_accounting's RDP accountant on events written out here.

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]


def independent_epsilon(training_event, relation, sigma, clusters, releases, delta):
    rdp = rdp_privacy_accountant.RdpAccountant(orders=ORDERS, neighboring_relation=relation)
    rdp.compose(training_event)
    for _ in range(releases):  # one release: Q Gaussian mechanisms of multiplier sigma
        for _ in range(clusters):
            rdp.compose(dp_accounting.GaussianDpEvent(sigma))
    return rdp.get_epsilon(delta)


PLAN = dplc_releases.ReleasePlan(
    every_rounds=3,
    num_clusters=2,
    noise_multiplier=4.0,
    cluster_size=16,
    margin=1.0,
    pool_users=64,
    sensitivity=2 * math.sin(1.0) / 16,
)
SGD = accounting_spec.AccountingSpec(2000, 64, 10, 1.2, 1e-5, users_per_virtual_client=8)
# The RDP path, checked against dp_accounting's RDP accountant on events written out here.
SGD_RDP = dataclasses.replace(SGD, accountant="rdp")
TREE = accounting_spec.AccountingSpec(
    1000, 100, 25, 3.0, 1e-6, mechanism="dpftrl", users_per_virtual_client=4,
    restart_every_epoch=True,
)  # fmt: skip


def test_ledger_composes_dpsgd_training_with_each_release():
    ledger = PrivacyLedger(SGD_RDP, PLAN)
    plain = PrivacyLedger(SGD_RDP)
    for r in range(1, SGD.rounds + 1):
        ledger.record_round(r)
        plain.record_round(r)
        releases = -(-r // PLAN.every_rounds)  # releases before rounds 0, 3, 6, 9
        # Substitute-one, strict: sensitivity 2 clips, so the accountant sees z / 2.
        training = dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                2000, 64, dp_accounting.GaussianDpEvent(1.2 / 2)
            ),
            r,
        )
        expected = independent_epsilon(
            training, dp_accounting.NeighboringRelation.REPLACE_ONE, 4.0, 2, releases, 1e-5
        )
        assert ledger.epsilon == pytest.approx(expected, rel=1e-9)
        assert ledger.epsilon > plain.epsilon
    assert PLAN.releases_after(10) == 4


def test_pld_ledger_composes_each_release():
    """Under the default PLD the releases count too, and the composition is at most RDP's
    and at least the releases' own exact Gaussian epsilon."""
    assert SGD.accountant is accounting_spec.Accountant.PLD
    ledger, plain, rdp = PrivacyLedger(SGD, PLAN), PrivacyLedger(SGD), PrivacyLedger(SGD_RDP, PLAN)
    for r in range(1, SGD.rounds + 1):
        for each in (ledger, plain, rdp):
            each.record_round(r)
        assert plain.epsilon < ledger.epsilon <= rdp.epsilon
        assert ledger.epsilon_rdp == rdp.epsilon
    # 4 releases of 2 centers at sigma 4: one Gaussian of multiplier 4 / sqrt(8), whose
    # exact (analytic) delta at the ledger's epsilon must be below the ledger's delta.
    mu = math.sqrt(8) / 4.0
    eps = ledger.epsilon
    exact = special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2)
    assert exact <= SGD.delta


def test_ledger_composes_dpftrl_training_and_adds_zcdp():
    ledger = PrivacyLedger(TREE, PLAN)
    for r in range(1, TREE.rounds + 1):
        ledger.record_round(r)
    full, last = divmod(25, 10)  # 10 rounds per epoch, restarted trees
    # k = 4 > 1 under add/remove-special: sensitivity 2 clips per node.
    z = 3.0 / 2
    training = dp_accounting.ComposedDpEvent(
        [dp_accounting.SingleEpochTreeAggregationDpEvent(z, 10)] * full
        + [dp_accounting.SingleEpochTreeAggregationDpEvent(z, last)]
    )
    releases = 9  # ceil(25 / 3)
    expected = independent_epsilon(
        training, dp_accounting.NeighboringRelation.REPLACE_SPECIAL, 4.0, 2, releases, 1e-6
    )
    assert ledger.epsilon == pytest.approx(expected, rel=1e-9)
    tree_rho = accounting.compute_privacy(TREE).zcdp_rho
    assert ledger.history[-1].zcdp_rho == pytest.approx(tree_rho + releases * 2 / (2 * 4.0**2))


def test_ledger_round_trips_and_refuses_other_releases():
    ledger = PrivacyLedger(SGD, PLAN)
    for r in range(1, 5):
        ledger.record_round(r)
    text = ledger.to_json()
    assert json.loads(text)["shared_negatives"] == PLAN.to_dict()
    resumed = PrivacyLedger.from_json(text, expected_spec=SGD, expected_releases=PLAN)
    assert resumed == ledger and resumed.releases == PLAN
    with pytest.raises(ValueError, match="other shared-negatives releases"):
        PrivacyLedger.from_json(text, expected_spec=SGD)
    with pytest.raises(ValueError, match="strict convention only"):
        PrivacyLedger(dataclasses.replace(SGD, convention="paper"), PLAN)


def test_budget_counts_the_releases(tmp_path):
    policy = budget.BudgetPolicy(str(tmp_path / "budget.json"), 100.0)
    charge = budget.charge_run(policy, "f" * 64, 2000, "run-1", SGD_RDP, PLAN)
    training = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            2000, 64, dp_accounting.GaussianDpEvent(0.6)
        ),
        10,
    )
    expected = independent_epsilon(
        training, dp_accounting.NeighboringRelation.REPLACE_ONE, 4.0, 2, 4, 1e-5
    )
    assert charge.run_epsilon == pytest.approx(expected, rel=1e-9)
    assert charge.run_epsilon > budget.composed_epsilon([SGD_RDP], 1e-5)
    # A second run on the same users composes with the first's releases too.
    second = budget.charge_run(policy, "f" * 64, 2000, "run-2", SGD_RDP)
    assert second.spent_before == pytest.approx(expected, rel=1e-9)
    assert budget.dataset_spent(policy.ledger_path, "f" * 64, 1e-5) == pytest.approx(
        second.spent_after
    )
    # Resuming with other releases is refused (it would be charged twice).
    with pytest.raises(ValueError, match="another accounting spec"):
        budget.charge_run(policy, "f" * 64, 2000, "run-1", SGD_RDP)


def test_calibration_targets_the_composed_epsilon():
    z = calibration.calibrate_noise_multiplier(SGD, 6.0, releases=PLAN)
    assert dplc_releases.composed_privacy(SGD.with_noise_multiplier(z), PLAN).epsilon <= 6.0
    assert z > calibration.calibrate_noise_multiplier(SGD, 6.0)


# ---------------------------------------------------------------------------------------
# The config: one-line errors.


def test_config_reads_a_mapping_and_round_trips():
    config = job_config.TrainJobConfig.from_dict(
        {"shared_negatives": {"every_rounds": 2, "pool_users": 16, "cluster_size": 4}}
    )
    assert config.shared_negatives == shared_negatives_config.SharedNegativesConfig(
        every_rounds=2, pool_users=16, cluster_size=4
    )
    assert job_config.TrainJobConfig.from_dict(config.to_dict()) == config
    assert config.client_config().shared_negative_rows == config.shared_negatives.num_clusters
    assert job_config.TrainJobConfig().client_config().shared_negative_rows == 0
    # Plain head rows by default; PrivacyFace's cap margin, at the release's ρ, is named.
    assert config.shared_negatives.logit == "row"
    assert config.client_config().shared_negative_cap == 0.0
    cap = job_config.TrainJobConfig.from_dict({"shared_negatives": {"margin": 0.7, "logit": "cap"}})
    assert cap.client_config().shared_negative_cap == cap.shared_negatives.margin == 0.7
    assert job_config.TrainJobConfig.from_dict(cap.to_dict()) == cap
    # The scoring is post-processing: the releases' accounting is the same either way.
    assert job_plan.release_plan_for(cap) == job_plan.release_plan_for(
        dataclasses.replace(cap, shared_negatives={"margin": 0.7})
    )
    assert job_config.TrainJobConfig().client_config().shared_negative_cap == 0.0


@pytest.mark.parametrize(
    "values, message",
    [
        ({"algorithm": "dp-fedavg", "shared_negatives": {}}, "applies to dp-fedemb"),
        ({"shared_negatives": {"sigma": 1}}, "unknown shared_negatives field 'sigma'"),
        ({"shared_negatives": {"cluster_size": 600}}, "exceeds pool_users"),
        ({"shared_negatives": {"margin": 0}}, "shared_negatives.margin"),
        ({"shared_negatives": {"noise_multiplier": 0}}, "shared_negatives.noise_multiplier"),
        ({"shared_negatives": {"every_rounds": 0}}, "shared_negatives.every_rounds"),
        ({"shared_negatives": 3}, "must be a mapping"),
        ({"shared_negatives": {"logit": "arc"}}, "shared_negatives.logit must be one of cap, row"),
    ],
)
def test_config_rejects_nonsense_in_one_line(values, message):
    with pytest.raises(ValueError, match=message) as error:
        job_config.TrainJobConfig.from_dict(values)
    assert "\n" not in str(error.value)


def test_pool_larger_than_the_population_is_refused_at_calibration():
    config = job_config.TrainJobConfig(
        users_per_virtual_client=2,
        virtual_clients_per_round=2,
        shared_negatives={"pool_users": 40, "cluster_size": 4},
    )
    with pytest.raises(ValueError, match="pool_users 40 exceeds the 32 training users"):
        config.calibrated_for(32)


# ---------------------------------------------------------------------------------------
# The head: fixed negative rows.

COSFACE = client_config.HeadLossConfig("cosface", 30.0, 0.35)
SOFTMAX = client_config.HeadLossConfig("softmax")


@pytest.mark.parametrize("loss", [SOFTMAX, COSFACE], ids=["softmax", "cosface"])
def test_negative_rows_get_no_gradient_and_raise_the_loss(loss):
    rng = np.random.default_rng(0)
    embeddings = tf.constant(rng.normal(size=(5, 4)), tf.float32)
    kernel = tf.Variable(rng.normal(size=(4, 3)), dtype=tf.float32)
    labels = tf.constant([0, 1, 2, 0, 1])
    mask = tf.ones([5], tf.bool)
    # One negative along the first embedding: that example's loss must rise.
    negatives = tf.Variable(np.stack([embeddings[0].numpy(), rng.normal(size=4)]), dtype=tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        with_negatives = head_logits(embeddings, kernel, labels, loss, 3, negatives)
        loss_with = head_loss(with_negatives, labels, mask)
        loss_without = head_loss(head_logits(embeddings, kernel, labels, loss, 3), labels, mask)
    assert tape.gradient(loss_with, negatives) is None
    assert tape.gradient(loss_with, kernel) is not None
    assert with_negatives.shape == (5, 5)
    assert float(loss_with) > float(loss_without)
    # The local logits are unchanged; the negatives' are those of the definition.
    np.testing.assert_array_equal(
        with_negatives[:, :3], head_logits(embeddings, kernel, labels, loss, 3)
    )
    unit_negatives = tf.math.l2_normalize(negatives, axis=1)
    if loss is COSFACE:
        expected = 30.0 * tf.matmul(
            tf.math.l2_normalize(embeddings, axis=1), unit_negatives, transpose_b=True
        )
    else:
        expected = tf.matmul(embeddings, unit_negatives, transpose_b=True) * tf.reduce_mean(
            tf.norm(kernel, axis=0)
        )
    np.testing.assert_allclose(with_negatives[:, 3:], expected, rtol=1e-5, atol=1e-5)


def test_zero_negative_rows_are_masked_and_leave_the_loss_unchanged():
    rng = np.random.default_rng(1)
    embeddings = tf.constant(rng.normal(size=(4, 4)), tf.float32)
    kernel = tf.constant(rng.normal(size=(4, 3)), tf.float32)
    labels = tf.constant([0, 1, 2, 0])
    mask = tf.ones([4], tf.bool)
    logits = head_logits(embeddings, kernel, labels, COSFACE, 3, tf.zeros([2, 4]))
    assert np.all(logits[:, 3:].numpy() == MASKED_LOGIT)
    np.testing.assert_allclose(
        head_loss(logits, labels, mask),
        head_loss(head_logits(embeddings, kernel, labels, COSFACE, 3), labels, mask),
        rtol=1e-6,
    )


# ---------------------------------------------------------------------------------------
# A real DP-FedEmb job with shared negatives.

SYNTH = support.TRAIN_CLI_DATA
TRAIN_IDENTITIES = support.SMALL_JOB_TRAIN_IDENTITIES
SHARED = shared_negatives_config.SharedNegativesConfig(
    every_rounds=2, pool_users=12, num_clusters=2, cluster_size=4, margin=1.0, noise_multiplier=3.0
)
CONFIG = dataclasses.replace(
    support.SMALL_JOB, shared_negatives=SHARED, head_loss="cosface", head_init="class_means"
)
NEGATIVES_SHAPE = (SHARED.num_clusters, CONFIG.embedding_size)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


@pytest.fixture(scope="module")
def run(tff_runtime, data, tmp_path_factory):
    return train_job.run_train_job(CONFIG, *data, str(tmp_path_factory.mktemp("shared")))


def test_job_trains_and_its_ledger_composes_the_releases(run):
    metrics = run.metrics
    assert metrics["rounds"] == 3 and metrics["private"] is True
    assert all(0.0 <= v <= 1.0 for v in metrics["recall_at_far"].values())
    # Releases before rounds 0 and 2 (every 2 rounds): two of them.
    assert metrics["shared_negatives"]["releases"] == 2
    assert metrics["shared_negatives"]["sampling_amplification"] == "none"
    n, delta = TRAIN_IDENTITIES, TRAIN_IDENTITIES**-1.1
    users_per_round = CONFIG.users_per_virtual_client * CONFIG.virtual_clients_per_round
    training = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            n, users_per_round, dp_accounting.GaussianDpEvent(CONFIG.noise_multiplier / 2)
        ),
        3,
    )
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    expected = independent_epsilon(training, relation, 3.0, 2, 2, delta)
    # The RDP cross-check is dp_accounting's RDP; the (default) PLD epsilon is at most it
    # and above the training's PLD alone.
    assert metrics["epsilon_rdp"] == pytest.approx(expected, rel=1e-9)
    ledger = json.loads(open(run.ledger_path).read())
    spec = accounting_spec.AccountingSpec.from_dict(ledger["spec"])
    assert spec.accountant is accounting_spec.Accountant.PLD
    assert accounting.compute_privacy(spec).epsilon < metrics["epsilon"] <= expected
    assert ledger["epsilon_rdp"] == pytest.approx(expected, rel=1e-9)
    assert ledger["history"][-1]["epsilon"] == metrics["epsilon"]
    # Round 1 already carries the first release, round 2 the same one, round 3 the second.
    first = dplc_releases.composed_privacy(
        spec, dplc_releases.ReleasePlan.from_dict(ledger["shared_negatives"]), 1
    ).epsilon
    assert ledger["history"][0]["epsilon"] == pytest.approx(first, rel=1e-9)
    assert first > accounting.compute_privacy(spec.with_rounds(1)).epsilon
    assert "DPLC release" in metrics["privacy"]


def test_resumed_run_equals_uninterrupted_with_the_released_centers(
    tff_runtime, data, run, tmp_path
):
    import shutil

    # A kill after round 2: the centers released before round 2 (0-based) are in round 2's
    # checkpoint; the fixed testing noise seed makes the next release repeatable.
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(run.output_dir, resumed_dir)
    support.remove_checkpoint(os.path.join(resumed_dir, job_files.CHECKPOINT_DIR), 3)
    shutil.rmtree(os.path.join(resumed_dir, job_files.SAVED_MODEL_DIR))
    for name in (job_files.METRICS_FILE, job_files.LEDGER_FILE):
        os.remove(os.path.join(resumed_dir, name))
    resumed = train_job.run_train_job(CONFIG, *data, resumed_dir)
    assert resumed.metrics["resumed_from_round"] == 2
    assert open(resumed.ledger_path).read() == open(run.ledger_path).read()
    for a, b in zip(
        support.saved_backbone(run.saved_model_dir),
        support.saved_backbone(resumed.saved_model_dir),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def _variables(path):
    return {name: tuple(shape) for name, shape in tf.train.list_variables(path)}


def test_no_head_row_or_center_in_the_export_and_no_head_in_the_checkpoint(run):
    exported = _variables(os.path.join(run.saved_model_dir, "variables", "variables"))
    assert (3136, CONFIG.embedding_size) in exported.values()  # the backbone is there
    head = (CONFIG.embedding_size, CONFIG.head_capacity)
    for shape in (head, head[::-1], NEGATIVES_SHAPE, NEGATIVES_SHAPE[::-1]):
        assert shape not in exported.values()
    checkpoint = os.path.join(run.output_dir, job_files.CHECKPOINT_DIR, "ckpt-3")
    shapes = _variables(checkpoint)
    assert head not in shapes.values() and head[::-1] not in shapes.values()
    # The released centers are server state: checkpointed, unit rows, the ones broadcast.
    reader = tf.train.load_checkpoint(checkpoint)
    centers = [
        reader.get_tensor(name) for name, shape in shapes.items() if shape == NEGATIVES_SHAPE
    ]
    assert len(centers) == 1
    np.testing.assert_allclose(np.linalg.norm(centers[0], axis=1), 1.0, rtol=1e-5)


def test_centers_come_from_the_current_backbone_with_one_row_per_pool_user(tff_runtime, data):
    from beam_jobs import partition
    from tff_algorithms.modeling import models

    reader = partition.PartitionReader(data[0])
    users = reader.user_ids()
    releaser = shared_negatives.CenterReleaser(
        SHARED, CONFIG.backbone_config, reader, users, public_seed=1, noise_seed=5
    )
    pool = releaser.pool(0)
    assert len(pool) == SHARED.pool_users == len(set(pool)) and pool == releaser.pool(0)
    weights = models.backbone_weights(models.build_backbone(CONFIG.backbone_config, 2))
    centers = releaser.class_centers(weights, pool)
    assert centers.shape == (SHARED.pool_users, CONFIG.embedding_size)
    np.testing.assert_allclose(np.linalg.norm(centers, axis=1), 1.0, rtol=1e-9)
    rows = releaser.release(0, weights)
    assert rows.shape == NEGATIVES_SHAPE and rows.dtype == np.float32
    np.testing.assert_array_equal(rows, releaser.release(0, weights))  # fixed testing seed


def test_a_client_trains_against_the_broadcast_rows_and_returns_only_its_backbone():
    from tff_algorithms.algorithms.dp_fedemb import client_work
    from tff_algorithms.config import model_config
    from tff_algorithms.modeling import models

    backbone = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
    config = client_config.ClientConfig(
        client_learning_rate=0.1,
        head_capacity=3,
        # One batch: the client dataset reshuffles on every pass, and within one batch
        # the order only changes the summation order.
        batch_size=6,
        head_loss=COSFACE,
        shared_negative_rows=2,
    )
    rng = np.random.default_rng(0)
    examples = tf.data.Dataset.from_tensor_slices(
        {
            "image": rng.random((6, 28, 28, 1), dtype=np.float32),
            "identity": np.array(["b", "a", "c", "a", "b", "c"]),
        }
    )
    dataset = client_work.make_client_dataset(examples, "round0/vc0", config)
    weights = models.backbone_weights(models.build_backbone(backbone, seed=3))

    def update(rows):
        result, measurements = client_work.train_one_client(
            backbone, config, weights, dataset, shared_negatives=rows
        )
        assert measurements["reported"] == 1
        return result

    unreleased = update(None)
    plain = client_work.train_one_client(
        backbone, dataclasses.replace(config, shared_negative_rows=0), weights, dataset
    )[0]
    released = update(rng.normal(size=(2, 8)).astype(np.float32))
    # Zero rows (nothing released yet) are masked: the same update as without the field.
    for a, b in zip(unreleased, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # The update has the backbone's shapes only (no head, no negatives), and moves.
    assert [u.shape for u in released] == [w.shape for w in weights.trainable]
    assert any(not np.allclose(a, b) for a, b in zip(released, plain, strict=True))


# ---------------------------------------------------------------------------------------
# Wiring: `dp-fedemb train` flags and the pipeline's train.shared_negatives.


def _flag_config(*args):
    from absl import flags

    from pipeline.commands import train, train_config

    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(["dp-fedemb train", "--recipe=paper", *args])
    return train_config.job_config({name: flag_values[name].value for name in flag_values})


def test_train_flags_set_shared_negatives():
    assert _flag_config().shared_negatives is None
    assert _flag_config("--shared-negatives").shared_negatives == (
        shared_negatives_config.SharedNegativesConfig()
    )
    config = _flag_config("--shared-negatives-every-rounds=3", "--shared-negatives-margin=0.8")
    assert config.shared_negatives == shared_negatives_config.SharedNegativesConfig(
        every_rounds=3, margin=0.8
    )
    assert _flag_config("--shared-negatives-logit=cap").shared_negatives.logit == "cap"


def test_bad_shared_negatives_flags_give_one_error_line(tmp_path, capsys):
    from pipeline import cli

    data = tmp_path / "data"
    data.mkdir()
    for extra, message in [
        (["--shared-negatives-pool-users=0"], "--shared-negatives-pool-users must be >= 1"),
        (["--shared-negatives-margin=-1"], "--shared-negatives-margin must be > 0"),
        (["--shared-negatives-logit=arc"], "--shared-negatives-logit must be one of cap, row"),
        (
            ["--shared-negatives", "--algorithm=dp-fedavg"],
            "shared_negatives applies to dp-fedemb and dp-ftrl-fedemb",
        ),
    ]:
        code = cli.main(
            ["dp-fedemb", "train", "--data", str(data), "--output", str(tmp_path / "o"), *extra]
        )
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code != 0 and len(lines) == 1 and message in lines[0], lines


def test_pipeline_config_takes_shared_negatives_through_set():
    from pipeline import config as config_lib

    config = config_lib.check_config(
        None,
        ["train.shared_negatives.every_rounds=4", "train.shared_negatives.noise_multiplier=6"],
    )
    job = job_config.TrainJobConfig.from_dict(config.train_job_dict())
    assert job.shared_negatives == shared_negatives_config.SharedNegativesConfig(
        every_rounds=4, noise_multiplier=6.0
    )
    # Public pretraining (centralized) drops it; a typo is one line.
    assert "shared_negatives" not in config.pretrain_job_dict()
    with pytest.raises(ValueError, match="unknown shared_negatives field 'every'") as error:
        config_lib.load_config(None, ["train.shared_negatives.every=4"])
    assert "\n" not in str(error.value)


def test_dp_fedemb_train_trains_with_shared_negatives(tmp_path):
    import subprocess

    from beam_jobs import synthetic

    data, output = str(tmp_path / "raw"), str(tmp_path / "out")
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    command = [
        support.CONSOLE_SCRIPT,
        "train",
        "--data",
        data,
        "--output",
        output,
        *support.train_cli_flags(2),
        "--shared-negatives-every-rounds=1",
        "--shared-negatives-pool-users=8",
        "--shared-negatives-cluster-size=4",
        "--shared-negatives-num-clusters=3",
        "--shared-negatives-noise-multiplier=5",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    metrics = json.loads(open(summary["metrics"]).read())
    assert metrics["shared_negatives"]["releases"] == 2
    assert metrics["config"]["shared_negatives"]["num_clusters"] == 3
    ledger = json.loads(open(summary["ledger"]).read())
    assert ledger["shared_negatives"]["every_rounds"] == 1
    plan = dplc_releases.ReleasePlan.from_dict(ledger["shared_negatives"])
    spec = accounting_spec.AccountingSpec.from_dict(ledger["spec"])
    assert summary["epsilon"] == pytest.approx(
        dplc_releases.composed_privacy(spec, plan).epsilon, rel=1e-12
    )
    assert summary["epsilon"] > accounting.compute_privacy(spec).epsilon


def test_report_shows_the_releases_in_the_accounting_rows():
    from pipeline import privacy_text

    ledger = PrivacyLedger(SGD, PLAN)
    for r in range(1, 5):
        ledger.record_round(r)
    rows = dict(privacy_text.accounting_rows(ledger.to_dict()))
    line = rows["shared negatives (DPLC releases, in ε above)"]
    assert line.startswith("2 release(s) of 2 noisy cluster center(s) every 3 round(s)")
    alone = dplc_releases.releases_epsilon(PLAN, 4, SGD.delta)
    assert privacy_text.format_epsilon(alone) in line and "no sampling amplification" in line
    assert not any(
        "shared negatives" in label
        for label, _ in privacy_text.accounting_rows(PrivacyLedger(SGD).to_dict())
    )


def test_dp_ftrl_fedemb_trains_with_shared_negatives(tff_runtime, data, tmp_path):
    config = dataclasses.replace(
        CONFIG, algorithm=job_config.DP_FTRL_FEDEMB, rounds=2, evaluate_every=0
    )
    result = train_job.run_train_job(config, *data, str(tmp_path / "ftrl"))
    ledger = json.loads(open(result.ledger_path).read())
    assert ledger["spec"]["mechanism"] == "dpftrl" and ledger["shared_negatives"]
    spec = accounting_spec.AccountingSpec.from_dict(ledger["spec"])
    tree = accounting.compute_privacy(spec)
    # One release (before round 0; every 2 rounds): Q = 2 Gaussians of sigma 3 in zCDP.
    assert result.metrics["zcdp_rho"] == pytest.approx(tree.zcdp_rho + 2 / (2 * 3.0**2))
    assert result.metrics["epsilon"] > tree.epsilon
    assert all(0.0 <= v <= 1.0 for v in result.metrics["recall_at_far"].values())

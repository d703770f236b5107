"""Logit-DP training as a job (issue 26 item 2): user-level pairs, epsilon, refusals
(resume: tests/tff_algorithms/jobs/test_crash_safety.py)."""

import dataclasses
import json
import os
import subprocess
import types

import numpy as np
import pytest

from tests import support
from tff_algorithms.algorithms.logit_dp import training as contrastive_training
from tff_algorithms.config import job_config
from tff_algorithms.federated import client_data
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting_spec

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

TRAIN_IDENTITIES = support.SMALL_JOB_TRAIN_IDENTITIES
# 14 users a step is the smallest batch whose sensitivity at logit scale 1 is below n·B.
CONFIG = job_config.TrainJobConfig(
    algorithm=job_config.LOGIT_DP,
    rounds=4,
    noise_multiplier=1.0,
    clip_norm=1.0,
    users_per_virtual_client=1,
    virtual_clients_per_round=14,
    server_learning_rate=0.5,
    server_momentum=0.0,
    embedding_size=16,
    evaluate_every=2,
    seed=1,
    noise_seed=7,
    testing_fixed_noise=True,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.small_job_inputs(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def straight_run(data, tmp_path_factory):
    return train_job.run_train_job(CONFIG, *data, str(tmp_path_factory.mktemp("straight")))


def test_metrics_epsilon_equals_the_privacy_command(straight_run):
    summary = straight_run.metrics
    delta = TRAIN_IDENTITIES**-1.1
    assert summary["private"] is True and summary["rounds"] == 4
    assert summary["accounting"]["analysis"].startswith("PLD, sampled Gaussian")
    assert "Logit-DP" in summary["privacy"]
    out = subprocess.run(
        [
            support.CONSOLE_SCRIPT,
            "privacy",
            "--mechanism=logit_dp",
            f"--users={TRAIN_IDENTITIES}",
            "--users-per-round=14",
            "--rounds=4",
            "--noise-multiplier=1.0",
            f"--delta={delta!r}",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert summary["epsilon"] == pytest.approx(json.loads(out.stdout)["epsilon"], rel=1e-12)
    # Independently of the product's spec: dp_accounting's own events for the same steps.
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            TRAIN_IDENTITIES, 14, dp_accounting.GaussianDpEvent(1.0)
        ),
        4,
    )
    rdp = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    # dp_accounting's RDP is the RDP cross-check; the (default) tight PLD is below it.
    independent = rdp.compose(event).get_epsilon(delta)
    assert summary["epsilon_rdp"] == pytest.approx(independent, rel=1e-9)
    assert summary["epsilon"] < independent
    ledger = json.loads(open(straight_run.ledger_path).read())
    assert [e["round"] for e in ledger["history"]] == [1, 2, 3, 4]
    assert ledger["spec"]["mechanism"] == accounting_spec.Mechanism.LOGIT_DP.value
    assert set(summary["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert os.path.exists(os.path.join(straight_run.saved_model_dir, "saved_model.pb"))


def test_history_releases_nothing_but_epsilon_time_and_held_out_evaluation(straight_run):
    for record in straight_run.metrics["history"]:
        assert set(record) <= {"round", "epsilon", "round_seconds", "eval"}


def test_the_model_moves_and_dp_adam_first_step_moves_each_weight_by_lr(straight_run, data):
    """The straight run moves the model; and with logit_dp.optimizer adam (issue 42) one
    step from zero moments is lr·g/(|g|+ε) per coordinate of the noised gradient g, so
    every trained weight moves by lr (up to ε/|g|, the noise keeping |g| far above ε)
    whatever its gradient's size, unlike SGD's lr·g."""
    lr = 1e-3
    config = dataclasses.replace(
        CONFIG, rounds=1, evaluate_every=0, server_learning_rate=lr, settings={"optimizer": "adam"}
    )
    one_step = train_job.run_train_job(
        config, *data, os.path.join(os.path.dirname(straight_run.output_dir), "adam")
    )
    trained = models.load_pretrained_backbone(config.backbone_config, one_step.saved_model_dir)
    start = models.build_backbone(config.backbone_config, seed=config.seed)
    moved = np.concatenate(
        [
            np.abs(got.numpy() - before.numpy()).ravel()
            for layer in models.all_layers(trained)
            if layer.trainable_weights
            for got, before in zip(
                layer.trainable_weights, start.get_layer(layer.name).trainable_weights, strict=True
            )
        ]
    )
    steps = moved[moved > 0]
    assert steps.size > 1000
    # Never past lr (float32 rounding of w - lr aside). A coordinate whose noised gradient
    # lands within 100·ε of zero moves less, and the schedule seed comes from OS entropy:
    # one slow-suite run had one such coordinate of 102,480 (a step of 0.99·lr).
    assert steps.max() <= lr * (1 + 1e-3)
    assert np.mean(np.abs(steps / lr - 1) < 1e-2) > 0.999
    assert np.median(np.abs(steps / lr - 1)) < 1e-4
    apart = [
        np.max(np.abs(a - b))
        for a, b in zip(
            support.saved_backbone(one_step.saved_model_dir),
            support.saved_backbone(straight_run.saved_model_dir),
            strict=True,
        )
    ]
    assert max(apart) > 1e-2  # 4 steps at lr 0.5 moved it much further than lr


def test_each_step_takes_one_pair_from_each_of_n_distinct_users(data):
    from beam_jobs import partition

    reader = partition.PartitionReader(data[0])
    inputs = types.SimpleNamespace(config=CONFIG, reader=reader, user_ids=reader.user_ids())
    source = contrastive_training.PairSource(inputs, schedule_seed=3)
    for step in range(3):
        users = source.users(step)
        assert len(set(users)) == len(users) == 14  # no user twice in a step
        x, y = source.pairs(step)
        assert x.shape == y.shape == (14, *CONFIG.image_shape)
        # Row k holds two of user k's own images.
        for k in (0, 13):
            own = [
                client_data.parse_example(e, CONFIG.image_shape)["image"].numpy()
                for e in reader.user_examples(users[k])
            ]
            for image in (x[k].numpy(), y[k].numpy()):
                assert any(np.array_equal(image, o) for o in own)
    held = [["a"], ["b"] * 2, ["c"] * 6, ["d"] * 6]
    pairs = contrastive_training._pair_indices(held, schedule_seed=3, step=0)
    assert pairs[0] == (0, 0)  # one image: used twice
    assert all(a != b and 0 <= a < n and 0 <= b < n for (a, b), n in zip(pairs[1:], [2, 6, 6]))
    assert pairs == contrastive_training._pair_indices(held, schedule_seed=3, step=0)


def test_a_user_of_many_identities_pairs_two_images_of_one():
    # Landmarks: a photographer's images of several landmarks; only "x" and "z" are held
    # twice, so every pair is two distinct images of x or of z, never of two landmarks.
    held = ["x", "y", "z", "x", "w", "z", "v"]
    drawn = set()
    for step in range(40):
        ((first, second),) = contrastive_training._pair_indices([held], schedule_seed=1, step=step)
        assert first != second and held[first] == held[second], (first, second)
        drawn.add(held[first])
    assert drawn == {"x", "z"}
    # No identity held twice: one image twice, as for a user of one image.
    ((first, second),) = contrastive_training._pair_indices([["p", "q"]], schedule_seed=1, step=0)
    assert first == second


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"users_per_virtual_client": 2}, "set users_per_virtual_client to 1"),
        ({"virtual_clients_per_round": 8}, "a batch size of at least 14 at scale 1"),
        ({"settings": {"scale": 3.0}}, "gains nothing over per-example clipping"),
        ({"over_selection": 0.5}, "over_selection applies to federated rounds"),
        ({"settings": {"scale": 0.0}}, "logit_dp.scale must be"),
    ],
)
def test_config_refusals_are_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as e:
        dataclasses.replace(CONFIG, **changes)
    assert "\n" not in str(e.value)


def test_paper_convention_is_refused_for_logit_dp():
    with pytest.raises(ValueError, match="no paper convention") as e:
        accounting_spec.AccountingSpec(
            100, 14, 5, 1.0, 1e-5, mechanism="logit_dp", convention="paper"
        )
    assert "\n" not in str(e.value)

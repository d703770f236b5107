"""Stragglers and failures: dropped clients, planned-denominator noise, over-selection, retries."""

import dataclasses
import json
import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import schedule, synthetic
from pipeline import config as config_lib
from tests import support
from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
from tff_algorithms.config import client_config, job_config, job_plan, model_config, report_policy
from tff_algorithms.federated import client_data, dropouts
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting, accounting_spec
from tff_algorithms.privacy import ledger as ledger_lib

BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
# One batch of 4 per healthy client; a straggler with 8 examples needs 2 steps.
CONFIG = client_config.ClientConfig(
    client_learning_rate=0.05, head_capacity=4, batch_size=4, max_local_steps=1
)
PLANNED = 10
CLIP = 0.05


def _examples(seed, count, identity_prefix="u"):
    images = np.random.default_rng(seed).random((count, 28, 28, 1), dtype=np.float32)
    identities = np.array([f"{identity_prefix}{seed}-{i % 2}" for i in range(count)])
    return tf.data.Dataset.from_tensor_slices({"image": images, "identity": identities})


def _healthy(seed):
    return client_work.make_client_dataset(_examples(seed, 4), f"ok{seed}", CONFIG, 4)


def _failed_read(seed):
    """Two of four encoded images are corrupt: decoding raises, the read comes up short."""
    encoded = [
        tf.io.encode_png(tf.cast(image * 255, tf.uint8)).numpy()
        for image in np.random.default_rng(seed).random((4, 28, 28, 1))
    ]
    encoded[1] = encoded[3] = b"not a png"
    examples = tf.data.Dataset.from_tensor_slices(
        {"png": encoded, "identity": ["f0", "f1", "f0", "f1"]}
    ).map(
        lambda e: {
            "image": tf.ensure_shape(
                tf.cast(tf.io.decode_png(e["png"], channels=1), tf.float32) / 255.0, [28, 28, 1]
            ),
            "identity": e["identity"],
        }
    )
    return client_work.make_client_dataset(examples, f"failed{seed}", CONFIG, 4)


def _straggler(seed):
    return client_work.make_client_dataset(_examples(seed, 8), f"slow{seed}", CONFIG, 8)


def _non_finite(seed):
    examples = _examples(seed, 4).map(
        lambda e: {"image": e["image"] * np.nan, "identity": e["identity"]}
    )
    return client_work.make_client_dataset(examples, f"nan{seed}", CONFIG, 4)


def _round(healthy, dropped):
    """`healthy` good clients then `dropped` ones cycling through the three failures."""
    failures = (_failed_read, _straggler, _non_finite)
    return [_healthy(i) for i in range(healthy)] + [
        failures[i % 3](100 + i) for i in range(dropped)
    ]


def _process(noise_multiplier, max_reports=None):
    # Server SGD with lr 1, no momentum: the step is minus the released mean.
    return processes.build_fedemb_process(
        BACKBONE,
        CONFIG,
        aggregators.gaussian_fixed(
            noise_multiplier=noise_multiplier,
            clip_norm=CLIP,
            virtual_clients_per_round=PLANNED,
            noise_seed=7,
        ),
        processes.server_sgdm(1.0, 0.0),
        max_reports=max_reports,
    )


def _flat_weights(process, state):
    weights = processes.backbone_model_weights(process.get_model_weights(state))
    return np.concatenate([np.ravel(w).astype(np.float64) for w in weights.trainable])


@pytest.fixture(scope="module")
def no_noise(tff_runtime):
    # Keeps the first PLANNED reports: rounds of at most PLANNED clients keep every report.
    return _process(0.0, max_reports=PLANNED)


def test_failing_timed_out_and_non_finite_clients_are_dropped_and_the_round_goes_on(no_noise):
    state = no_noise.initialize()
    output = no_noise.next(state, _round(healthy=2, dropped=3))
    work = output.metrics["client_work"]
    assert (work["failed_reads"], work["timed_out_clients"], work["non_finite_updates"]) == (
        1,
        1,
        1,
    )
    assert (work["dropped_clients"], work["reported_clients"], work["kept_clients"]) == (3, 2, 2)
    # Dropped clients add nothing and the mean is still over the planned 10 clients:
    # the same step as the two healthy clients alone.
    alone = no_noise.next(state, _round(healthy=2, dropped=0))
    np.testing.assert_array_equal(
        _flat_weights(no_noise, output.state), _flat_weights(no_noise, alone.state)
    )
    moved = _flat_weights(no_noise, output.state) - _flat_weights(no_noise, state)
    assert np.linalg.norm(moved) > 0


def test_wall_clock_budget_drops_a_client_that_runs_over_it():
    # The client's own training loop, outside TFF (the TFF wiring of the same
    # `timed_out_clients` count is checked with max_local_steps above).
    initial = models.backbone_weights(models.build_backbone(BACKBONE, 0))
    unlimited = dataclasses.replace(CONFIG, max_local_steps=None)
    update, work = client_work.train_one_client(
        BACKBONE,
        unlimited,
        initial,
        client_work.make_client_dataset(_examples(3, 8), "s", unlimited, 8),
    )
    assert (work["timed_out_clients"], work["reported"]) == (0, 1)
    assert any(np.any(u != 0) for u in update)
    # Two local steps: the check before the second one sees a whole step's time elapsed.
    budget = dataclasses.replace(unlimited, max_seconds=1e-6)
    update, work = client_work.train_one_client(
        BACKBONE, budget, initial, client_work.make_client_dataset(_examples(3, 8), "s", budget, 8)
    )
    assert (work["timed_out_clients"], work["reported"]) == (1, 0)
    assert all(np.all(u == 0) for u in update)


def test_noise_std_with_30_percent_dropped_is_calibrated_to_the_planned_denominator(no_noise):
    z = 2.0
    noisy = _process(z)
    state = noisy.initialize()
    clients = _round(healthy=7, dropped=3)  # 30% of the planned 10 drop out
    with_noise = noisy.next(state, clients)
    assert with_noise.metrics["client_work"]["dropped_clients"] == 3
    without_noise = no_noise.next(no_noise.initialize(), clients)
    # Same clipped sum on both sides: the difference is the released noise / M.
    noise = _flat_weights(noisy, with_noise.state) - _flat_weights(no_noise, without_noise.state)
    measured = np.std(noise)
    planned_std = z * CLIP / PLANNED
    reported_std = z * CLIP / 7  # what dividing by the reporting clients would give
    # ~1e5 coordinates: the std estimate is within a fraction of a percent.
    assert noise.size > 10_000
    assert abs(measured / planned_std - 1) < 0.02
    assert abs(measured / reported_std - 1) > 0.2
    assert abs(np.mean(noise)) < 0.02 * planned_std


def test_over_selection_keeps_the_first_planned_reports(no_noise):
    state = no_noise.initialize()
    healthy = [_healthy(i) for i in range(PLANNED + 2)]
    output = no_noise.next(state, [*healthy, _non_finite(9)])
    work = output.metrics["client_work"]
    assert (work["dropped_clients"], work["reported_clients"], work["kept_clients"]) == (
        1,
        PLANNED + 2,
        PLANNED,
    )
    # Arrival order is modelled by the client seed: the PLANNED smallest are kept.
    seeds = [
        int(client_work.client_seed_from_id(tf.constant(f"ok{i}"))) for i in range(PLANNED + 2)
    ]
    first = [healthy[i] for i in np.argsort(seeds)[:PLANNED]]
    expected = no_noise.next(state, first)
    # Summed in a different order: equal up to float rounding.
    np.testing.assert_allclose(
        _flat_weights(no_noise, output.state), _flat_weights(no_noise, expected.state), atol=1e-7
    )


def test_a_round_below_the_minimum_is_retried_with_a_fresh_selection(no_noise):
    policy = report_policy.ReportPolicy(PLANNED, min_report_fraction=0.5, max_attempts=3)
    assert policy.min_reports == 5
    state = no_noise.initialize()
    selections = {0: _round(healthy=3, dropped=7), 1: _round(healthy=6, dropped=4)}
    calls = []

    def clients_for_attempt(round_num, attempt):
        calls.append((round_num, attempt))
        return selections[attempt]

    outcome = dropouts.run_round(no_noise, state, 4, clients_for_attempt, policy)
    assert calls == [(4, 0), (4, 1)]
    assert (outcome.attempts, outcome.kept_clients, outcome.discarded_kept_clients) == (2, 6, (3,))
    # The applied round is the retry from the same state, not the failed attempt.
    retry_alone = no_noise.next(state, selections[1])
    np.testing.assert_array_equal(
        _flat_weights(no_noise, outcome.output.state), _flat_weights(no_noise, retry_alone.state)
    )


def _round_error(process, attempts, healthy, dropped):
    """The error of a round whose every attempt selects the same too-few healthy clients."""
    policy = report_policy.ReportPolicy(PLANNED, min_report_fraction=0.5, max_attempts=attempts)
    with pytest.raises(dropouts.RoundBelowMinimumReports) as raised:
        dropouts.run_round(
            process,
            process.initialize(),
            0,
            lambda r, a: _round(healthy=healthy, dropped=dropped),
            policy,
        )
    return str(raised.value)


def test_a_round_that_never_reaches_the_minimum_stops_with_an_error(no_noise):
    message = _round_error(no_noise, attempts=2, healthy=2, dropped=1)
    assert "round 1: 2 attempts had [2, 2]" in message
    # Why they were dropped, summed over the attempts: one failed read in each.
    assert "dropped: 2 failed reads, 0 timed out, 0 non-finite updates" in message
    assert "check the failed reads" in message and "\n" not in message


def test_a_round_lost_to_non_finite_updates_says_training_diverged(no_noise):
    message = _round_error(no_noise, attempts=1, healthy=1, dropped=3)
    assert "dropped: 1 failed reads, 1 timed out, 1 non-finite updates" in message
    assert "local training diverged" in message


def test_a_missing_part_file_fails_the_read_without_hanging(tmp_path):
    path = str(tmp_path / "part-0")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(b"record")
    size = os.path.getsize(path)
    present = client_data.UserByteRange(path, 0, size, 1)
    missing = client_data.UserByteRange(str(tmp_path / "gone"), 0, size, 1)
    vc_id = client_data.virtual_client_id(0, 0, [present, missing])
    records = client_data.read_virtual_client_records(tf.constant(vc_id)).ignore_errors()
    assert list(records.as_numpy_iterator()) == [b"record"]
    assert int(client_data.expected_examples(tf.constant(vc_id))) == 2


def test_retries_draw_a_fresh_deterministic_selection():
    sampled = schedule.VirtualClientSchedule(50, 2, 5, seed=3)
    first = sampled.round_user_indices(7)
    assert np.array_equal(first, sampled.round_user_indices(7, attempt=0))
    retry = sampled.round_user_indices(7, attempt=1)
    assert not np.array_equal(first, retry)
    assert np.array_equal(
        retry, schedule.VirtualClientSchedule(50, 2, 5, seed=3).round_user_indices(7, 1)
    )
    # Epoch mode keeps the round's users (tree accounting) and regroups them.
    epoch = schedule.VirtualClientSchedule(50, 2, 5, seed=3, mode=schedule.EPOCH)
    assert set(epoch.round_user_indices(7).ravel()) == set(epoch.round_user_indices(7, 2).ravel())


JOB = job_config.TrainJobConfig(
    rounds=50,
    noise_multiplier=0.8,
    users_per_virtual_client=2,
    virtual_clients_per_round=4,
    delta=1e-5,
)


def test_over_selection_is_accounted_with_the_selected_sampling():
    over = dataclasses.replace(JOB, over_selection=0.5)
    assert over.report_policy().selected_per_round == 6
    spec = job_plan.accounting_spec_for(over, 1000)
    assert (spec.users_per_round, spec.population) == (12, 1000)
    epsilon = accounting.compute_privacy(spec).epsilon
    assert (
        epsilon
        == accounting.compute_privacy(
            accounting_spec.AccountingSpec(1000, 12, 50, 0.8, 1e-5, users_per_virtual_client=2)
        ).epsilon
    )
    assert epsilon > accounting.compute_privacy(job_plan.accounting_spec_for(JOB, 1000)).epsilon


def test_dropouts_never_reduce_the_reported_epsilon():
    # The spec (hence every ledger entry) depends on the plan only, not on who reports.
    dropping = dataclasses.replace(
        JOB,
        failure_injection_rate=0.3,
        settings={"max_local_steps": 1, "max_client_seconds": 5.0},
    )
    assert job_plan.accounting_spec_for(dropping, 1000) == job_plan.accounting_spec_for(JOB, 1000)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"min_report_fraction": 1.5}, "min_report_fraction must be a fraction"),
        ({"over_selection": -0.1}, "over_selection must be"),
        ({"max_round_attempts": 0}, "max_round_attempts must be >= 1"),
        ({"settings": {"max_local_steps": 0}}, "dp_fedemb.max_local_steps must be >= 1"),
        ({"settings": {"max_client_seconds": 0.0}}, "dp_fedemb.max_client_seconds must be"),
        ({"failure_injection_rate": "0.1"}, "failure_injection_rate must be a number"),
    ],
)
def test_dropout_settings_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(JOB, **changes)


SYNTH = synthetic.SyntheticConfig(identities=30, images_per_identity=4, seed=2)
TRAIN_IDENTITIES = 24  # one user each; identities 24..29 are held out


@pytest.fixture(scope="module")
def job_data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("job_data"), SYNTH, TRAIN_IDENTITIES
    )


@pytest.mark.slow
def test_a_training_job_with_injected_failures_reports_them_and_is_charged_as_planned(
    tff_runtime, job_data, tmp_path
):
    planned = job_config.TrainJobConfig(
        rounds=3,
        noise_multiplier=1.0,
        users_per_virtual_client=2,
        virtual_clients_per_round=4,
        client_learning_rate=0.01,
        batch_size=8,
        embedding_size=8,
        evaluate_every=0,
        delta=1e-4,
        noise_seed=5,
        testing_fixed_noise=True,
        min_report_fraction=0.25,
    )
    failing = dataclasses.replace(planned, failure_injection_rate=0.4)
    result = train_job.run_train_job(failing, *job_data, str(tmp_path / "out"))
    summary = json.loads(open(result.metrics_path).read())
    # Round 0 is the start's evaluation: no clients.
    per_round = [record["clients"] for record in summary["history"] if record["round"] > 0]
    assert len(per_round) == 3
    # Every planned virtual client either reported (kept) or was dropped by its failed read.
    assert all(r["kept_clients"] + r["dropped_clients"] == 4 for r in per_round)
    totals = summary["client_failures"]
    assert (
        totals["dropped_clients"]
        == totals["failed_reads"]
        == sum(r["dropped_clients"] for r in per_round)
    )
    assert 0 < totals["dropped_clients"] < 12
    assert "not covered by the DP guarantee" in totals["note"]
    # The ledger is what a run without failures records: the planned schedule's epsilon.
    without_failures = ledger_lib.PrivacyLedger(
        job_plan.accounting_spec_for(planned, TRAIN_IDENTITIES)
    )
    for round_num in range(1, 4):
        without_failures.record_round(round_num)
    written = ledger_lib.PrivacyLedger.from_json(open(result.ledger_path).read())
    assert written == without_failures
    assert summary["epsilon"] == without_failures.epsilon
    assert math.isfinite(summary["epsilon"]) and summary["epsilon"] > 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.over_selection=lots", "config train: over_selection must be a number"),
        ("train.min_report_fraction=1.2", "config train: min_report_fraction must be a fraction"),
        ("train.max_round_attempts=2.5", "config train: max_round_attempts must be an integer"),
        (
            "train.dp_fedemb.max_local_steps=true",
            "config train: dp_fedemb.max_local_steps must be an integer",
        ),
        (
            "train.dp_fedemb.max_client_seconds=soon",
            "config train: dp_fedemb.max_client_seconds must be a number",
        ),
        # The flat key of the release before moves into the section (one deprecation line).
        ("train.max_local_steps=true", "config train: dp_fedemb.max_local_steps must be an"),
        ("train.failure_injection_rate=[0.1]", "config train: failure_injection_rate must be"),
    ],
)
def test_pipeline_config_refuses_wrong_dropout_settings_on_one_line(override, message):
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        config_lib.load_config(None, [override])
    assert "\n" not in str(raised.value)


def test_pipeline_config_accepts_the_dropout_settings():
    config = config_lib.load_config(
        None,
        [
            "train.over_selection=0.25",
            "train.min_report_fraction=0.6",
            "train.max_round_attempts=5",
            "train.dp_fedemb.max_local_steps=40",
            "train.dp_fedemb.max_client_seconds=30",
            "train.failure_injection_rate=0.1",
        ],
    )
    job = job_config.TrainJobConfig.from_dict(config.train_job_dict())
    assert job.report_policy() == report_policy.ReportPolicy(
        job.virtual_clients_per_round, 0.25, 0.6, 5
    )
    limits = (job.settings.max_local_steps, job.settings.max_client_seconds)
    assert (*limits, job.failure_injection_rate) == (
        40,
        30,
        0.1,
    )

"""Splits by mode: disjointness, determinism, cross-split users, shared identities, and
the stops of mode auto and of the drop guard."""

import collections
import dataclasses
import os

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import partition, records_io, schema, split_protocols, splits, synthetic
from tff_algorithms.config import job_config
from tff_algorithms.jobs import local_heads

_PNG = schema.encode_png(np.zeros((4, 4), dtype=np.uint8))


def _records(users: int, identities_per_user: int) -> list[bytes]:
    return [
        schema.serialize(schema.CanonicalRecord(f"u{u}", f"id{u}_{i}", _PNG))
        for u in range(users)
        for i in range(identities_per_user)
    ]


def _user_and_identity_sets(records: list[bytes]) -> tuple[set, set]:
    parsed = [schema.parse(r) for r in records]
    return {r.user_id for r in parsed}, {r.identity for r in parsed}


def test_identity_split_is_a_pure_function_with_the_requested_shares():
    config = split_protocols.SplitConfig(0.1, 0.2, 0.05, seed=4)
    assignment = [split_protocols.identity_split(f"id{i}", config) for i in range(20_000)]
    assert assignment == [split_protocols.identity_split(f"id{i}", config) for i in range(20_000)]
    shares = {s: assignment.count(s) / 20_000 for s in config.splits}
    assert abs(shares["test"] - 0.2) < 0.02 and abs(shares["public"] - 0.05) < 0.01
    other = [
        split_protocols.identity_split(
            f"id{i}", split_protocols.SplitConfig(0.1, 0.2, 0.05, seed=5)
        )
        for i in range(20_000)
    ]
    assert other != assignment


def _expected_dropped(
    config: split_protocols.SplitConfig, users: int, identities_per_user: int
) -> int:
    dropped = 0
    for u in range(users):
        assigned = [
            split_protocols.identity_split(f"id{u}_{i}", config) for i in range(identities_per_user)
        ]
        user_split = min(assigned, key=split_protocols.SPLIT_PRIORITY.index)
        dropped += sum(split != user_split for split in assigned)
    return dropped


def test_cross_split_users_keep_only_their_most_protected_split():
    config = split_protocols.SplitConfig(0.2, 0.2, 0.1, seed=1)
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        outputs = pipeline | beam.Create(_records(60, 3)) | splits.SplitRecords(config)
        assert_that(
            outputs["summary"] | beam.Map(lambda s: s["dropped_cross_split_records"]),
            equal_to([_expected_dropped(config, 60, 3)]),
        )


def test_splits_are_disjoint_by_user_and_identity(tmp_path):
    config = split_protocols.SplitConfig(0.2, 0.2, 0.1, seed=1, max_dropped_fraction=1.0)
    records = _records(users=60, identities_per_user=3)
    source = str(tmp_path / "in")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | records_io.WriteRecords(source)
    summary = splits.run_split(source, str(tmp_path / "out"), config)
    collected = {
        name: [
            r.numpy()
            for r in tf.data.TFRecordDataset(
                tf.io.gfile.glob(records_io.records_pattern(str(tmp_path / "out" / name)))
            )
        ]
        for name in config.splits
    }
    assert summary["records"] == {name: len(v) for name, v in collected.items()}
    sets = {name: _user_and_identity_sets(collected[name]) for name in config.splits}
    for a in config.splits:
        for b in config.splits:
            if a < b:
                assert not sets[a][0] & sets[b][0], (a, b)
                assert not sets[a][1] & sets[b][1], (a, b)
    # Every kept record sits in its identity's split; the rest were dropped.
    for name in config.splits:
        assert all(
            split_protocols.identity_split(schema.parse(r).identity, config) == name
            for r in collected[name]
        )
    assert sum(len(v) for v in collected.values()) + _expected_dropped(config, 60, 3) == len(
        records
    )


def test_public_sources_go_whole_to_the_public_split_apart_from_private_users(tmp_path):
    config = split_protocols.SplitConfig(
        0.2, 0.2, 0.0, seed=1, public_inputs=True, max_dropped_fraction=1.0
    )
    assert config.splits == ("test", "validation", "train", "public")
    private = _records(users=40, identities_per_user=2)
    # Public data from elsewhere, with user and identity names that collide with the
    # private ones (other images): it must neither pull private users into the public
    # split nor be split itself.
    other_png = schema.encode_png(np.full((4, 4), 255, dtype=np.uint8))
    public = [
        schema.serialize(schema.CanonicalRecord(f"u{u}", f"id{u}_{i}", other_png))
        for u in range(10)
        for i in range(3)
    ]
    private_dir, public_dir = str(tmp_path / "private"), str(tmp_path / "public")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = (
            pipeline
            | "Private" >> beam.Create(private)
            | "P" >> records_io.WriteRecords(private_dir)
        )
        _ = pipeline | "Public" >> beam.Create(public) | "Q" >> records_io.WriteRecords(public_dir)
    summary = splits.run_split(
        private_dir, str(tmp_path / "out"), config, public_input_dir=public_dir
    )
    out = {
        name: sorted(
            r.numpy()
            for r in tf.data.TFRecordDataset(
                tf.io.gfile.glob(records_io.records_pattern(str(tmp_path / "out" / name)))
            )
        )
        for name in config.splits
    }
    prefix = split_protocols.PUBLIC_SOURCE_PREFIX
    assert out["public"] == sorted(
        schema.serialize(schema.CanonicalRecord(prefix + r.user_id, prefix + r.identity, r.image))
        for r in map(schema.parse, public)
    )
    # Private records are split exactly as without public sources.
    private_out = [r for name in ("test", "validation", "train") for r in out[name]]
    assert set(private_out) <= set(private)
    assert len(private_out) + _expected_dropped(config, 40, 2) == len(private)
    assert summary["records"]["public"] == len(public) and summary["users"]["public"] == 10


def test_public_inputs_flag_and_public_input_dir_go_together(tmp_path):
    with pytest.raises(ValueError, match="public_input_dir exactly when"):
        splits.run_split(
            str(tmp_path), str(tmp_path / "out"), split_protocols.SplitConfig(public_inputs=True)
        )
    with pytest.raises(ValueError, match="public_input_dir exactly when"):
        splits.run_split(
            str(tmp_path),
            str(tmp_path / "out"),
            split_protocols.SplitConfig(),
            public_input_dir=str(tmp_path),
        )


def _write(records: list[bytes], directory: str) -> str:
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | records_io.WriteRecords(directory)
    return directory


def _read_splits(out_dir, names) -> dict[str, list]:
    return {
        name: [
            schema.parse(r.numpy())
            for r in tf.data.TFRecordDataset(
                tf.io.gfile.glob(records_io.records_pattern(str(out_dir / name)))
            )
        ]
        for name in names
    }


# Handwriting-like: every user holds every identity (4 records each), as EMNIST's writers.
def _shared_records(users: int, identities: int) -> list[bytes]:
    return [
        schema.serialize(schema.CanonicalRecord(f"u{u}", f"c{i}", _PNG + bytes([u, i, n])))
        for u in range(users)
        for i in range(identities)
        for n in range(2)
    ]


def test_identity_mode_keeps_every_record_and_keeps_evaluation_identities_out_of_training(
    tmp_path,
):
    config = split_protocols.SplitConfig(0.2, 0.2, 0.2, seed=3, mode=split_protocols.IDENTITY)
    records = _shared_records(users=30, identities=20)
    summary = splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    out = _read_splits(tmp_path / "out", config.splits)
    assert summary["dropped_records"] == 0 and summary["mode"] == split_protocols.IDENTITY
    assert sum(len(v) for v in out.values()) == len(records) == summary["input_records"]
    identities = {name: {r.identity for r in v} for name, v in out.items()}
    users = {name: {r.user_id for r in v} for name, v in out.items()}
    evaluation = identities["test"] | identities["validation"]
    assert evaluation and not evaluation & (identities["train"] | identities["public"])
    # Users are shared between training and evaluation, with different identities.
    assert users["train"] & users["test"]
    # Public users go whole: none of their training-identity records is private, and no
    # private user has a public record.
    assert users["public"] and not users["public"] & users["train"]
    for r in out["test"] + out["validation"]:
        assert split_protocols.identity_split(r.identity, config) != split_protocols.TRAIN
    # Each training user's count of training identities, known before dedup so that a
    # local head too small for them stops the run here (pipeline CheckTrainingSchedule).
    held = collections.defaultdict(set)
    for r in out["train"]:
        held[r.user_id].add(r.identity)
    expected = collections.Counter(str(len(identities)) for identities in held.values())
    assert summary[splits.TRAIN_IDENTITIES_PER_USER] == dict(expected)


def test_held_out_images_mode_evaluates_held_out_users_on_training_identities(tmp_path):
    config = split_protocols.SplitConfig(
        0.15, 0.2, 0.1, seed=2, mode=split_protocols.HELD_OUT_IMAGES
    )
    records = _shared_records(users=40, identities=10)
    # One identity only a few users hold, none of them in training: not a training
    # identity, so its evaluation records are dropped and counted.
    rare_users = [
        u for u in range(40) if split_protocols.user_split(f"u{u}", config) == split_protocols.TEST
    ][:2]
    records += [
        schema.serialize(schema.CanonicalRecord(f"u{u}", "rare", _PNG + bytes([u])))
        for u in rare_users
    ]
    summary = splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    out = _read_splits(tmp_path / "out", config.splits)
    users = {name: {r.user_id for r in v} for name, v in out.items()}
    for a in config.splits:
        for b in config.splits:
            if a < b:
                assert not users[a] & users[b], (a, b)
    train_identities = {r.identity for r in out["train"]}
    assert {r.identity for r in out["test"] + out["validation"]} <= train_identities
    assert summary["dropped_by_reason"] == {"unseen_identity": 2}
    assert sum(len(v) for v in out.values()) == len(records) - 2
    assert users["test"] and users["validation"] and users["public"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [split_protocols.IDENTITY, split_protocols.HELD_OUT_IMAGES])
def test_shared_synthetic_identities_keep_at_least_90_percent(tmp_path, mode):
    synth = synthetic.SyntheticConfig(
        identities=40,
        images_per_identity=2,
        image_size=8,
        identities_per_user=5,
        users_sharing_identities=60,
    )
    records = [schema.serialize(r) for r in synthetic.records_for_units(synth, 0, synth.units)]
    config = split_protocols.SplitConfig(0.1, 0.15, mode=mode)
    summary = splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    kept = sum(summary["records"].values())
    assert kept >= 0.9 * len(records) and summary["records"]["test"] > 0
    # Eight training users may hold more identities than a local head of one row per
    # user: the pipeline stops right after this split, naming the rows needed, the least
    # of what the 8 users holding the most hold and the training data's identities.
    most_of_eight = partition.most_identities_of_users(
        {partition.IDENTITIES_PER_USER: summary[splits.TRAIN_IDENTITIES_PER_USER]}, 8
    )
    (train,) = _read_splits(tmp_path / "out", ["train"]).values()
    train_identities = len({r.identity for r in train})
    assert summary["identities"][split_protocols.TRAIN] == train_identities
    needed = min(most_of_eight, train_identities)
    assert 8 < needed <= 8 * synth.identities_per_user
    job = job_config.TrainJobConfig(
        rounds=2, users_per_virtual_client=8, virtual_clients_per_round=2, noise_multiplier=1.0
    )
    with pytest.raises(ValueError, match=f"set head_capacity .* at least {needed}$"):
        local_heads.check_split_can_train(dataclasses.replace(job, head_capacity=None), summary)
    local_heads.check_split_can_train(job, summary)  # the default, 64 rows, fits


def test_auto_mode_picks_identity_and_user_for_disjoint_identities(tmp_path):
    records = _records(users=30, identities_per_user=1)
    config = split_protocols.SplitConfig(0.2, 0.2, mode=split_protocols.AUTO)
    summary = splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    assert (
        summary["mode"] == split_protocols.IDENTITY_AND_USER and summary["requested_mode"] == "auto"
    )
    assert summary["dropped_records"] == 0


@pytest.mark.slow
def test_auto_mode_stops_on_shared_identities_naming_each_mode_and_what_it_keeps(tmp_path):
    records = _shared_records(users=20, identities=10)
    config = split_protocols.SplitConfig(0.2, 0.2, mode=split_protocols.AUTO)
    with pytest.raises(split_protocols.SplitRefused) as refused:
        splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    message = str(refused.value)
    assert "\n" not in message and "10 of 10 identities are held by more than one user" in message
    assert "identity keeps 400 of 400 records (100%)" in message
    assert all(mode in message for mode in split_protocols.MODES) and "split.mode" in message
    # Only the check's counts are left: no split folder, records or summary.
    assert sorted(os.listdir(tmp_path / "out")) == [splits.MODE_CHECK_FILE]


def test_a_split_dropping_more_than_the_limit_stops_naming_the_setting(tmp_path):
    # Faces' rule on handwriting-like data: a user keeps one split's identities only.
    records = _shared_records(users=20, identities=10)
    config = split_protocols.SplitConfig(0.2, 0.2, mode=split_protocols.IDENTITY_AND_USER)
    with pytest.raises(
        split_protocols.SplitRefused, match="split.max_dropped_fraction 0.1"
    ) as refused:
        splits.run_split(_write(records, str(tmp_path / "in")), str(tmp_path / "out"), config)
    assert "set split.mode to identity or held_out_images" in str(refused.value)
    # The summary stays for the user to read; no split is left to train on.
    assert (tmp_path / "out" / splits.SUMMARY_FILE).exists()
    for name in config.splits:
        assert not tf.io.gfile.glob(records_io.records_pattern(str(tmp_path / "out" / name)))


def test_evaluation_sources_go_whole_to_test_of_training_identities(tmp_path):
    # Landmarks with a test split of their own: the private users fill train and
    # validation; the evaluation source's users (one named as a private user) fill test.
    config = split_protocols.SplitConfig(
        0.2, 0.0, 0.0, seed=2, mode=split_protocols.HELD_OUT_IMAGES, evaluation_inputs=True
    )
    private = _shared_records(users=20, identities=5)
    evaluation = [
        schema.serialize(schema.CanonicalRecord(user, identity, _PNG + bytes([k, 9])))
        for k, (user, identity) in enumerate(
            [("u0", "c1"), ("t1", "c1"), ("t1", "c2"), ("t2", "c3"), ("t2", "unseen")]
        )
    ]
    summary = splits.run_split(
        _write(private, str(tmp_path / "in")),
        str(tmp_path / "out"),
        config,
        evaluation_input_dir=_write(evaluation, str(tmp_path / "evaluation")),
    )
    out = _read_splits(tmp_path / "out", config.splits)
    assert config.splits == ("test", "validation", "train")
    # Every test record is an evaluation source's, renamed apart from private users, of
    # a training identity; the one of an identity no training user holds is dropped and
    # counted apart from the private records the drop guard compares.
    assert sorted((r.user_id, r.identity) for r in out["test"]) == [
        ("evaluation:t1", "c1"),
        ("evaluation:t1", "c2"),
        ("evaluation:t2", "c3"),
        ("evaluation:u0", "c1"),
    ]
    assert summary["dropped_by_reason"] == {splits.EVALUATION_UNSEEN_IDENTITY: 1}
    assert summary["dropped_records"] == 0 and summary["input_records"] == len(private)
    assert len(out["train"]) + len(out["validation"]) == len(private)
    assert out["validation"] and not {r.user_id for r in out["validation"]} & {
        r.user_id for r in out["train"]
    }


def test_evaluation_inputs_need_held_out_images_and_no_private_test_users(tmp_path):
    with pytest.raises(ValueError, match="evaluation inputs need split mode held_out_images"):
        split_protocols.SplitConfig(
            test_fraction=0.0, mode=split_protocols.IDENTITY, evaluation_inputs=True
        )
    with pytest.raises(ValueError, match="test fraction of the private users must be 0"):
        split_protocols.SplitConfig(mode=split_protocols.HELD_OUT_IMAGES, evaluation_inputs=True)
    config = split_protocols.SplitConfig(
        test_fraction=0.0, mode=split_protocols.HELD_OUT_IMAGES, evaluation_inputs=True
    )
    with pytest.raises(ValueError, match="evaluation_input_dir exactly when"):
        splits.run_split(str(tmp_path), str(tmp_path / "out"), config)

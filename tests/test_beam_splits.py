"""Splits by identity and user: disjointness, determinism, cross-split users."""

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import records_io, schema, splits

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
    config = splits.SplitConfig(0.1, 0.2, 0.05, seed=4)
    assignment = [splits.identity_split(f"id{i}", config) for i in range(20_000)]
    assert assignment == [splits.identity_split(f"id{i}", config) for i in range(20_000)]
    shares = {s: assignment.count(s) / 20_000 for s in config.splits}
    assert abs(shares["test"] - 0.2) < 0.02 and abs(shares["public"] - 0.05) < 0.01
    other = [
        splits.identity_split(f"id{i}", splits.SplitConfig(0.1, 0.2, 0.05, seed=5))
        for i in range(20_000)
    ]
    assert other != assignment


def _expected_dropped(config: splits.SplitConfig, users: int, identities_per_user: int) -> int:
    dropped = 0
    for u in range(users):
        assigned = [splits.identity_split(f"id{u}_{i}", config) for i in range(identities_per_user)]
        user_split = min(assigned, key=splits.SPLIT_PRIORITY.index)
        dropped += sum(split != user_split for split in assigned)
    return dropped


def test_cross_split_users_keep_only_their_most_protected_split():
    config = splits.SplitConfig(0.2, 0.2, 0.1, seed=1)
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        outputs = pipeline | beam.Create(_records(60, 3)) | splits.SplitByIdentityAndUser(config)
        assert_that(
            outputs["summary"] | beam.Map(lambda s: s["dropped_cross_split_records"]),
            equal_to([_expected_dropped(config, 60, 3)]),
        )


def test_splits_are_disjoint_by_user_and_identity(tmp_path):
    config = splits.SplitConfig(0.2, 0.2, 0.1, seed=1)
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
            splits.identity_split(schema.parse(r).identity, config) == name for r in collected[name]
        )
    assert sum(len(v) for v in collected.values()) + _expected_dropped(config, 60, 3) == len(
        records
    )


def test_public_sources_go_whole_to_the_public_split_apart_from_private_users(tmp_path):
    config = splits.SplitConfig(0.2, 0.2, 0.0, seed=1, public_inputs=True)
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
    prefix = splits.PUBLIC_SOURCE_PREFIX
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
            str(tmp_path), str(tmp_path / "out"), splits.SplitConfig(public_inputs=True)
        )
    with pytest.raises(ValueError, match="public_input_dir exactly when"):
        splits.run_split(
            str(tmp_path),
            str(tmp_path / "out"),
            splits.SplitConfig(),
            public_input_dir=str(tmp_path),
        )

"""Splits by identity and user: disjointness, determinism, cross-split users."""

import apache_beam as beam
import numpy as np
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

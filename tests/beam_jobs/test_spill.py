"""Spill files: records cross a shuffle as files and come back whole and in order, the
grouped references hold 8 bytes per record, and split removes its spill folder."""

import os

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from beam_jobs import records_io, schema, spill, split_protocols, splits

_PNG = schema.encode_png(np.zeros((4, 4), dtype=np.uint8))


def _as_grouped(key_records: tuple[str, list[bytes]]):
    key, records = key_records
    yield key, records


def test_records_grouped_by_key_come_back_in_order_and_only_references_are_grouped(tmp_path):
    spill_dir = str(tmp_path / spill.SPILL_DIR)
    # Large records: what is grouped must not grow with them.
    keyed = [(f"u{i % 3}", bytes([i]) * 5000) for i in range(12)]
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        grouped = (
            pipeline
            | beam.Create(keyed, reshuffle=False)
            | spill.SpillByKey(spill_dir)
            | beam.GroupByKey()
        )
        assert_that(
            grouped
            | "ReferenceBytes"
            >> beam.MapTuple(lambda key, refs: (key, sum(len(packed) for _, packed in refs))),
            equal_to([(f"u{u}", 4 * 8) for u in range(3)]),
            label="Sizes",
        )
        back = grouped | beam.ParDo(spill.WithSpilledRecords(spill_dir, _as_grouped))
        expected = [(f"u{u}", [r for k, r in keyed if k == f"u{u}"]) for u in range(3)]
        assert_that(back, equal_to(expected), label="Records")


def test_run_split_removes_its_spill_folder(tmp_path):
    records = [
        schema.serialize(schema.CanonicalRecord(f"u{u}", f"id{u}", _PNG + bytes([n])))
        for u in range(20)
        for n in range(2)
    ]
    source = str(tmp_path / "in")
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | records_io.WriteRecords(source)
    out = tmp_path / "out"
    summary = splits.run_split(
        source, str(out), split_protocols.SplitConfig(0.2, 0.2, mode=split_protocols.AUTO)
    )
    assert sum(summary["records"].values()) == len(records)
    assert not os.path.exists(out / spill.SPILL_DIR)
    assert sorted(os.listdir(out)) == sorted(
        [*summary["records"], splits.SUMMARY_FILE, splits.MODE_CHECK_FILE]
    )

"""Records/s of the Beam jobs (DirectRunner) vs a plain single-process loop.

Same data and same per-record work on both sides: synthetic faces-like users (one
identity, one image each), ingested from an image folder, partitioned by user, and
deduplicated (train vs validation+test). The plain dedup is the Beam job's own batch
steps (beam_jobs/dedup_batches.py) called in a loop with dicts for the groupings: it reads
the split files and writes the kept training records, as the Beam job does.
`run(out_dir, quick)` returns the figures (bench.run_all writes them); quick runs 10^4
users only, the full run adds 10^5 (about 10 minutes on 2 cores).
"""

import collections
import dataclasses
import os
import shutil
import tempfile
import time

import tensorflow as tf
from apache_beam import pvalue

from beam_jobs import (
    dedup,
    dedup_verification,
    ingest,
    partition,
    partition_job,
    records_io,
    schema,
    split_protocols,
    synthetic,
)
from beam_jobs import dedup_batches as batches
from beam_jobs import near_duplicates as nd

# Dedup at 10^5 images of one synthetic population: wider bands, no shift probes and no
# flipped bits keep the candidate pairs near-linear (with the default's narrower bands,
# pairs whose hashes share a band grow with the product of the sides on such uniform
# data; see BENCHMARKS.md). Verification is the default's.
_DEDUP_CONFIG = dedup.DedupConfig(num_bands=16, bits_per_band=20, max_shift=0, flipped_bits=0)
_SPLIT_CONFIG = split_protocols.SplitConfig(0.1, 0.1, seed=0)
_NUM_SHARDS = 16


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _plain_ingest(root: str, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(out_dir, "records-00000-of-00001.tfrecord")) as writer:
        for user_id in sorted(os.listdir(root)):
            for identity in sorted(os.listdir(os.path.join(root, user_id))):
                folder = os.path.join(root, user_id, identity)
                for name in sorted(os.listdir(folder)):
                    with open(os.path.join(folder, name), "rb") as f:
                        record = schema.CanonicalRecord(user_id, identity, f.read())
                    schema.validate(record)
                    writer.write(schema.serialize(record))


def _read_records(directory: str) -> list[bytes]:
    files = tf.io.gfile.glob(records_io.records_pattern(directory))
    return [r.numpy() for r in tf.data.TFRecordDataset(files)]


def _plain_partition(records: list[bytes], out_dir: str) -> None:
    os.makedirs(os.path.join(out_dir, partition.INDEX_DIR), exist_ok=True)
    by_shard = collections.defaultdict(list)
    for serialized in records:
        user_id = schema.parse(serialized).user_id
        by_shard[partition.shard_of_user(user_id, _NUM_SHARDS)].append((user_id, serialized))
    for shard, items in by_shard.items():
        partition.write_shard(out_dir, shard, items, 64 << 20)


def _grouped(pairs) -> dict:
    groups = collections.defaultdict(list)
    for key, value in pairs:
        groups[key].append(value)
    return groups


def _plain_dedup(split_dir: str, out_dir: str) -> int:
    """run_dedup's train-vs-evaluation work without Beam: the same batch steps, in a loop."""
    config = _DEDUP_CONFIG
    records = {
        s: _read_records(os.path.join(split_dir, s))
        for s in ("train", *split_protocols.EVALUATION_SPLITS)
    }
    sides = {batches.CANDIDATE: [], batches.REFERENCE: []}
    for name, items in records.items():
        side = batches.CANDIDATE if name == "train" else batches.REFERENCE
        for start in range(0, len(items), 1024):
            sides[side].append(batches.fingerprints(items[start : start + 1024], config.max_shift))
    sizes = {side: sum(len(fp) for fp in fps) for side, fps in sides.items()}
    probed = (
        batches.CANDIDATE
        if sizes[batches.CANDIDATE] < sizes[batches.REFERENCE]
        else batches.REFERENCE
    )
    bands = nd.band_bits(config.num_bands, config.bits_per_band)
    entries = _grouped(
        entry
        for side, fps in sides.items()
        for fp in fps
        for entry in batches.bucket_entries(
            fp, side, probed, config.max_shift, config.flipped_bits, bands
        )
    )
    close, removed = [], collections.defaultdict(list)
    for joined in entries.items():
        for out in batches.join_bucket(
            joined, config.hamming_threshold, config.references_verified
        ):
            if not isinstance(out, pvalue.TaggedOutput):
                close.append(out)
            elif out.tag == batches.EXACT_PAIRS:
                removed[out.value[0]].append(out.value[1])
    requests = _grouped(
        request
        for grouped in _grouped(close).items()
        for request in batches.closest_references(grouped, config.references_verified)
    )
    by_key = {side: {fp.key: fp for fp in fps} for side, fps in sides.items()}
    attached = _grouped(
        reference
        for key, asked in requests.items()
        for reference in batches.attach_references(
            (key, {"fp": [by_key[batches.REFERENCE][key]], "request": asked})
        )
    )
    for key, references in attached.items():
        joined = (key, {"fp": [by_key[batches.CANDIDATE][key]], "references": references})
        for record, pair in dedup_verification.verified_pairs(joined, config):
            removed[record].append(pair)
    kept = 0
    for name, items in records.items():  # as run_dedup: train filtered, the rest copied
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        path = os.path.join(out_dir, name, "records-00000-of-00001.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for serialized in items:
                if name != "train" or batches.record_id(serialized) not in removed:
                    writer.write(serialized)
                    kept += name == "train"
    return kept


def _write_split(records: list[bytes], split_dir: str) -> None:
    by_split = collections.defaultdict(list)
    for serialized in records:
        by_split[
            split_protocols.identity_split(schema.parse(serialized).identity, _SPLIT_CONFIG)
        ].append(serialized)
    for name, items in by_split.items():
        os.makedirs(os.path.join(split_dir, name), exist_ok=True)
        with tf.io.TFRecordWriter(
            os.path.join(split_dir, name, "records-00000-of-00001.tfrecord")
        ) as writer:
            for serialized in items:
                writer.write(serialized)


def _bench_size(users: int, work_dir: str) -> dict:
    config = synthetic.SyntheticConfig(identities=users, images_per_identity=1, seed=0)
    raw = os.path.join(work_dir, "raw")
    synthetic.write_image_folder(raw, config)
    result = {"users": users, "records": users}

    beam_ingest = _timed(ingest.run_ingest, [raw], os.path.join(work_dir, "ingested"))
    plain_ingest = _timed(_plain_ingest, raw, os.path.join(work_dir, "plain_ingested"))
    records = _read_records(os.path.join(work_dir, "ingested"))

    beam_partition = _timed(
        partition_job.run_partition,
        os.path.join(work_dir, "ingested"),
        os.path.join(work_dir, "part"),
        _NUM_SHARDS,
    )
    plain_partition = _timed(_plain_partition, records, os.path.join(work_dir, "plain_part"))

    _write_split(records, os.path.join(work_dir, "split"))
    beam_dedup = _timed(
        dedup.run_dedup,
        os.path.join(work_dir, "split"),
        os.path.join(work_dir, "dedup"),
        _DEDUP_CONFIG,
    )
    plain_dedup = _timed(
        _plain_dedup, os.path.join(work_dir, "split"), os.path.join(work_dir, "plain_dedup")
    )

    for job, beam_seconds, plain_seconds in (
        ("ingest", beam_ingest, plain_ingest),
        ("partition", beam_partition, plain_partition),
        ("dedup", beam_dedup, plain_dedup),
    ):
        result[job] = {
            "beam_direct_records_per_s": round(users / beam_seconds, 1),
            "plain_loop_records_per_s": round(users / plain_seconds, 1),
            "beam_seconds": round(beam_seconds, 2),
            "plain_seconds": round(plain_seconds, 2),
        }
    return result


def run(out_dir: str, quick: bool) -> dict:
    sizes = (10_000,) if quick else (10_000, 100_000)
    results = {
        "runner": records_io.DEFAULT_RUNNER,
        "dedup_config": dataclasses.asdict(_DEDUP_CONFIG),
        "sizes": [],
    }
    for users in sizes:
        work_dir = tempfile.mkdtemp(prefix=f"bench_beam_{users}_")
        try:
            results["sizes"].append(_bench_size(users, work_dir))
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return results

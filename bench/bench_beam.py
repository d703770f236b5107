"""Records/s of the Beam jobs (DirectRunner) vs a plain single-process loop.

Same data and same per-record work on both sides: synthetic faces-like users (one
identity, one image each), ingested from an image folder, partitioned by user, and
deduplicated (train vs validation+test). `run(out_dir, quick)` writes out_dir/beam.json;
quick runs 10^4 users only, the full run adds 10^5 (about 10 minutes on 2 cores).
"""

import collections
import dataclasses
import json
import os
import shutil
import tempfile
import time

import tensorflow as tf

from beam_jobs import dedup, ingest, partition, records_io, schema, splits, synthetic

# Dedup at 10^5 images: wider bands keep the candidate pairs near-linear, and no shift
# probes (each probe multiplies the reference side); see beam_jobs/dedup.py.
_DEDUP_CONFIG = dedup.DedupConfig(num_bands=16, bits_per_band=24, max_shift=0)
_SPLIT_CONFIG = splits.SplitConfig(0.1, 0.1, seed=0)
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
    write_shard = partition._WriteShardFn(out_dir, 64 << 20)
    for shard, items in by_shard.items():
        list(write_shard.process((shard, items)))


def _plain_dedup(train: list[bytes], evaluation: list[bytes]) -> int:
    config = _DEDUP_CONFIG
    band_bits, hash_bits = config.band_bits(), config.hash_size**2
    exact, bands = set(), collections.defaultdict(list)
    for serialized in evaluation:
        fp = dedup.fingerprint(serialized, config, True)
        exact.add(fp.pixel_sha256)
        for phash in fp.phashes:
            for key in dedup._band_keys(phash, band_bits, hash_bits):
                bands[key].append(phash)
    kept = 0
    for serialized in train:
        fp = dedup.fingerprint(serialized, config, False)
        near = any(
            (fp.phashes[0] ^ other).bit_count() <= config.hamming_threshold
            for key in dedup._band_keys(fp.phashes[0], band_bits, hash_bits)
            for other in bands.get(key, ())
        )
        kept += fp.pixel_sha256 not in exact and not near
    return kept


def _write_split(records: list[bytes], split_dir: str) -> dict[str, list[bytes]]:
    by_split = collections.defaultdict(list)
    for serialized in records:
        by_split[splits.identity_split(schema.parse(serialized).identity, _SPLIT_CONFIG)].append(
            serialized
        )
    for name, items in by_split.items():
        os.makedirs(os.path.join(split_dir, name), exist_ok=True)
        with tf.io.TFRecordWriter(
            os.path.join(split_dir, name, "records-00000-of-00001.tfrecord")
        ) as writer:
            for serialized in items:
                writer.write(serialized)
    return by_split


def _bench_size(users: int, work_dir: str) -> dict:
    config = synthetic.SyntheticConfig(identities=users, images_per_identity=1, seed=0)
    raw = os.path.join(work_dir, "raw")
    synthetic.write_image_folder(raw, config)
    result = {"users": users, "records": users}

    beam_ingest = _timed(ingest.run_ingest, [raw], os.path.join(work_dir, "ingested"))
    plain_ingest = _timed(_plain_ingest, raw, os.path.join(work_dir, "plain_ingested"))
    records = _read_records(os.path.join(work_dir, "ingested"))

    beam_partition = _timed(
        partition.run_partition,
        os.path.join(work_dir, "ingested"),
        os.path.join(work_dir, "part"),
        _NUM_SHARDS,
    )
    plain_partition = _timed(_plain_partition, records, os.path.join(work_dir, "plain_part"))

    by_split = _write_split(records, os.path.join(work_dir, "split"))
    evaluation = by_split[splits.VALIDATION] + by_split[splits.TEST]
    beam_dedup = _timed(
        dedup.run_dedup,
        os.path.join(work_dir, "split"),
        os.path.join(work_dir, "dedup"),
        _DEDUP_CONFIG,
    )
    plain_dedup = _timed(_plain_dedup, by_split[splits.TRAIN], evaluation)

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
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "beam.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    import sys

    print(
        json.dumps(
            run(sys.argv[1] if len(sys.argv) > 1 else "bench_results", quick="--quick" in sys.argv),
            indent=2,
        )
    )

"""Peak memory and images/s of the data jobs at 10^4-10^6 users (issue 41 item 2).

Each stage runs as its own process, the way a user runs it (`dp-fedemb data VERB`, the
DirectRunner), on faces-like users (one identity each, 4 images, 28×28): synth (image
folder), ingest (image folder → canonical TFRecords), split (mode auto, the CLI's
default), dedup (train vs validation+test; CLI defaults and --max-shift 0) and
partition (the train split by user, 16 shards). A parent thread sums the RSS of the
stage's whole process tree (psutil, every 0.2 s); CPU seconds are the stage's
user+system time, its reaped descendants' included (wait4). Images/s = images in / wall s.

Sizes: 10^4 users rendered by synth; 10^5 users as 10 pixel variants (`_VARIANTS`) of the
10^4 users' images, renamed, so all 4×10^5 images are distinct (rendering them took
longer than this machine's time allowed); dedup up to 10^4 users only (BENCHMARKS.md says
why); the 10^6-user row is partition alone, of canonical TFRecords holding the 10^4
users' records under 100 renamed copies (`_replicated_records`): partition never looks
at the pixels, and each record keeps its bytes. `run(out_dir, quick)` returns the
figures (quick: 500 users, no large rows); `main` runs the large rows alone.
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from beam_jobs import records_io, schema
from bench import process_tree_memory

IMAGES_PER_USER = 4
_DEDUP_MAX_USERS = 10_000
_DP_FEDEMB = os.path.join(os.path.dirname(sys.executable), "dp-fedemb")


def run_stage(verb: str, flags: list[str], images: int, log_path: str) -> dict:
    """Runs `dp-fedemb data VERB FLAGS` as a child; its wall s, CPU s and tree peak RSS."""
    load_start = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen([_DP_FEDEMB, "data", verb, *flags], stdout=log, stderr=log)
        with process_tree_memory.PeakRss(child.pid) as peak:
            # wait4: the child's own rusage, its reaped descendants' included.
            _, status, usage = os.wait4(child.pid, 0)
        child.returncode = code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if code != 0:
        with open(log_path) as log:
            tail = log.read()[-2000:]
        raise RuntimeError(f"dp-fedemb data {verb} exited {code}:\n{tail}")
    cpu = usage.ru_utime + usage.ru_stime
    return {
        "stage": verb,
        "images": images,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "images_per_s": round(images / wall, 1),
        "peak_tree_rss_mib": round(peak.bytes / 2**20, 1),
        # The largest single process of the tree (ru_maxrss, KiB on Linux).
        "peak_process_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "processes_seen": peak.processes,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def _replicated_records(source_dir: str, out_dir: str, copies: int) -> int:
    """SOURCE's records under `copies` renamed users and identities, one shard per copy,
    streamed (nothing held but one record); returns the number written."""
    tf.io.gfile.makedirs(out_dir)
    files = tf.io.gfile.glob(records_io.records_pattern(source_dir))
    writers = [
        tf.io.TFRecordWriter(os.path.join(out_dir, f"records-{c:05d}-of-{copies:05d}.tfrecord"))
        for c in range(copies)
    ]
    written = 0
    for serialized in tf.data.TFRecordDataset(files).as_numpy_iterator():
        record = schema.parse(serialized)
        for copy, writer in enumerate(writers):
            renamed = dataclasses.replace(
                record,
                user_id=f"{record.user_id}-c{copy}",
                identity=f"{record.identity}-c{copy}",
            )
            writer.write(schema.serialize(renamed))
            written += 1
    for writer in writers:
        writer.close()
    return written


# Pixel variants of an image that dedup's hashes do not equate (no flip or rotation
# invariance): copy k of a user's images is variant k.
_VARIANTS = (
    lambda p: p,
    np.fliplr,
    np.flipud,
    lambda p: np.rot90(p, 2),
    np.transpose,
    np.rot90,
    lambda p: np.rot90(p, 3),
    lambda p: np.rot90(p, 2).T,
    lambda p: 255 - p,
    lambda p: 255 - np.fliplr(p),
)


def _variant_image_folder(ingested_dir: str, out_dir: str, copies: int) -> int:
    """An image folder of `copies` renamed copies of INGESTED's users, copy k's images
    transformed by `_VARIANTS[k]`, so that all are distinct images; streamed. Returns
    the number of images written."""
    files = tf.io.gfile.glob(records_io.records_pattern(ingested_dir))
    written, per_identity = 0, {}
    for serialized in tf.data.TFRecordDataset(files).as_numpy_iterator():
        record = schema.parse(serialized)
        pixels = schema.decode_validated_image(record.image)
        index = per_identity.get(record.identity, 0)
        per_identity[record.identity] = index + 1
        for copy in range(copies):
            folder = os.path.join(
                out_dir,
                schema.path_component(f"{record.user_id}-v{copy}"),
                schema.path_component(f"{record.identity}-v{copy}"),
            )
            os.makedirs(folder, exist_ok=True)
            variant = np.ascontiguousarray(_VARIANTS[copy](pixels))
            with open(os.path.join(folder, f"{index}.png"), "wb") as f:
                f.write(schema.encode_png(variant))
            written += 1
    return written


def _all_split_images(split_dir: str) -> int:
    return sum(
        records_io.count_records(os.path.join(split_dir, name))
        for name in ("train", "validation", "test")
    )


_STARTS_FROM = {
    "synth": "nothing (renders the images)",
    "ingest": "image folder of PNG files",
    "split": "canonical TFRecords (ingest's output)",
    "dedup": "split directory (split's output)",
    "partition": "train split (deduplicated up to 10^4 users)",
}


def bench_image_folder(
    users: int, work_dir: str, variants_of: str | None = None
) -> tuple[list[dict], str]:
    """synth, ingest, split, dedup, partition of USERS users; rows and the ingested dir.

    `variants_of`: an ingested directory whose users' images, in `_VARIANTS`, make the
    image folder instead of synth (module docstring).

    Dedup runs up to `_DEDUP_MAX_USERS` users, at the CLI's defaults and with --max-shift
    0; partition then reads the --max-shift 0 dedup's train split, else the split's
    (BENCHMARKS.md: dedup held 1.4 GB more than the process's 0.6 GB at 10^4 users, and
    grows with them, so 10^5 users do not fit beside the other jobs of this machine).
    """
    os.makedirs(work_dir, exist_ok=True)
    images = users * IMAGES_PER_USER
    path = {
        name: os.path.join(work_dir, name)
        for name in ("raw", "ingested", "split", "dedup", "dedup_no_shift", "part")
    }

    def stage(verb: str, flags: list[str], count: int, label: str = "") -> dict:
        row = run_stage(verb, flags, count, os.path.join(work_dir, f"{verb}{label}.log"))
        print(f"bench_data_scale: {users} users {verb}{label}: {row}", flush=True)
        return {"users": users, "starts_from": _STARTS_FROM[verb], "flags": label, **row}

    synth_flags = [f"--identities={users}", f"--images-per-identity={IMAGES_PER_USER}"]
    if variants_of is None:
        rows = [stage("synth", [f"--out={path['raw']}", *synth_flags], images)]
    else:
        copies = users // (records_io.count_records(variants_of) // IMAGES_PER_USER)
        if _variant_image_folder(variants_of, path["raw"], copies) != images:
            raise ValueError(f"{variants_of} does not hold {images // copies} images")
        rows = []
    rows += [
        stage("ingest", [f"--input={path['raw']}", f"--out={path['ingested']}"], images),
        stage("split", [f"--input={path['ingested']}", f"--out={path['split']}"], images),
    ]
    if variants_of is not None:
        for row in rows:
            row["starts_from"] += f" ({copies} pixel variants of {users // copies} users)"
    shutil.rmtree(path["raw"], ignore_errors=True)
    split_images = _all_split_images(path["split"])
    train_dir = os.path.join(path["split"], "train")
    if users <= _DEDUP_MAX_USERS:
        rows.append(
            stage("dedup", [f"--input={path['split']}", f"--out={path['dedup']}"], split_images)
        )
        no_shift = [f"--input={path['split']}", f"--out={path['dedup_no_shift']}", "--max-shift=0"]
        rows.append(stage("dedup", no_shift, split_images, " --max-shift=0"))
        train_dir = os.path.join(path["dedup_no_shift"], "train")
    rows.append(
        stage(
            "partition",
            [f"--input={train_dir}", f"--out={path['part']}"],
            records_io.count_records(train_dir),
        )
    )
    return rows, path["ingested"]


def bench_replicated(
    ingested_dir: str, copies: int, work_dir: str, verb: str = "partition"
) -> list[dict]:
    """`verb` (partition or split; neither looks at pixels) of `copies` renamed copies of
    INGESTED's records (module docstring)."""
    os.makedirs(work_dir, exist_ok=True)
    source = os.path.join(work_dir, "replicated")
    images = _replicated_records(ingested_dir, source, copies)
    users = images // IMAGES_PER_USER
    row = run_stage(
        verb,
        [f"--input={source}", f"--out={os.path.join(work_dir, verb)}"],
        images,
        os.path.join(work_dir, f"{verb}.log"),
    )
    print(f"bench_data_scale: {users} users {verb}: {row}", flush=True)
    starts_from = (
        f"canonical TFRecords: {copies} renamed copies of {users // copies} users' records"
    )
    return [{"users": users, "starts_from": starts_from, **row}]


def bench_large(ingested_10k: str, work_dir: str, parts: str = "both") -> list[dict]:
    """The 10^5-user chain on pixel variants of 10^4 users ("variants"), the 10^6-user
    partition of their renamed copies ("replicated"), or both; or the 10^6-user split
    of those copies alone ("replicated-split")."""
    rows = []
    if parts in ("variants", "both"):
        users = 10 * records_io.count_records(ingested_10k) // IMAGES_PER_USER
        rows += bench_image_folder(users, os.path.join(work_dir, "large"), ingested_10k)[0]
    if parts in ("replicated", "both"):
        rows += bench_replicated(ingested_10k, 100, os.path.join(work_dir, "replicated"))
    if parts == "replicated-split":
        rows += bench_replicated(ingested_10k, 100, os.path.join(work_dir, "replicated"), "split")
    return rows


def bench_split_dedup(ingested_10k: str, users: int, work_dir: str) -> list[dict]:
    """split (mode auto) and dedup (defaults) alone, of USERS users: the 10^4 users'
    ingested records, or more users as their pixel variants, ingested first into
    WORK_DIR/ingested (its row included; kept, so that old and new code can be measured
    on one input). The outputs stay under WORK_DIR, for comparing them."""
    os.makedirs(work_dir, exist_ok=True)
    base_users = records_io.count_records(ingested_10k) // IMAGES_PER_USER
    ingested, rows = ingested_10k, []
    if users != base_users:
        ingested = os.path.join(work_dir, "ingested")
        if not tf.io.gfile.exists(ingested):
            raw = os.path.join(work_dir, "raw")
            images = _variant_image_folder(ingested_10k, raw, users // base_users)
            log = os.path.join(work_dir, "ingest.log")
            rows.append(run_stage("ingest", [f"--input={raw}", f"--out={ingested}"], images, log))
            shutil.rmtree(raw, ignore_errors=True)
    images = records_io.count_records(ingested)
    split, deduplicated = os.path.join(work_dir, "split"), os.path.join(work_dir, "dedup")
    for verb, flags, count in (
        ("split", [f"--input={ingested}", f"--out={split}"], images),
        ("dedup", [f"--input={split}", f"--out={deduplicated}"], None),
    ):
        count = _all_split_images(split) if count is None else count
        rows.append(run_stage(verb, flags, count, os.path.join(work_dir, f"{verb}.log")))
    for row in rows:
        row["users"] = users
        print(f"bench_data_scale: {users} users: {row}", flush=True)
    return rows


def run(out_dir: str, quick: bool) -> dict:
    results = {"images_per_user": IMAGES_PER_USER, "rows": []}
    work_dir = tempfile.mkdtemp(prefix="bench_data_scale_")
    try:
        rows, ingested = bench_image_folder(500 if quick else 10_000, work_dir)
        results["rows"] += rows
        if not quick:
            results["rows"] += bench_large(ingested, work_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """The 10^5- and 10^6-user rows alone, from the 10^4 users' ingested records; or with
    --parts split-dedup, split and dedup alone at --users users, in --work-dir (kept)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--ingested-10k", required=True, help="ingested records of 10^4 users")
    parser.add_argument("--out-json", required=True)
    parser.add_argument(
        "--parts",
        choices=("variants", "replicated", "both", "replicated-split", "split-dedup"),
        default="both",
    )
    parser.add_argument("--users", type=int, default=10_000, help="split-dedup: users")
    parser.add_argument("--work-dir", help="split-dedup: where its inputs and outputs stay")
    args = parser.parse_args(argv)
    if args.parts == "split-dedup":
        if not args.work_dir:
            parser.error("--parts split-dedup needs --work-dir")
        rows = bench_split_dedup(args.ingested_10k, args.users, args.work_dir)
        with open(args.out_json, "w") as f:
            json.dump({"images_per_user": IMAGES_PER_USER, "rows": rows}, f, indent=2)
        return 0
    work_dir = tempfile.mkdtemp(prefix="bench_data_scale_large_")
    try:
        rows = bench_large(args.ingested_10k, work_dir, args.parts)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    with open(args.out_json, "w") as f:
        json.dump({"images_per_user": IMAGES_PER_USER, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

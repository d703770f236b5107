"""Peak memory and images/s of the data jobs at 10^4-10^6 users (issue 41 item 2).

Each stage runs as its own process, the way a user runs it (`dp-fedemb data VERB`, the
DirectRunner), on synthetic faces-like users (one identity each, 4 images, 28×28):
synth (image folder), ingest (image folder → canonical TFRecords), split (mode auto,
as the CLI's default), dedup (train vs validation+test, the CLI's default thresholds)
and partition (the deduplicated train split by user, 16 shards). A parent thread sums
the RSS of the stage's whole process tree (psutil, every 0.2 s); CPU seconds are the
stage's user+system time, its reaped descendants' included (wait4). Images/s = images in / wall s.

The 10^6-user rows run split and partition only, from canonical TFRecords made of the
10^5 users' ingested records under 10 renamed copies (`_replicated_records`): split and
partition never look at the pixels, and each record keeps its bytes. Rendering,
ingesting and deduplicating 4×10^6 images does not fit this machine's time (BENCHMARKS.md
says the rates). `run(out_dir, quick)` returns the figures; quick runs 500 users.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import tensorflow as tf

from beam_jobs import records_io, schema

IMAGES_PER_USER = 4
_SAMPLE_S = 0.2
_REPLICAS = 10
_DP_FEDEMB = os.path.join(os.path.dirname(sys.executable), "dp-fedemb")


def _tree_rss(process: psutil.Process) -> tuple[int, int]:
    """(bytes resident in the process and all its descendants, number of processes)."""
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.NoSuchProcess:
            pass  # ended between the listing and the reading
    return total, len(members)


@dataclasses.dataclass
class _Peak:
    rss: int = 0
    processes: int = 0


def _sample(pid: int, peak: _Peak, done: threading.Event) -> None:
    process = psutil.Process(pid)
    while not done.is_set():
        rss, processes = _tree_rss(process)
        peak.rss = max(peak.rss, rss)
        peak.processes = max(peak.processes, processes)
        done.wait(_SAMPLE_S)


def run_stage(verb: str, flags: list[str], images: int, log_path: str) -> dict:
    """Runs `dp-fedemb data VERB FLAGS` as a child; its wall s, CPU s and tree peak RSS."""
    load_start = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen([_DP_FEDEMB, "data", verb, *flags], stdout=log, stderr=log)
        peak, done = _Peak(), threading.Event()
        sampler = threading.Thread(target=_sample, args=(child.pid, peak, done), daemon=True)
        sampler.start()
        # wait4: the child's own rusage, its reaped descendants' included.
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = code = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
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
        "peak_tree_rss_mib": round(peak.rss / 2**20, 1),
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


def _train_images(split_dir: str) -> int:
    return records_io.count_records(os.path.join(split_dir, "train"))


def _all_split_images(split_dir: str) -> int:
    return sum(
        records_io.count_records(os.path.join(split_dir, name))
        for name in ("train", "validation", "test")
    )


def bench_image_folder(users: int, work_dir: str) -> tuple[list[dict], str]:
    """synth, ingest, split, dedup, partition of USERS users; rows and the ingested dir."""
    images = users * IMAGES_PER_USER
    paths = {name: os.path.join(work_dir, name) for name in ("raw", "ingested", "split")}
    paths |= {"dedup": os.path.join(work_dir, "dedup"), "part": os.path.join(work_dir, "part")}

    def stage(verb: str, flags: list[str], count: int) -> dict:
        row = run_stage(verb, flags, count, os.path.join(work_dir, f"{verb}.log"))
        print(f"bench_data_scale: {users} users {verb}: {row}", flush=True)
        return {"users": users, "starts_from": _STARTS_FROM[verb], **row}

    rows = [
        stage(
            "synth",
            [
                f"--out={paths['raw']}",
                f"--identities={users}",
                f"--images-per-identity={IMAGES_PER_USER}",
            ],
            images,
        ),
        stage("ingest", [f"--input={paths['raw']}", f"--out={paths['ingested']}"], images),
        stage("split", [f"--input={paths['ingested']}", f"--out={paths['split']}"], images),
    ]
    rows.append(
        stage(
            "dedup",
            [f"--input={paths['split']}", f"--out={paths['dedup']}"],
            _all_split_images(paths["split"]),
        )
    )
    train_dir = os.path.join(paths["dedup"], "train")
    rows.append(
        stage(
            "partition",
            [f"--input={train_dir}", f"--out={paths['part']}"],
            records_io.count_records(train_dir),
        )
    )
    shutil.rmtree(paths["raw"], ignore_errors=True)
    return rows, paths["ingested"]


_STARTS_FROM = {
    "synth": "nothing (renders the images)",
    "ingest": "image folder of PNG files",
    "split": "canonical TFRecords (ingest's output)",
    "dedup": "split directory (split's output)",
    "partition": "deduplicated train split",
}


def bench_replicated(ingested_dir: str, copies: int, users: int, work_dir: str) -> list[dict]:
    """split and partition of `copies` renamed copies of INGESTED (module docstring)."""
    source = os.path.join(work_dir, "replicated")
    images = _replicated_records(ingested_dir, source, copies)
    split_dir, part_dir = os.path.join(work_dir, "split"), os.path.join(work_dir, "part")
    rows = []
    for verb, flags, count, starts_from in (
        (
            "split",
            [f"--input={source}", f"--out={split_dir}"],
            images,
            f"canonical TFRecords: {copies} renamed copies of the {users // copies} users' records",
        ),
        (
            "partition",
            [f"--input={os.path.join(split_dir, 'train')}", f"--out={part_dir}"],
            None,
            "the train split (no dedup at this size)",
        ),
    ):
        if count is None:
            count = _train_images(split_dir)
        row = run_stage(verb, flags, count, os.path.join(work_dir, f"{verb}.log"))
        print(f"bench_data_scale: {users} users {verb}: {row}", flush=True)
        rows.append({"users": users, "starts_from": starts_from, **row})
    return rows


def run(out_dir: str, quick: bool) -> dict:
    sizes = (500,) if quick else (10_000, 100_000)
    results = {"images_per_user": IMAGES_PER_USER, "rows": []}
    ingested_largest = None
    keep = tempfile.mkdtemp(prefix="bench_data_scale_")
    try:
        for users in sizes:
            work_dir = tempfile.mkdtemp(prefix=f"users_{users}_", dir=keep)
            rows, ingested = bench_image_folder(users, work_dir)
            results["rows"] += rows
            ingested_largest = ingested
        if not quick:
            work_dir = tempfile.mkdtemp(prefix="users_replicated_", dir=keep)
            results["rows"] += bench_replicated(
                ingested_largest, _REPLICAS, sizes[-1] * _REPLICAS, work_dir
            )
    finally:
        shutil.rmtree(keep, ignore_errors=True)
    return results

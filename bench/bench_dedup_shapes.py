"""Dedup's time per image on three data shapes, side by side in one run (issue 66).

Each shape is a split folder (train, validation, test) of the same number of 28x28
images, deduplicated by `beam_jobs.dedup.run_dedup` with the default config and the
DirectRunner, as `dp-fedemb data dedup` and the pipeline's DeduplicateSplits run it:

- `photos`: the default synthetic data (`beam_jobs.synthetic`, photo style), one
  identity per user, 4 images each; evaluation identities are other identities.
- `characters`: real glyphs, written as bench/character_writers.py writes them: user u
  writes in font u mod 20 of the Latin fonts matplotlib ships (the same files as
  Debian's fonts-dejavu-core and fonts-stix) 8 of the 62 characters, one render each
  (bench/rendered_images.render: its own pose, blur, ink, paper and noise). Every
  character is held by many users, and the evaluation users write the same characters
  in the same fonts: every candidate has look-alikes on the other side.
- `icons`: matplotlib's toolbar icons and DejaVu Sans pictographs
  (bench/rendered_images' icons, 30 shapes), user u holding 4 renders of icon u mod 30:
  again many users per shape on both sides.

Every fifth user is an evaluation user (validation and test alternate). No image is a
copy of another, so whatever dedup removes is a false removal (`removed`).

    python -m bench.bench_dedup_shapes [--images 2000] [--out-json PATH]

`run(out_dir, quick)` returns the figures (bench.run_all writes them); quick uses 1,000
images a shape instead of 2,000. Wall and this process's CPU seconds (threads
included), also above a 40-image job's (`fixed`: Beam's start and stages), and the
process's peak RSS.
"""

import argparse
import json
import os
import resource
import tempfile
import time

import numpy as np
import tensorflow as tf

from beam_jobs import dedup, near_duplicates, records_io, schema, split_protocols, synthetic
from bench import character_writers, rendered_images

SHAPES = ("photos", "characters", "icons")
_SIZE = 28


def _photos(images: int) -> list[schema.CanonicalRecord]:
    config = synthetic.SyntheticConfig(identities=images // 4, images_per_identity=4, seed=0)
    return list(synthetic.records_for_identities(config, 0, config.identities))


def _characters(images: int) -> list[schema.CanonicalRecord]:
    rng = np.random.default_rng(0)
    records = []
    for user in range(images // 8):
        font = character_writers.LATIN_FONTS[user % len(character_writers.LATIN_FONTS)]
        for character in rng.choice(list(character_writers.CHARACTERS), 8, replace=False):
            seed = rendered_images.seed_of("writer", 0, user, character, 0, _SIZE)
            pixels = rendered_images.render(f"glyph:{font}:{character}", _SIZE, 0, seed)
            records.append(
                schema.CanonicalRecord(f"writer{user:05d}", character, schema.encode_png(pixels))
            )
    return records


def _icons(images: int) -> list[schema.CanonicalRecord]:
    icons = rendered_images.identities()["icons"]
    records = []
    for user in range(images // 4):
        icon = icons[user % len(icons)]
        for n in range(4):
            seed = rendered_images.seed_of("icon-user", user, n, _SIZE)
            pixels = rendered_images.render(icon, _SIZE, 0, seed)
            records.append(
                schema.CanonicalRecord(f"user{user:05d}", icon, schema.encode_png(pixels))
            )
    return records


def _write_split(records: list[schema.CanonicalRecord], split_dir: str) -> dict[str, int]:
    """Every fifth user (by order of appearance) to validation or test, alternately."""
    users = {r.user_id: None for r in records}
    split_of = {
        user: split_protocols.TRAIN
        if i % 5
        else split_protocols.EVALUATION_SPLITS[(i // 5) % len(split_protocols.EVALUATION_SPLITS)]
        for i, user in enumerate(users)
    }
    counts = {}
    for name in (split_protocols.TRAIN, *split_protocols.EVALUATION_SPLITS):
        folder = os.path.join(split_dir, name)
        tf.io.gfile.makedirs(folder)
        path = os.path.join(folder, f"{records_io.RECORDS_PREFIX}-00000-of-00001")
        with tf.io.TFRecordWriter(path + records_io.RECORDS_SUFFIX) as writer:
            chosen = [r for r in records if split_of[r.user_id] == name]
            for record in chosen:
                writer.write(schema.serialize(record))
        counts[name] = len(chosen)
    return counts


def _measured(shape: str, images: int, work_dir: str) -> dict:
    records = {"photos": _photos, "characters": _characters, "icons": _icons}[shape](images)
    split_dir = os.path.join(work_dir, shape, "split")
    counts = _write_split(records, split_dir)
    wall, cpu = time.perf_counter(), time.process_time()
    report = dedup.run_dedup(
        split_dir,
        os.path.join(work_dir, shape, "dedup"),
        dedup.DedupConfig(max_removed_fraction=1.0),
        # Identities on both sides (users never): the by-user split of held_out_images.
        split_mode=split_protocols.HELD_OUT_IMAGES,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    section = report["train_vs_evaluation"]
    return {
        "images": len(records),
        "splits": counts,
        "wall_seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 2),
        "wall_ms_per_image": round(1000 * wall / len(records), 3),
        "cpu_ms_per_image": round(1000 * cpu / len(records), 3),
        "removed": section["removed_exact"] + section["removed_near"],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def run(out_dir: str, quick: bool, images: int | None = None) -> dict:
    del out_dir
    images = images or (1000 if quick else 2000)
    results = {
        "runner": records_io.DEFAULT_RUNNER,
        "threads": near_duplicates.THREADS,
        "images_per_shape": images,
        "shapes": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_dedup_shapes_") as work_dir:
        # What a job costs whatever its size (Beam's start, stages, files): 40 photos.
        results["fixed"] = _measured("photos", 40, os.path.join(work_dir, "fixed"))
        for shape in SHAPES:
            results["shapes"][shape] = _measured(shape, images, work_dir)
            print(f"bench_dedup_shapes: {shape}: {results['shapes'][shape]}", flush=True)
    photos = results["shapes"]["photos"]
    for shape in SHAPES:
        measured = results["shapes"][shape]
        for unit in ("wall", "cpu"):
            above = measured[f"{unit}_seconds"] - results["fixed"][f"{unit}_seconds"]
            measured[f"{unit}_ms_per_image_above_fixed"] = round(1000 * above / images, 3)
            measured[f"{unit}_per_image_vs_photos"] = round(
                measured[f"{unit}_ms_per_image"] / photos[f"{unit}_ms_per_image"], 2
            )
    # ru_maxrss is in KiB on Linux: the peak of this process over every shape.
    results["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--images", type=int, default=2000, help="images per shape")
    parser.add_argument("--out-json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    results = run("", False, args.images)
    print(json.dumps(results, indent=1))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

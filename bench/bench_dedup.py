"""Near-duplicate dedup on real images: recall on copies, distinct images kept.

The images are real, and ship with packages in the venv (bench/real_images.py loads
them): scikit-learn's 8x8 handwritten digit scans (`load_digits`, UCI; BSD-3-Clause) and
its `china.jpg` / `flower.jpg` photos (CC BY 2.0, sklearn/datasets/images/README.txt);
matplotlib's sample data (PSF-style licence): `grace_hopper.jpg` (public domain), the MRI
slice `s1045.ima.gz`, the elevation model `jacksboro_fault_dem.npz` and two graphics. For each image side (28 and 112 pixels) the references (the evaluation
side of dedup) are half the originals; the candidates (the training side) are one copy
of each reference per transformation in `real_images.TRANSFORMS`, which dedup must
remove, and the other half of the originals, distinct images it must keep: another scan
of the same digit, the neighbouring tiles of the same photo.

Per transformation: recall (copies removed), matched (removed against their own
original) and precision as if the candidates were that transformation's copies plus
every distinct image. Distinct images: the fraction removed, overall and per source,
with the removed ones named. Every figure also per half of the originals (`Original.half`):
thresholds are chosen on half 0, half 1 checks them.

Low-detail images (`low_detail`): rendered characters and icons (bench/rendered_images.py:
fonts and icons that matplotlib ships, every image its own render at a random pose, blur
and noise), in both split modes: `by_identity` (distinct images are other shapes) and
`by_user` (distinct images are other users' renders of the evaluation side's shapes).
There a copy may be removed against a look-alike of its original: `recall_own_original`
counts only those removed against their own original.

`run(out_dir, quick)` returns the figures (bench.run_all writes them); quick uses 8
digits a class instead of 30 and 2 renders an identity instead of 4.
"""

import collections
import dataclasses
import os
import tempfile
import time

import apache_beam as beam

from beam_jobs import dedup, records_io, schema
from bench import real_images, rendered_images

SIZES = (28, 112)
DISTINCT = "distinct"
_NAMED = 40  # distinct images removed, named in the results


@dataclasses.dataclass(frozen=True)
class Candidate:
    user_id: str
    kind: str  # a transformation name, or DISTINCT
    original: real_images.Original
    image: bytes


def _record(user_id: str, image: bytes) -> bytes:
    return schema.serialize(schema.CanonicalRecord(user_id, user_id, image))


def benchmark_set(
    originals: list[real_images.Original],
) -> tuple[list[real_images.Original], list[Candidate]]:
    """(references, candidates): copies of every reference and the distinct originals."""
    references = [o for o in originals if o.reference]
    candidates = [
        Candidate(f"distinct:{o.name}", DISTINCT, o, real_images.encode(o.pixels))
        for o in originals
        if not o.reference
    ]
    for name, transform in real_images.TRANSFORMS.items():
        for original in references:
            image = transform(original)
            if image is not None:
                candidates.append(Candidate(f"{name}:{original.name}", name, original, image))
    return references, candidates


def run_dedup(
    references: list[real_images.Original], candidates: list[Candidate], config: dedup.DedupConfig
) -> dict[str, dict]:
    """Candidate user id -> the removed pair, through the Beam transform (DirectRunner)."""
    with tempfile.TemporaryDirectory(prefix="bench_dedup_") as work_dir:
        path = os.path.join(work_dir, "removed.json")
        with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
            result = {
                "candidates": pipeline
                | "Candidates" >> beam.Create([_record(c.user_id, c.image) for c in candidates]),
                "reference": pipeline
                | "References"
                >> beam.Create(
                    [
                        _record(f"reference:{o.name}", real_images.encode(o.pixels))
                        for o in references
                    ]
                ),
            } | dedup.RemoveNearDuplicates(config, "bench")
            _ = (
                result["removed"]
                | beam.combiners.ToList()
                | beam.Map(lambda pairs: {p["candidate"]["user_id"]: p for p in pairs})
                | records_io.WriteJson(path)
            )
        return records_io.read_json(path)


def _rate(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 4) if denominator else None


def score(candidates: list[Candidate], removed: dict[str, dict]) -> dict:
    """Recall, precision and false removals of one run (module docstring)."""
    distinct = [c for c in candidates if c.kind == DISTINCT]
    false_removed = [c for c in distinct if c.user_id in removed]
    result = {"transformations": {}, "distinct": {}, "halves": {}}
    by_kind = collections.defaultdict(list)
    for candidate in candidates:
        by_kind[candidate.kind].append(candidate)
    for kind, copies in by_kind.items():
        if kind == DISTINCT:
            continue
        hits = [c for c in copies if c.user_id in removed]
        own = [
            c
            for c in hits
            if removed[c.user_id]["reference"]["user_id"] == f"reference:{c.original.name}"
        ]
        result["transformations"][kind] = {
            "copies": len(copies),
            "recall": _rate(len(hits), len(copies)),
            "matched_own_original": _rate(len(own), len(hits)),
            "precision": _rate(len(hits), len(hits) + len(false_removed)),
        }
    by_source = collections.defaultdict(list)
    for candidate in distinct:
        by_source[candidate.original.source].append(candidate)
    result["distinct"] = {
        "images": len(distinct),
        "removed_fraction": _rate(len(false_removed), len(distinct)),
        "removed_fraction_by_source": {
            source: _rate(sum(c.user_id in removed for c in items), len(items))
            for source, items in sorted(by_source.items())
        },
        # The first of them by name: look-alikes can be hundreds.
        "removed": sorted(
            f"{c.original.name} ~ {removed[c.user_id]['reference']['user_id'].split(':', 1)[1]}"
            for c in false_removed
        )[:_NAMED],
    }
    copies = [c for c in candidates if c.kind != DISTINCT]
    for half in (0, 1):
        half_copies = [c for c in copies if c.original.half == half]
        half_distinct = [c for c in distinct if c.original.half == half]
        result["halves"][str(half)] = {
            "recall": _rate(sum(c.user_id in removed for c in half_copies), len(half_copies)),
            "distinct_removed_fraction": _rate(
                sum(c.user_id in removed for c in half_distinct), len(half_distinct)
            ),
        }
    result["recall"] = _rate(sum(c.user_id in removed for c in copies), len(copies))
    result["recall_own_original"] = _rate(
        sum(
            c.user_id in removed
            and removed[c.user_id]["reference"]["user_id"] == f"reference:{c.original.name}"
            for c in copies
        ),
        len(copies),
    )
    result["precision"] = _rate(
        len(removed) - len(false_removed), len(removed)
    )  # over the whole candidate set
    return result


def _measured(originals: list[real_images.Original], config: dedup.DedupConfig) -> dict:
    references, candidates = benchmark_set(originals)
    start = time.perf_counter()
    removed = run_dedup(references, candidates, config)
    seconds = time.perf_counter() - start
    return {
        "references": len(references),
        "candidates": len(candidates),
        "dedup_seconds": round(seconds, 2),
        **score(candidates, removed),
    }


def run(out_dir: str, quick: bool) -> dict:
    """Photos and digit scans (`sizes`), then rendered characters and icons in both
    split modes (`low_detail`: size -> source -> mode), each through the Beam transform."""
    config = dedup.DedupConfig()
    results = {
        "dedup_config": dataclasses.asdict(config),
        "runner": records_io.DEFAULT_RUNNER,
        "sizes": {},
        "low_detail": {},
    }
    for size in SIZES:
        originals = real_images.originals(size, 8 if quick else 30)
        results["sizes"][str(size)] = _measured(originals, config)
        by_source = results["low_detail"].setdefault(str(size), {})
        for source in rendered_images.SOURCES:
            for mode in rendered_images.SPLIT_MODES:
                rendered = rendered_images.originals(size, mode, 2 if quick else 4, source)
                by_source.setdefault(source, {})[mode] = _measured(rendered, config)
                print(f"bench_dedup: {size}px {source} {mode}: {_summary(by_source[source][mode])}")
    return results


def _summary(result: dict) -> str:
    return (
        f"recall {result['recall']}, distinct removed {result['distinct']['removed_fraction']} "
        f"of {result['distinct']['images']}"
    )

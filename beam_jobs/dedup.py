"""Deduplication of training (and public) data against evaluation (and private) data.

Exact duplicates: equal SHA-256 of the decoded pixels (so a PNG re-compressed or
re-encoded losslessly is still a duplicate). Near duplicates: every image becomes a 32x32
grey thumbnail and a perceptual hash (beam_jobs/near_duplicates.py); hashes joined by
banded locality-sensitive hashing (each band, a fixed subset of hash bits, is a join key;
the smaller side hashed at every small shift) propose pairs, and each candidate image's
`references_verified` closest references by hash distance are verified pixel by pixel:
aligned in shift and scale, grey levels rank-matched, the blurred residual compared with
what re-encoding can leave of the reference's detail. A pair alike in shape is then a
copy only with evidence that the candidate carries the reference's own fine detail
(beam_jobs/copy_evidence.py): its noise, correlated at the images' own resolution, or an
exact JPEG re-encoding of the reference; where the reference has no such detail to test,
the shape decides alone.

Why the verification: a hash cannot tell a re-encoded copy from another image of the
same kind. On a user's real small grayscale images of distinct identities (glyph-like)
the previous default (64-bit pHash within Hamming distance 8 at shifts up to 2 pixels)
removed 89% of the training images as near duplicates of other identities' evaluation
images. On bench/bench_dedup.py's real photos and digit scans the pixel verification
removes 0.7% of distinct images (three pairs of nearly identical 8x8 scans) and finds
99.6-99.8% of copies. Why the copy evidence: on low-detail images (characters and icons
rendered with their own pose, blur and noise) shape alone took a third to a half of the
other renders of a shape for copies (BENCHMARKS.md, "Dedup: copies vs look-alikes").

The Beam job moves numpy arrays per batch of images and key bucket
(beam_jobs/dedup_batches.py, dedup_verification.py), not one element per image and hash
band: its cost is the numpy work, not the runner's per-element bookkeeping. Joins run
by bucket of keys and by batch, so no worker holds a whole side.

Only the candidate side (train, public) ever loses records; reference records (the
evaluation splits, the private data) pass through untouched. Users or identities on both
sides are an error, except those the split mode shares between the splits compared
(beam_jobs.split_protocols.PROTOCOLS: users in mode identity, identities in held_out_images,
`run_dedup`'s `split_mode`). A dedup that would
remove more than `max_removed_fraction` of a candidate split stops the job after writing
its report (`run_dedup`): that many near duplicates is more often a threshold wrong for
the data than real copies, and training on what is left would be training on little.
"""

import dataclasses
import json
import math
import os
import pickle
from collections.abc import Iterator

import apache_beam as beam
import tensorflow as tf

from beam_jobs import (
    copy_evidence,
    dedup_verification,
    progress,
    records_io,
    spill,
    split_protocols,
)
from beam_jobs import dedup_batches as batches
from beam_jobs import near_duplicates as nd
from beam_jobs.dedup_batches import EXACT, NEAR

REPORT_FILE = "dedup_report.json"
_CANDIDATE, _REFERENCE = batches.CANDIDATE, batches.REFERENCE


@dataclasses.dataclass(frozen=True)
class DedupConfig:
    # Thumbnail pixels (of 32) the hash probes shift by; the verification searches one
    # more. 2 is 1.75 pixels of a 28x28 image, 7 of a 112x112 one.
    max_shift: int = 2
    hamming_threshold: int = 16  # hash bits (of 63) a candidate pair may differ in
    num_bands: int = 24
    bits_per_band: int = 14
    # Band keys also of the unshifted side's hash with each of its this many least certain
    # bits flipped: more copies meet their original in some band (bench_dedup).
    flipped_bits: int = 8
    # References verified per candidate image: its closest by hash distance.
    references_verified: int = 4
    # Near duplicate when residual <= max_residual + residual_per_detail * detail
    # (near_duplicates.py); chosen on half of bench/bench_dedup.py's real images.
    max_residual: float = 0.2
    residual_per_detail: float = 2.5
    # A pair that passes is a copy only with evidence that the candidate carries the
    # reference's own fine detail (beam_jobs/copy_evidence.py): shared noise correlating
    # >= min_shared_noise, or a JPEG candidate that re-encoding the reference reproduces
    # within jpeg_tolerance grey levels, or a same-size candidate whose pixels are the
    # reference's through one grey map at a whole-pixel shift (a constant tolerance,
    # copy_evidence.SAME_PIXELS_TOLERANCE: a grey map leaves no spread). Not testable: a
    # reference whose band-pass level is under min_reference_noise grey levels, or fewer
    # than min_noise_pixels flat unclipped pixels: the shape decides alone. A lossless
    # candidate is also a copy when a linear filter of the reference predicts its pixels
    # (copy_prediction.MAX_PREDICTED), and is none when it passed only by the detail
    # allowance and such a filter leaves too much (MAX_UNEXPLAINED): constants, as
    # SAME_PIXELS_TOLERANCE. Chosen on bench_dedup.py.
    min_shared_noise: float = copy_evidence.MIN_SHARED_NOISE
    min_reference_noise: float = copy_evidence.MIN_REFERENCE_NOISE
    min_noise_pixels: int = copy_evidence.MIN_NOISE_PIXELS
    jpeg_tolerance: float = copy_evidence.JPEG_TOLERANCE
    # A dedup removing more of a candidate split than this stops (module docstring).
    max_removed_fraction: float = 0.1
    examples_in_report: int = 20

    def __post_init__(self) -> None:
        if not 0 <= self.hamming_threshold < nd.HASH_BITS:
            raise ValueError(
                f"hamming threshold must be in [0, {nd.HASH_BITS}), got {self.hamming_threshold}"
            )
        if not 1 <= self.num_bands <= nd.MAX_BANDS or not 1 <= self.bits_per_band <= nd.HASH_BITS:
            raise ValueError(f"need 1..{nd.MAX_BANDS} bands of 1..{nd.HASH_BITS} bits")
        if not 0 <= self.max_shift <= 4:
            raise ValueError(f"max shift must be in [0, 4] thumbnail pixels, got {self.max_shift}")
        if not 0 <= self.flipped_bits <= nd.HASH_BITS:
            raise ValueError(
                f"flipped bits must be in [0, {nd.HASH_BITS}], got {self.flipped_bits}"
            )
        if self.references_verified < 1:
            raise ValueError(f"references verified must be >= 1, got {self.references_verified}")
        if self.max_residual < 0 or self.residual_per_detail < 0:
            raise ValueError("max residual and residual per detail must be >= 0")
        if not -1.0 <= self.min_shared_noise <= 1.0:
            raise ValueError(
                f"min shared noise is a correlation in [-1, 1], got {self.min_shared_noise}"
            )
        if self.min_reference_noise < 0 or self.min_noise_pixels < 0 or self.jpeg_tolerance < 0:
            raise ValueError(
                "min reference noise, min noise pixels and jpeg tolerance must be >= 0"
            )
        if not 0.0 <= self.max_removed_fraction <= 1.0:
            raise ValueError(
                f"max removed fraction must be in [0, 1], got {self.max_removed_fraction}"
            )


class DedupRefused(ValueError):
    """A dedup would remove more of a split than `max_removed_fraction`."""

    def __init__(self, section: dict, report_path: str):
        self.section, self.report_path = section, report_path
        fraction = section["removed_fraction"]
        enough = math.ceil(fraction * 20 + 1e-9) / 20  # the next multiple of 0.05 above it
        removed = section["removed_exact"] + section["removed_near"]
        super().__init__(
            f"dedup would remove {fraction:.1%} of the {section['candidate_split']} split "
            f"({removed} of {section['candidate_records']} images as copies of "
            f"{section['reference_splits']} images), over dedup.max_removed_fraction "
            f"{section['max_removed_fraction']:g}; check the example pairs in {report_path} "
            f"({section['name']}); if they are real copies, raise the limit (dp-fedemb run "
            f"--set dedup.max_removed_fraction={enough:g}, dp-fedemb data dedup "
            f"--max-removed-fraction {enough:g})"
        )


class Fingerprint(beam.PTransform):
    """Serialized records -> {"fingerprints": dedup_batches.Fingerprints, one per batch;
    "records": (batch key, records) of each batch, for the filter that keeps them}."""

    def __init__(self, config: DedupConfig):
        super().__init__()
        self._config = config

    def expand(self, records):
        out = (
            records
            | "Batch" >> beam.BatchElements(min_batch_size=512, max_batch_size=1024)
            | "Fingerprints"
            >> beam.FlatMap(batches.fingerprints_and_records, self._config.max_shift).with_outputs(
                batches.RECORDS, main="fingerprints"
            )
        )
        return {"fingerprints": out.fingerprints, "records": out[batches.RECORDS]}


def _overlap_error(overlaps: list[tuple[str, str]], name: str, shared_ids: tuple[str, ...]) -> None:
    overlaps = [(kind, name_) for kind, name_ in overlaps if kind not in shared_ids]
    if overlaps:
        overlaps = sorted(overlaps)
        kinds = sorted({kind for kind, _ in overlaps})
        raise ValueError(
            f"dedup {name}: {len(overlaps)} {'/'.join(kinds)} ids appear on both sides "
            f"(e.g. {overlaps[0][0]} {overlaps[0][1]!r}); splits must be disjoint by user and identity"
        )


def _closest(pairs: list[dict]) -> dict:
    # Exact before near, then by residual, then by reference record; the whole pair last:
    # an exact copy is found by both joins (with and without the verification's fields),
    # and the runner decides which arrives first.
    return min(
        pairs,
        key=lambda p: (
            p["kind"] != EXACT,
            p["residual"],
            p["reference"]["record"],
            json.dumps(p, sort_keys=True),
        ),
    )


def _probed_side(candidates: int, references: int) -> str:
    # The smaller side is hashed at every shift: a shift is found from either side.
    return _CANDIDATE if candidates < references else _REFERENCE


class _SpillEntriesFn(beam.DoFn):
    """Fingerprints -> their band keys, pixel hashes and ids (`batches.bucket_entries`)
    in one spill file per (bundle, key bucket); yields (bucket, file name) for each at the
    end of the bundle, so that the join groups file names, not entries."""

    def __init__(self, spill_dir: str):
        self._spill_dir = spill_dir

    def start_bundle(self):
        self._files = spill.SpillFiles(self._spill_dir)

    def process(self, fp: batches.Fingerprints, side: str, *args):
        for bucket, entry in batches.bucket_entries(fp, side, *args):
            self._files.append(f"bucket-{bucket:05d}", pickle.dumps(entry))

    def finish_bundle(self):
        for name, path in self._files.close().items():
            bucket = int(name.removeprefix("bucket-"))
            yield beam.transforms.window.GlobalWindows.windowed_value((bucket, path))


def _join_spilled_bucket(bucket_paths, *args):  # no hints: Beam would check them
    """`batches.join_bucket` of the entries in a bucket's spill files, read one file at a
    time as the join takes them (nothing here holds them all)."""
    bucket, paths = bucket_paths
    entries = (pickle.loads(e) for path in sorted(paths) for e in spill.read_file(path))
    yield from batches.join_bucket((bucket, entries), *args)


_VERIFIED_IMAGES = "verified_images"  # tagged output of the Verify step


def _verified_and_counted(joined: tuple, config: DedupConfig) -> Iterator:
    """`dedup_verification.verified_pairs`, then (tagged _VERIFIED_IMAGES) how many
    candidate images the batch held: the verification's progress, counted in images of a
    known total."""
    yield from dedup_verification.verified_pairs(joined, config)
    yield beam.pvalue.TaggedOutput(_VERIFIED_IMAGES, len(joined[1]["fp"][0]))


def _unpickled(step, *fields: str):
    """`step` of (key, {field: [values], ...}) on the spilled values' pickled bytes."""

    def unpickled(joined: tuple, *args):
        key, groups = joined
        values = {f: [pickle.loads(value) for value in groups[f]] for f in fields}
        return step((key, {**groups, **values}), *args)

    return unpickled


class _ClosestReferencesFn(beam.CombineFn):
    """A candidate batch's join outputs, reduced as they come to each candidate image's k
    closest references (`batches.closest_of`): what the runner holds per candidate image
    is those k pairs, not k for every key bucket (up to 16 k; grouped, the largest state
    the in-memory runner kept, docs/scaling.md)."""

    def __init__(self, k: int):
        self._k = k

    def create_accumulator(self):
        return [], None

    def add_input(self, closest, part):
        return batches.closest_of([closest, part], self._k)

    def merge_accumulators(self, accumulators):
        return batches.closest_of(accumulators, self._k)

    def extract_output(self, closest):
        return closest


class FindDuplicates(beam.PTransform):
    """{"candidates", "reference"} Fingerprints -> {"removed": (record id, pair) for each
    candidate image equal or near a reference; "sizes": number of images per side}.
    Steps in beam_jobs/dedup_batches.py. A side may be a tuple of PCollections (several
    splits): each is stepped on its own and only the steps' small outputs are
    flattened, since a flattened PCollection of fingerprints is one the in-memory runner
    holds whole (~2 KB an image) until its consumer runs.

    `sizes`: the number of images per side when the caller knows it (`run_dedup` counts
    the record files): "sizes" is then that dict, and the job spends no stages counting.

    The joins group names of spill files under `spill_dir` (beam_jobs/spill.py), not
    band keys, fingerprints or references: each bucket's band keys, each batch's
    fingerprints, and the references attached to each candidate batch, are read back
    from there by the step that needs them.
    """

    def __init__(
        self,
        config: DedupConfig,
        name: str,
        spill_dir: str,
        sizes: dict[str, int] | None = None,
        shared_ids: tuple[str, ...] = (),
    ):
        super().__init__()
        self._config = config
        self._name = name
        self._spill_dir = spill_dir
        self._sizes = sizes
        # Id kinds ("user", "identity") the split mode lets both sides hold.
        self._shared_ids = shared_ids

    def expand(self, inputs):
        config, spill_dir = self._config, self._spill_dir
        sides = {
            side: [
                (f"{side}{i}" if i else side, fps)
                for i, fps in enumerate(parts if isinstance(parts, tuple) else (parts,))
            ]
            for side, parts in (
                (_CANDIDATE, inputs["candidates"]),
                (_REFERENCE, inputs["reference"]),
            )
        }
        if self._sizes is not None:
            sizes = self._sizes
            probed_side = _probed_side(sizes[_CANDIDATE], sizes[_REFERENCE])
        else:
            sizes = {
                side: [fps | f"Sizes{label}" >> beam.Map(len) for label, fps in parts]
                | f"AllSizes{side}" >> beam.Flatten()
                | f"Count{side}" >> beam.CombineGlobally(sum)
                for side, parts in sides.items()
            }
            probed_side = beam.pvalue.AsSingleton(
                sizes[_CANDIDATE]
                | "ProbedSide" >> beam.Map(_probed_side, beam.pvalue.AsSingleton(sizes[_REFERENCE]))
            )
        bands = nd.band_bits(config.num_bands, config.bits_per_band)
        joined = (
            [
                fps
                | f"Entries{label}"
                >> beam.ParDo(
                    _SpillEntriesFn(spill_dir),
                    side,
                    probed_side,
                    config.max_shift,
                    config.flipped_bits,
                    bands,
                )
                for side, parts in sides.items()
                for label, fps in parts
            ]
            | "AllEntries" >> beam.Flatten()
            | "ByBucket" >> beam.GroupByKey()
            | "Progress"
            >> progress.Progress(
                "dedup", f"{self._name} band buckets joined", total=batches.BUCKETS
            )
            | "Join"
            >> beam.FlatMap(
                _join_spilled_bucket, config.hamming_threshold, config.references_verified
            ).with_outputs(batches.SHARED_IDS, batches.EXACT_PAIRS, main="close")
        )
        overlap_check = (
            joined[batches.SHARED_IDS]
            | "AllShared" >> beam.combiners.ToList()
            | "FailOnOverlap" >> beam.Map(_overlap_error, self._name, self._shared_ids)
        )
        requests = (
            joined.close
            | "Closest" >> beam.CombinePerKey(_ClosestReferencesFn(config.references_verified))
            | "Requests" >> beam.FlatMapTuple(batches.requests)
        )
        by_key = {
            side: [
                fps
                | f"Key{label}" >> beam.Map(lambda fp: (fp.key, pickle.dumps(fp)))
                | f"Spill{label}" >> spill.SpillByKey(spill_dir)
                for label, fps in parts
            ]
            | f"Spilled{side}" >> beam.Flatten()
            for side, parts in sides.items()
        }
        attach = _unpickled(batches.attach_references, "fp")
        verify = _unpickled(_verified_and_counted, "fp", "references")
        # The attached references (thumbnails, pixels: ~2 KB per request, up to
        # references_verified requests a candidate image) wait for their candidate batch
        # in spill files too: grouped, the runner would hold them all (docs/scaling.md).
        attached = (
            {"fp": by_key[_REFERENCE], "request": requests}
            | "JoinReferences" >> beam.CoGroupByKey()
            | "AttachReferences"
            >> beam.ParDo(spill.WithSpilledRecords(spill_dir, attach, fields=("fp",)))
            | "PickleReferences" >> beam.MapTuple(lambda key, refs: (key, pickle.dumps(refs)))
            | "SpillReferences" >> spill.SpillByKey(spill_dir)
        )
        verified = (
            {"fp": by_key[_CANDIDATE], "references": attached}
            | "JoinCandidates" >> beam.CoGroupByKey()
            | "Verify"
            >> beam.ParDo(
                spill.WithSpilledRecords(spill_dir, verify, config, fields=("fp", "references"))
            ).with_outputs(_VERIFIED_IMAGES, main="pairs")
        )
        near = verified.pairs
        _ = verified[_VERIFIED_IMAGES] | "VerifyProgress" >> progress.Progress(
            "dedup",
            f"{self._name} candidate images verified",
            total=self._sizes[_CANDIDATE] if self._sizes is not None else None,
            weight=int,
        )
        removed = (
            (joined[batches.EXACT_PAIRS], near)
            | "AllPairs" >> beam.Flatten()
            | "GroupPairs" >> beam.GroupByKey()
            | "ClosestPair" >> beam.MapTuple(lambda record, pairs: (record, _closest(list(pairs))))
            # The overlap check is a side input so that the pairs (and the job) fail with it.
            | "Checked" >> beam.Map(lambda p, _: p, beam.pvalue.AsSingleton(overlap_check))
        )
        return {"removed": removed, "sizes": sizes}


def _without_names(pair: dict) -> dict:
    # The report is published (a pipeline artifact): it names records by hash only,
    # never the user or identity of a training (candidate) or evaluation record.
    return {
        **pair,
        "candidate": {"record": pair["candidate"]["record"]},
        "reference": {"record": pair["reference"]["record"]},
    }


def _report(
    candidates: int, references: int, removed: list[dict], config: DedupConfig, names: dict
) -> dict:
    counts = {kind: sum(p["kind"] == kind for p in removed) for kind in (EXACT, NEAR)}
    fraction = len(removed) / candidates if candidates else 0.0
    examples = sorted(removed, key=lambda p: p["candidate"]["record"])
    return {
        **names,
        "candidate_records": candidates,
        "reference_records": references,
        "removed_exact": counts[EXACT],
        "removed_near": counts[NEAR],
        "kept": candidates - len(removed),
        "removed_fraction": round(fraction, 6),
        "max_removed_fraction": config.max_removed_fraction,
        "within_limit": fraction <= config.max_removed_fraction,
        "thresholds": dataclasses.asdict(config),
        "examples": [_without_names(p) for p in examples[: config.examples_in_report]],
    }


class Deduplicate(beam.PTransform):
    """{"candidates", "reference": Fingerprints (or tuples of them, as FindDuplicates),
    "records": the candidates' batches of (batch key, records) from Fingerprint} ->
    {"kept", "removed", "report"}, as RemoveNearDuplicates; `sizes` as FindDuplicates.

    The candidates' records wait for the removed ids in spill files, as the joins' band
    keys and fingerprints do (FindDuplicates), under `spill_dir` (default `spill.folder`),
    which is removed with the report.
    """

    def __init__(
        self,
        config: DedupConfig,
        name: str,
        splits_compared: tuple[str, str],
        sizes: dict[str, int] | None = None,
        shared_ids: tuple[str, ...] = (),
        spill_dir: str | None = None,
    ):
        super().__init__()
        self._config = config
        self._spill_dir = spill_dir
        self._sizes = sizes
        self._shared_ids = shared_ids
        self._names = {
            "name": name,
            "candidate_split": splits_compared[0] or "candidate",
            "reference_splits": splits_compared[1] or "reference",
        }

    def expand(self, inputs):
        config, names = self._config, self._names
        spill_dir = spill.folder(self._spill_dir)
        found = {
            "candidates": inputs["candidates"],
            "reference": inputs["reference"],
        } | "FindDuplicates" >> FindDuplicates(
            config, names["name"], spill_dir, self._sizes, self._shared_ids
        )
        removed_ids = found["removed"] | "RemovedIds" >> beam.combiners.ToDict()
        kept = (
            inputs["records"]
            | "ByRecord" >> beam.FlatMapTuple(lambda key, batch: ((key, r) for r in batch))
            | "SpillRecords" >> spill.SpillByKey(spill_dir)
            | "OneReference" >> beam.MapTuple(lambda key, reference: (key, [reference]))
            | "Kept"
            >> beam.ParDo(
                spill.WithSpilledRecords(spill_dir, batches.kept_records),
                beam.pvalue.AsSingleton(removed_ids),
            ).with_output_types(bytes)
        )
        if self._sizes is not None:
            n, m = self._sizes[_CANDIDATE], self._sizes[_REFERENCE]
            report = removed_ids | "Report" >> beam.Map(
                lambda removed: _report(n, m, list(removed.values()), config, names)
            )
        else:
            report = found["sizes"][_CANDIDATE] | "Report" >> beam.Map(
                lambda n, m, removed: _report(n, m, list(removed.values()), config, names),
                beam.pvalue.AsSingleton(found["sizes"][_REFERENCE]),
                beam.pvalue.AsSingleton(removed_ids),
            )
        # Every spilled record is read back once the kept ones are counted (and the
        # fingerprints once the removed ids are known, which the report waits for).
        kept_count = kept | "KeptCount" >> beam.combiners.Count.Globally()
        report = report | "RemoveSpill" >> beam.Map(
            lambda r, _: spill.removed_then(r, spill_dir), beam.pvalue.AsSingleton(kept_count)
        )
        removed = found["removed"] | "Pairs" >> beam.Values()
        return {"kept": kept, "removed": removed, "report": report}


class RemoveNearDuplicates(beam.PTransform):
    """{"candidates", "reference"} serialized records -> {"kept", "removed", "report"}.

    "kept" is the candidates minus those equal or near a reference image; "removed" the
    matched pairs (one per removed candidate); "report" one dict. The reference side is
    never filtered. A user or identity on both sides fails the pipeline.
    """

    def __init__(self, config: DedupConfig, name: str, splits_compared: tuple[str, str] = ("", "")):
        super().__init__()
        self._config = config
        self._name = name
        self._splits = splits_compared

    def expand(self, inputs):
        fps = {
            side: inputs[side] | f"Fingerprint{side}" >> Fingerprint(self._config)
            for side in ("candidates", "reference")
        }
        return {
            "candidates": fps["candidates"]["fingerprints"],
            "reference": fps["reference"]["fingerprints"],
            "records": fps["candidates"]["records"],
        } | Deduplicate(self._config, self._name, self._splits)


def run_dedup(
    split_dir: str,
    out_dir: str,
    config: DedupConfig,
    beam_args=None,
    split_mode: str = split_protocols.IDENTITY_AND_USER,
) -> dict:
    """Dedups SPLIT_DIR/<split>/records-* into OUT_DIR/<split>/records-*.

    train loses records equal or near validation/test ones; public (when present) loses
    records equal or near any private (train/validation/test) one; validation and test are
    copied unchanged. Writes OUT_DIR/dedup_report.json and returns it; raises DedupRefused
    (its record shards removed, the report kept) when a split would lose more than
    `config.max_removed_fraction`. `split_mode`: the mode the splits were made by
    (beam_jobs.split_protocols.MODES), which says which ids both sides may hold.
    """
    protocol = split_protocols.PROTOCOLS[split_mode]
    present = [
        s
        for s in split_protocols.SPLIT_PRIORITY
        if tf.io.gfile.glob(records_io.records_pattern(os.path.join(split_dir, s)))
    ]
    for required in (split_protocols.TRAIN, *split_protocols.EVALUATION_SPLITS):
        if required not in present:
            raise ValueError(f"dedup needs a {required} split under {split_dir}")
    report_path = os.path.join(out_dir, REPORT_FILE)
    # Counted before the job (a pass over the record framing): the probed side and the
    # report's sizes are then constants, not stages of the job.
    sizes = {s: records_io.count_records(os.path.join(split_dir, s)) for s in present}
    evaluation_size = sum(sizes[s] for s in split_protocols.EVALUATION_SPLITS)
    spill_dir = os.path.join(out_dir, spill.SPILL_DIR)  # each comparison's, then removed
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        data = {
            s: pipeline | f"Read{s}" >> records_io.ReadRecords(os.path.join(split_dir, s))
            for s in present
        }
        # Each split is decoded and fingerprinted once, whatever it is compared with.
        prints = {s: data[s] | f"Fingerprint{s}" >> Fingerprint(config) for s in present}
        fps = {
            s: out["fingerprints"]
            | f"Progress{s}"
            >> progress.Progress("dedup", f"{s} images fingerprinted", total=sizes[s], weight=len)
            for s, out in prints.items()
        }
        # Sides of several splits are tuples, not flattened (FindDuplicates).
        evaluation = tuple(fps[s] for s in split_protocols.EVALUATION_SPLITS)
        train = {
            "candidates": fps[split_protocols.TRAIN],
            "reference": evaluation,
            "records": prints[split_protocols.TRAIN]["records"],
        } | "TrainVsEvaluation" >> Deduplicate(
            config,
            "train_vs_evaluation",
            (split_protocols.TRAIN, "/".join(split_protocols.EVALUATION_SPLITS)),
            {_CANDIDATE: sizes[split_protocols.TRAIN], _REFERENCE: evaluation_size},
            protocol.shared_across_splits,
            os.path.join(spill_dir, "train_vs_evaluation"),
        )
        reports = [train["report"]]
        outputs = {split_protocols.TRAIN: train["kept"]}
        if split_protocols.PUBLIC in present:
            private = (split_protocols.TRAIN, *split_protocols.EVALUATION_SPLITS)
            public = {
                "candidates": fps[split_protocols.PUBLIC],
                "reference": tuple(fps[s] for s in private),
                "records": prints[split_protocols.PUBLIC]["records"],
            } | "PublicVsPrivate" >> Deduplicate(
                config,
                "public_vs_private",
                (split_protocols.PUBLIC, "/".join(private)),
                {
                    _CANDIDATE: sizes[split_protocols.PUBLIC],
                    _REFERENCE: evaluation_size + sizes[split_protocols.TRAIN],
                },
                protocol.shared_with_public,
                os.path.join(spill_dir, "public_vs_private"),
            )
            reports.append(public["report"])
            outputs[split_protocols.PUBLIC] = public["kept"]
        for split_name, records in outputs.items():
            _ = records | f"Write{split_name}" >> records_io.WriteRecords(
                os.path.join(out_dir, split_name)
            )
        written = list(outputs)
        _ = (
            reports
            | "Reports" >> beam.Flatten()
            | "ReportsList" >> beam.combiners.ToList()
            | "ByName" >> beam.Map(lambda rs: {r["name"]: r for r in rs})
            | "WriteReport" >> records_io.WriteJson(report_path)
        )
    spill.remove(spill_dir)  # each comparison removed its own folder in it
    report = records_io.read_json(report_path)
    refused = [section for _, section in sorted(report.items()) if not section["within_limit"]]
    if refused:
        # Nothing downstream may train on a dedup that stopped; the report stays.
        for split_name in written:
            records_io.remove_records(os.path.join(out_dir, split_name))
        raise DedupRefused(max(refused, key=lambda s: s["removed_fraction"]), report_path)
    # The evaluation splits lose nothing: copied as files, not through the job.
    for split_name in split_protocols.EVALUATION_SPLITS:
        records_io.copy_records(
            os.path.join(split_dir, split_name), os.path.join(out_dir, split_name)
        )
    return report

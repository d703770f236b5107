"""Deduplication of training (and public) data against evaluation (and private) data.

Exact duplicates: equal SHA-256 of the decoded pixels (so a PNG re-compressed or
re-encoded losslessly is still a duplicate). Near duplicates: perceptual hashes
(imagehash.phash) joined by banded locality-sensitive hashing (each band, a fixed subset
of hash bits, is a join key; CoGroupByKey brings together candidate pairs sharing any
band) and verified by Hamming distance.

Small images defeat plain phash: a one-pixel shift of a 28x28 image moves it about as
far as an unrelated image. So hashes are taken of the image interior (a `max_shift`
border removed, lightly blurred), and the images of one side are also hashed at every
integer offset up to `max_shift`: a shifted copy's interior then equals one probed
interior exactly, leaving only re-encoding noise for the Hamming check. A shift is found
from either side (probing the copy at -d meets the original at 0), so the smaller side is
probed: (2*max_shift+1)^2 hashes per probed image, and up to num_bands times as many band
keys, are the cost.

The band join carries only (record id, hashes) per key; the few pairs within the Hamming
threshold are joined back to their full fingerprints afterwards.

Only the candidate side (train, public) ever loses records; reference records (the
evaluation splits, the private data) pass through untouched. Users or identities on both
sides are an error: splits must be disjoint by user and identity.
"""

import dataclasses
import hashlib
import os
from collections.abc import Iterator

import apache_beam as beam
import imagehash
import numpy as np
import tensorflow as tf
from apache_beam.metrics import Metrics
from PIL import Image, ImageFilter

from beam_jobs import records_io, schema, splits

REPORT_FILE = "dedup_report.json"
METRICS_NAMESPACE = "dp_fedemb.dedup"
EXACT = "exact"
NEAR = "near"


@dataclasses.dataclass(frozen=True)
class DedupConfig:
    hash_size: int = 8  # phash bits = hash_size ** 2
    hamming_threshold: int = 8  # near duplicate when distance <= this
    num_bands: int = 24
    bits_per_band: int = 16
    max_shift: int = 2  # pixels; reference probed at every offset in [-max_shift, max_shift]^2
    examples_in_report: int = 20

    def __post_init__(self) -> None:
        bits = self.hash_size**2
        if self.hash_size < 2 or not 0 <= self.hamming_threshold < bits:
            raise ValueError(f"need hash size >= 2 and 0 <= hamming threshold < {bits}")
        if self.num_bands < 1 or not 1 <= self.bits_per_band <= bits:
            raise ValueError(f"need >= 1 band of 1..{bits} bits")
        if self.max_shift < 0:
            raise ValueError(f"max shift must be >= 0, got {self.max_shift}")

    def band_bits(self) -> np.ndarray:
        """[num_bands, bits_per_band] bit positions: fixed, so every worker agrees."""
        rng = np.random.default_rng(0)
        bits = self.hash_size**2
        return np.stack(
            [
                np.sort(rng.choice(bits, self.bits_per_band, replace=False))
                for _ in range(self.num_bands)
            ]
        )


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    record_id: str  # hash of the serialized record
    user_id: str
    identity: str
    pixel_sha256: str
    phashes: tuple[int, ...]  # one, or one per probed offset on the probed side


def pixel_sha256(pixels: np.ndarray) -> str:
    digest = hashlib.sha256(f"{pixels.shape}|{pixels.dtype}".encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


def interior_phash(pixels: np.ndarray, config: DedupConfig, dx: int = 0, dy: int = 0) -> int:
    """phash of the image minus a max_shift border, the window moved by (dx, dy)."""
    border = min(config.max_shift, (min(pixels.shape[:2]) - 2) // 2)
    height, width = pixels.shape[:2]
    window = pixels[border + dy : height - border + dy, border + dx : width - border + dx]
    # The blur keeps JPEG ringing and sensor-like noise out of the low frequencies.
    image = Image.fromarray(np.ascontiguousarray(window)).filter(ImageFilter.GaussianBlur(0.8))
    bits = imagehash.phash(image, hash_size=config.hash_size).hash.ravel()
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def fingerprint(serialized: bytes, config: DedupConfig, probe_offsets: bool) -> Fingerprint:
    record = schema.parse(serialized)
    pixels = schema.decode_image(record.image)
    border = min(config.max_shift, (min(pixels.shape[:2]) - 2) // 2)
    offsets = range(-border, border + 1) if probe_offsets else (0,)
    phashes = tuple(interior_phash(pixels, config, dx, dy) for dx in offsets for dy in offsets)
    return Fingerprint(
        record_id=hashlib.blake2b(serialized, digest_size=16).hexdigest(),
        user_id=record.user_id,
        identity=record.identity,
        pixel_sha256=pixel_sha256(pixels),
        phashes=tuple(dict.fromkeys(phashes)),  # distinct, order kept
    )


def _hash_bytes(hash_bits: int) -> int:
    """Bytes that hold a hash of `hash_bits` bits."""
    return -(-hash_bits // 8)


def _band_keys(phash: int, band_bits: np.ndarray, hash_bits: int) -> Iterator[tuple[int, int]]:
    # Bit i is the i-th most significant of the hash's lowest hash_bits bits.
    size = max(_hash_bytes(phash.bit_length()), _hash_bytes(hash_bits))
    bits = np.unpackbits(np.frombuffer(phash.to_bytes(size, "big"), dtype=np.uint8))[-hash_bits:]
    for band, packed in enumerate(np.packbits(bits[band_bits], axis=1)):
        yield band, int.from_bytes(packed.tobytes(), "big")


def _band_entries(fp: Fingerprint, band_bits: np.ndarray, hash_bits: int):
    """(band key, (record id, all hashes packed)) for each distinct band key of a fingerprint.

    Any shared band makes the pair a candidate, verified against every probed offset. The
    hashes travel as bytes: Beam pickles a dataclass, and takes only ints below 2**63 on
    its fast path.
    """
    width = _hash_bytes(hash_bits)
    packed = b"".join(phash.to_bytes(width, "big") for phash in fp.phashes)
    keys = {key for phash in fp.phashes for key in _band_keys(phash, band_bits, hash_bits)}
    return [(key, (fp.record_id, packed)) for key in sorted(keys)]


def _unpack(packed: bytes, width: int) -> list[int]:
    return [int.from_bytes(packed[i : i + width], "big") for i in range(0, len(packed), width)]


def _near_within(joined, hash_bits: int, threshold: int) -> Iterator[tuple[tuple[str, str], int]]:
    """((candidate id, reference id), Hamming distance) for the close pairs of one band."""
    _, groups = joined
    width = _hash_bytes(hash_bits)
    references = [(ref_id, _unpack(packed, width)) for ref_id, packed in groups["reference"]]
    for candidate_id, packed in groups["candidate"] if references else ():
        candidate_hashes = _unpack(packed, width)
        for reference_id, reference_hashes in references:
            distance = min((a ^ b).bit_count() for a in candidate_hashes for b in reference_hashes)
            Metrics.counter(METRICS_NAMESPACE, "pairs_verified").inc()
            if distance <= threshold:
                yield (candidate_id, reference_id), distance


def _attach_reference(joined) -> Iterator[tuple[str, tuple[Fingerprint, int]]]:
    _, groups = joined
    reference = next(iter(groups["fp"]))  # one record id: equal records, equal fingerprints
    for candidate_id, distance in groups["pair"]:
        yield candidate_id, (reference, distance)


def _attach_candidate(joined) -> Iterator[tuple[str, dict]]:
    candidate_id, groups = joined
    candidate = next(iter(groups["fp"]))
    for reference, distance in groups["pair"]:
        yield candidate_id, _pair(NEAR, distance, candidate, reference)


def _pair(kind: str, distance: int, candidate: Fingerprint, reference: Fingerprint) -> dict:
    return {
        "kind": kind,
        "hamming_distance": distance,
        "candidate": {
            "user_id": candidate.user_id,
            "identity": candidate.identity,
            "record": candidate.record_id,
        },
        "reference": {
            "user_id": reference.user_id,
            "identity": reference.identity,
            "record": reference.record_id,
        },
    }


def _exact_pairs(joined) -> Iterator[tuple[str, dict]]:
    _, groups = joined
    references = list(groups["reference"])
    if references:
        for candidate in groups["candidate"]:
            yield candidate.record_id, _pair(EXACT, 0, candidate, references[0])


def _closest(pairs: list[dict]) -> dict:
    # Exact before near, then by distance, then by reference record for determinism.
    return min(
        pairs, key=lambda p: (p["kind"] != EXACT, p["hamming_distance"], p["reference"]["record"])
    )


def _keep_or_remove(joined):
    _, groups = joined
    matches = list(groups["match"])
    for serialized in groups["record"]:
        if matches:
            Metrics.counter(METRICS_NAMESPACE, f"removed_{matches[0]['kind']}").inc()
            yield beam.pvalue.TaggedOutput("removed", matches[0])
        else:
            yield serialized


def _overlap_keys(fp: Fingerprint) -> list[tuple[str, str]]:
    return [("user", fp.user_id), ("identity", fp.identity)]


def _overlap_error(overlaps: list[tuple[str, str]], name: str) -> None:
    if overlaps:
        overlaps = sorted(overlaps)
        kinds = sorted({kind for kind, _ in overlaps})
        raise ValueError(
            f"dedup {name}: {len(overlaps)} {'/'.join(kinds)} ids appear on both sides "
            f"(e.g. {overlaps[0][0]} {overlaps[0][1]!r}); splits must be disjoint by user and identity"
        )


def _report(counts: dict, examples: list[dict], config: DedupConfig, name: str) -> dict:
    removed = {kind: counts.get(f"removed_{kind}", 0) for kind in (EXACT, NEAR)}
    return {
        "name": name,
        "candidate_records": counts.get("candidates", 0),
        "reference_records": counts.get("references", 0),
        "removed_exact": removed[EXACT],
        "removed_near": removed[NEAR],
        "kept": counts.get("kept", 0),
        "thresholds": dataclasses.asdict(config),
        "examples": sorted(
            (_without_names(p) for p in examples), key=lambda p: p["candidate"]["record"]
        ),
    }


def _without_names(pair: dict) -> dict:
    # The report is published (a pipeline artifact): it names records by hash only,
    # never the user or identity of a training (candidate) or evaluation record.
    return {
        **pair,
        "candidate": {"record": pair["candidate"]["record"]},
        "reference": {"record": pair["reference"]["record"]},
    }


class RemoveNearDuplicates(beam.PTransform):
    """{"candidates", "reference"} serialized records -> {"kept", "removed", "report"}.

    "kept" is the candidates minus those equal or near a reference image; "removed" the
    matched pairs (one per removed candidate); "report" one dict. The reference side is
    never filtered. A user or identity on both sides fails the pipeline.
    """

    def __init__(self, config: DedupConfig, name: str):
        super().__init__()
        self._config = config
        self._name = name

    def expand(self, inputs):
        config, name = self._config, self._name
        candidates, reference = inputs["candidates"], inputs["reference"]
        keyed_candidates = candidates | "KeyCandidates" >> beam.Map(
            lambda s: (hashlib.blake2b(s, digest_size=16).hexdigest(), s)
        )
        # Counted once: for the side to probe and for the report.
        totals = {
            "candidates": candidates | "CountCandidates" >> beam.combiners.Count.Globally(),
            "references": reference | "CountReferences" >> beam.combiners.Count.Globally(),
        }
        probe_candidates = beam.pvalue.AsSingleton(
            totals["candidates"]
            | "SmallerSide"
            >> beam.Map(lambda n, m: n < m, beam.pvalue.AsSingleton(totals["references"]))
        )
        candidate_fps = candidates | "FingerprintCandidates" >> beam.Map(
            lambda s, probe: fingerprint(s, config, probe), probe_candidates
        )
        reference_fps = reference | "FingerprintReference" >> beam.Map(
            lambda s, probe: fingerprint(s, config, not probe), probe_candidates
        )

        sides = {"candidate": candidate_fps, "reference": reference_fps}
        shared_ids = (
            {
                side: fps
                | f"Ids{side}" >> beam.FlatMap(_overlap_keys)
                | f"Distinct{side}" >> beam.Distinct()
                | f"KeyIds{side}" >> beam.Map(lambda key: (key, None))
                for side, fps in sides.items()
            }
            | "JoinIds" >> beam.CoGroupByKey()
            | "SharedIds"
            >> beam.FlatMap(lambda kv: [kv[0]] if kv[1]["candidate"] and kv[1]["reference"] else [])
            | "AllShared" >> beam.combiners.ToList()
        )
        overlap_check = shared_ids | "FailOnOverlap" >> beam.Map(_overlap_error, name)

        exact = (
            {
                "candidate": candidate_fps
                | "ExactKeyC" >> beam.Map(lambda fp: (fp.pixel_sha256, fp)),
                "reference": reference_fps
                | "ExactKeyR" >> beam.Map(lambda fp: (fp.pixel_sha256, fp)),
            }
            | "JoinExact" >> beam.CoGroupByKey()
            | "ExactPairs" >> beam.FlatMap(_exact_pairs)
        )
        band_bits, hash_bits = config.band_bits(), config.hash_size**2
        near_distances = (
            {
                side: fps | f"Bands{side}" >> beam.FlatMap(_band_entries, band_bits, hash_bits)
                for side, fps in sides.items()
            }
            | "JoinBands" >> beam.CoGroupByKey()
            | "WithinThreshold" >> beam.FlatMap(_near_within, hash_bits, config.hamming_threshold)
            | "MinDistance" >> beam.CombinePerKey(min)
        )
        by_id = {
            side: fps | f"ById{side}" >> beam.Map(lambda fp: (fp.record_id, fp))
            for side, fps in sides.items()
        }
        near = (
            {
                "pair": near_distances
                | "ByReference" >> beam.MapTuple(lambda ids, d: (ids[1], (ids[0], d))),
                "fp": by_id["reference"],
            }
            | "JoinReference" >> beam.CoGroupByKey()
            | "AttachReference" >> beam.FlatMap(_attach_reference)
        )
        near = (
            {"pair": near, "fp": by_id["candidate"]}
            | "JoinCandidate" >> beam.CoGroupByKey()
            | "NearPairs" >> beam.FlatMap(_attach_candidate)
        )
        best_match = (
            (exact, near)
            | "AllPairs" >> beam.Flatten()
            | "GroupPairs" >> beam.GroupByKey()
            | "Closest"
            >> beam.MapTuple(lambda record_id, pairs: (record_id, _closest(list(pairs))))
        )
        split = (
            {"record": keyed_candidates, "match": best_match}
            | "JoinMatches" >> beam.CoGroupByKey()
            | "KeepOrRemove" >> beam.FlatMap(_keep_or_remove).with_outputs("removed", main="kept")
        )
        kept, removed = split.kept, split.removed

        def keyed(total, label: str):
            return total | f"Key{label}" >> beam.Map(lambda n: (label, n))

        removed_by_kind = (
            removed
            | "RemovedKind" >> beam.Map(lambda p: f"removed_{p['kind']}")
            | "CountKinds" >> beam.combiners.Count.PerElement()
        )
        counts = (
            [
                keyed(totals["candidates"], "candidates"),
                keyed(totals["references"], "references"),
                keyed(kept | "CountKept" >> beam.combiners.Count.Globally(), "kept"),
                removed_by_kind,
            ]
            | "AllCounts" >> beam.Flatten()
            | "CountsDict" >> beam.combiners.ToDict()
        )
        examples = removed | "Examples" >> beam.combiners.Top.Smallest(
            config.examples_in_report, key=lambda p: p["candidate"]["record"]
        )
        # The overlap check is a side input so the report (and the job) fails with it.
        report = counts | "Report" >> beam.Map(
            lambda c, ex, _: _report(c, ex, config, name),
            beam.pvalue.AsSingleton(examples),
            beam.pvalue.AsSingleton(overlap_check),
        )
        return {"kept": kept, "removed": removed, "report": report}


def run_dedup(split_dir: str, out_dir: str, config: DedupConfig, beam_args=None) -> dict:
    """Dedups SPLIT_DIR/<split>/records-* into OUT_DIR/<split>/records-*.

    train loses records equal or near validation/test ones; public (when present) loses
    records equal or near any private (train/validation/test) one; validation and test are
    copied unchanged. Writes OUT_DIR/dedup_report.json and returns it.
    """
    present = [
        s
        for s in splits.SPLIT_PRIORITY
        if tf.io.gfile.glob(records_io.records_pattern(os.path.join(split_dir, s)))
    ]
    for required in (splits.TRAIN, *splits.EVALUATION_SPLITS):
        if required not in present:
            raise ValueError(f"dedup needs a {required} split under {split_dir}")
    report_path = os.path.join(out_dir, REPORT_FILE)
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        data = {
            s: pipeline | f"Read{s}" >> records_io.ReadRecords(os.path.join(split_dir, s))
            for s in present
        }
        evaluation = [data[s] for s in splits.EVALUATION_SPLITS] | "Evaluation" >> beam.Flatten()
        train = {
            "candidates": data[splits.TRAIN],
            "reference": evaluation,
        } | "TrainVsEvaluation" >> RemoveNearDuplicates(config, "train_vs_evaluation")
        reports = [train["report"]]
        outputs = {splits.TRAIN: train["kept"], **{s: data[s] for s in splits.EVALUATION_SPLITS}}
        if splits.PUBLIC in present:
            private = [
                data[s] for s in (splits.TRAIN, *splits.EVALUATION_SPLITS)
            ] | "Private" >> beam.Flatten()
            public = {
                "candidates": data[splits.PUBLIC],
                "reference": private,
            } | "PublicVsPrivate" >> RemoveNearDuplicates(config, "public_vs_private")
            reports.append(public["report"])
            outputs[splits.PUBLIC] = public["kept"]
        for split_name, records in outputs.items():
            _ = records | f"Write{split_name}" >> records_io.WriteRecords(
                os.path.join(out_dir, split_name)
            )
        _ = (
            reports
            | "Reports" >> beam.Flatten()
            | "ReportsList" >> beam.combiners.ToList()
            | "ByName" >> beam.Map(lambda rs: {r["name"]: r for r in rs})
            | "WriteReport" >> records_io.WriteJson(report_path)
        )
    return records_io.read_json(report_path)

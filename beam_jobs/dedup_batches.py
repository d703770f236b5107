"""The steps of the dedup join (beam_jobs/dedup.py), on whole batches of images.

Each function takes and returns numpy arrays for a batch (or a bucket of batches), so
that the Beam job moves a few elements per batch rather than one per image and hash
band: its cost is the numpy work, not the runner's per-element bookkeeping.

The join, in Beam stages:
1. `fingerprints`: decode a batch of records; thumbnails, unshifted hashes, pixel SHA-256.
2. `bucket_entries`: per key bucket, a batch's band keys (every shift of the probed side),
   pixel SHA-256s and user/identity ids.
3. `join_bucket` (after grouping by bucket): ids on both sides, exact pairs, and pairs
   whose hashes share a band and differ in few bits, by candidate batch.
4. `closest_of` (combined per candidate batch as the join's parts come) and `requests`:
   each candidate's k closest references by hash distance, requested from their batches.
5. `attach_references` (with each reference batch): the requested thumbnails.
6. `verified_pairs` (with each candidate batch): pixel verification (near_duplicates).

Ties are broken by record ids and shifts, never by batch or arrival order, so any runner
and any batching give the same pairs.
"""

import dataclasses
import hashlib
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from beam_jobs import copy_evidence, copy_prediction, schema
from beam_jobs import near_duplicates as nd

if TYPE_CHECKING:
    from beam_jobs.dedup import DedupConfig

METRICS_NAMESPACE = "dp_fedemb.dedup"
EXACT = "exact"
NEAR = "near"
CANDIDATE, REFERENCE = "candidate", "reference"
SHARED_IDS = "shared_ids"  # tagged outputs of join_bucket
EXACT_PAIRS = "exact_pairs"
RECORDS = "records"  # tagged output of fingerprints_and_records
BUCKETS = 16  # key buckets of the join: its parallelism
# Key matches joined at once (per thread): LSH's matches grow with the square of the
# images (synthetic look-alikes share many band keys), so a bucket is joined in chunks
# of candidate images of about this many matches (~60 bytes each while filtered: ~16 MB).
_MATCHES_PER_CHUNK = 1 << 18


@dataclasses.dataclass
class Fingerprints:
    """One batch of images: what dedup needs of each, as arrays."""

    key: str  # unique per batch (from its record ids)
    record_ids: list[str]  # hash of each serialized record
    users: list[str]
    identities: list[str]
    pixel_sha256: list[str]
    thumbnails: np.ndarray  # [n, T, T] uint8
    hashes: np.ndarray  # [n] uint64, unshifted
    # Each image's own pixels when small (copy_evidence.native_pixels), else None; and
    # what re-encoding needs of it when it is a JPEG (copy_evidence.jpeg_form).
    native: list[np.ndarray | None]
    jpeg: list[copy_evidence.JpegForm | None]

    def __len__(self) -> int:
        return len(self.record_ids)

    def named(self, row: int) -> dict:
        return {
            "user_id": self.users[row],
            "identity": self.identities[row],
            "record": self.record_ids[row],
        }


def record_id(serialized: bytes) -> str:
    return hashlib.blake2b(serialized, digest_size=16).hexdigest()


def pixel_sha256(pixels: np.ndarray) -> str:
    digest = hashlib.sha256(f"{pixels.shape}|{pixels.dtype}".encode())
    digest.update(np.ascontiguousarray(pixels).tobytes())
    return digest.hexdigest()


def fingerprints(batch: list[bytes], max_shift: int) -> Fingerprints:
    records = [schema.parse(s) for s in batch]
    pixels = [schema.decode_validated_image(r.image) for r in records]
    thumbnails = np.stack([nd.thumbnail(p) for p in pixels])
    ids = [record_id(s) for s in batch]
    Metrics.counter(METRICS_NAMESPACE, "images").inc(len(batch))
    return Fingerprints(
        key=hashlib.blake2b("".join(ids).encode(), digest_size=16).hexdigest(),
        record_ids=ids,
        users=[r.user_id for r in records],
        identities=[r.identity for r in records],
        pixel_sha256=[pixel_sha256(p) for p in pixels],
        thumbnails=thumbnails,
        hashes=nd.hashes(thumbnails, max_shift, probe=False)[:, 0],
        native=[copy_evidence.native_pixels(p) for p in pixels],
        jpeg=[copy_evidence.jpeg_form(r.image) for r in records],
    )


def fingerprints_and_records(batch: list[bytes], max_shift: int) -> Iterator[Any]:
    """The batch's Fingerprints, and (tagged RECORDS) its records under the batch's key,
    for the filter that keeps the candidates: one pass over the records, in batches."""
    fp = fingerprints(batch, max_shift)
    yield fp
    yield pvalue.TaggedOutput(RECORDS, (fp.key, batch))


def kept_records(key_and_records: tuple[str, list[bytes]], removed: dict) -> list[bytes]:
    _, records = key_and_records
    return [serialized for serialized in records if record_id(serialized) not in removed]


def pair(kind: str, candidate: dict, reference: dict, **measures) -> dict:
    return {"kind": kind, **measures, "candidate": candidate, "reference": reference}


def _bucket(text: str) -> int:
    return zlib.crc32(text.encode()) % BUCKETS


def _table(**columns: np.ndarray) -> np.ndarray:
    """One structured array of equal-length columns: a Beam element of these pickles as
    one buffer, not one object per column."""
    count = len(next(iter(columns.values())))
    table = np.empty(count, dtype=[(name, c.dtype, c.shape[1:]) for name, c in columns.items()])
    for name, column in columns.items():
        table[name] = column
    return table


def _band_arrays(
    fp: Fingerprints, probed: bool, max_shift: int, flips: int, bands: np.ndarray
) -> np.ndarray:
    """Every band key of every image, once per image, with the hash and shift behind it:
    at every shift when probed (the first shift giving a key, in their fixed order), else
    of the hash and its variants with weak bits flipped (the hash itself carried)."""
    if probed:
        hashes = nd.hashes(fp.thumbnails, max_shift, probe=True)
        keyed = hashes
        offsets = np.array(nd.probe_offsets(max_shift), dtype=np.int8)
    else:
        keyed = nd.flipped_hashes(fp.thumbnails, max_shift, flips)
        hashes = np.repeat(fp.hashes[:, None], keyed.shape[1], axis=1)
        offsets = np.zeros((keyed.shape[1], 2), dtype=np.int8)
    by_band = nd.band_keys(keyed, bands).transpose(0, 2, 1)  # [n, bands, variants]
    order = np.argsort(by_band, axis=2, kind="stable")
    by_band = np.take_along_axis(by_band, order, axis=2)
    first = np.ones(by_band.shape, dtype=bool)
    first[..., 1:] = by_band[..., 1:] != by_band[..., :-1]
    rows, shifts = np.nonzero(first)[0], order[first]
    return _table(
        key=by_band[first],
        row=rows.astype(np.int32),
        hash=hashes[rows, shifts],
        offset=offsets[shifts],
        # The first 64 bits of the record id: ties broken the same way on every runner.
        id=np.array([int(r[:16], 16) for r in fp.record_ids], dtype=np.uint64)[rows],
    )


def _split_by(table: np.ndarray, labels: np.ndarray) -> dict:
    """{label: the rows of `table` with that label}, in order (one sort, not a mask per
    label)."""
    order = np.argsort(labels, kind="stable")
    values, starts = np.unique(labels[order], return_index=True)
    bounds = np.r_[starts, len(order)]
    return {value: table[order[bounds[i] : bounds[i + 1]]] for i, value in enumerate(values)}


def bucket_entries(
    fp: Fingerprints, side: str, probed_side: str, max_shift: int, flips: int, bands: np.ndarray
) -> list[tuple[int, tuple[str, str, dict]]]:
    """(bucket, (side, batch key, {"bands": table, "sha": [(sha, named)], "ids": [..]})):
    the batch's band keys by key bucket, its pixel hashes and ids by their own."""
    arrays = _band_arrays(fp, side == probed_side, max_shift, flips, bands)
    entries = {
        int(bucket): {"bands": part}
        for bucket, part in _split_by(arrays, arrays["key"] % BUCKETS).items()
    }
    for row, sha in enumerate(fp.pixel_sha256):
        bucket = entries.setdefault(_bucket(sha), {})
        bucket.setdefault("sha", []).append((sha, fp.named(row)))
    for kind, names in (("user", fp.users), ("identity", fp.identities)):
        for name in set(names):
            entries.setdefault(_bucket(f"{kind}:{name}"), {}).setdefault("ids", []).append(
                (kind, name)
            )
    return [(bucket, (side, fp.key, entry)) for bucket, entry in entries.items()]


def _concatenated(parts: list[tuple[str, np.ndarray]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Batch keys (sorted), all parts' band tables in that order, and each row's batch
    (an index into the keys)."""
    parts = sorted(parts, key=lambda p: p[0])
    keys = [key for key, _ in parts]
    batch = np.concatenate([np.full(len(t), i, dtype=np.int32) for i, (_, t) in enumerate(parts)])
    return keys, np.concatenate([t for _, t in parts]), batch


def _exact_pairs(sha_entries: dict) -> list[tuple[str, dict]]:
    references = {}
    for sha, named in sha_entries[REFERENCE]:
        # Several references with one sha: the smallest record, for determinism.
        if sha not in references or named["record"] < references[sha]["record"]:
            references[sha] = named
    return [
        (named["record"], pair(EXACT, named, references[sha], hamming_distance=0, residual=0.0))
        for sha, named in sha_entries[CANDIDATE]
        if sha in references
    ]


def _closest_first(pairs: np.ndarray, candidate: np.ndarray, k: int) -> np.ndarray:
    """`pairs` reduced to each candidate's k closest references (by hash distance, then
    reference id, each pair at its smallest distance and then smallest shift), sorted by
    candidate; `candidate` [P] tells one candidate image from another."""
    if not len(pairs):
        return pairs
    # Of equal (candidate, reference, distance), the smallest shift: the order below.
    shift = (pairs["offset"][:, 0] + 8) * 16 + pairs["offset"][:, 1] + 8
    order = np.lexsort((shift, pairs["distance"], pairs["reference_id"], candidate))
    pairs, candidate = pairs[order], candidate[order]
    return pairs[nd.closest(candidate, pairs["reference_id"], pairs["distance"], k)]


def _chunks(rows: np.ndarray, candidate: np.ndarray, matches: np.ndarray) -> list[np.ndarray]:
    """`rows` by candidate image (`candidate` [rows]; a stable sort, so each image's rows
    keep their order), cut between images into runs of about _MATCHES_PER_CHUNK key
    `matches` each: a run holds at most that plus one image's matches."""
    rows = rows[np.argsort(candidate[rows], kind="stable")]
    image = candidate[rows]
    starts = np.flatnonzero(np.r_[True, image[1:] != image[:-1]])
    before = np.r_[0, np.cumsum(matches[rows])][starts]  # matches before each image
    return np.split(rows, starts[np.flatnonzero(np.diff(before // _MATCHES_PER_CHUNK)) + 1])


def join_bucket(joined: tuple[Any, Any], threshold: int, k: int) -> Iterator[Any]:
    """One bucket's ids on both sides (tagged SHARED_IDS), exact pairs (EXACT_PAIRS) and,
    per candidate batch, the pairs whose hashes share a band and differ in <= threshold
    bits, only each candidate's k closest of this bucket: (candidate batch key, (reference
    batch keys, arrays)). A pair among a candidate's k closest overall is among its k
    closest in the bucket that holds its smallest distance, so `closest_references`
    still finds every one."""
    _, entries = joined
    bands = {CANDIDATE: [], REFERENCE: []}
    sha = {CANDIDATE: [], REFERENCE: []}
    ids = {CANDIDATE: set(), REFERENCE: set()}
    for side, batch_key, entry in entries:
        if "bands" in entry:
            bands[side].append((batch_key, entry["bands"]))
        sha[side].extend(entry.get("sha", ()))
        ids[side].update(entry.get("ids", ()))
    for shared in sorted(ids[CANDIDATE] & ids[REFERENCE]):
        yield pvalue.TaggedOutput(SHARED_IDS, shared)
    for exact in _exact_pairs(sha):
        yield pvalue.TaggedOutput(EXACT_PAIRS, exact)
    if not bands[CANDIDATE] or not bands[REFERENCE]:
        return
    # Each side's batch tables go once concatenated: the bucket's band tables are the
    # join's largest state (docs/scaling.md), held once, not twice.
    del entries, joined, entry
    candidate_keys, c, c_batch = _concatenated(bands.pop(CANDIDATE))
    reference_keys, r, r_batch = _concatenated(bands.pop(REFERENCE))
    right_sorted = nd.sorted_keys(r["key"])
    candidate = (c_batch.astype(np.int64) << 32) | c["row"].astype(np.int64)

    def closest_pairs(rows: np.ndarray) -> np.ndarray:
        left, right = nd.join_keys(c["key"][rows], *right_sorted)
        left = rows[left]
        distance = nd.hamming(c["hash"][left], r["hash"][right])
        close = distance <= threshold
        left, right, distance = left[close], right[close], distance[close]
        pairs = _table(
            batch=c_batch[left],
            row=c["row"][left],
            reference_batch=r_batch[right],
            reference_row=r["row"][right],
            reference_id=r["id"][right],
            distance=distance,
            # The shift of the reference relative to the candidate at which the hashes met.
            offset=r["offset"][right].astype(np.int32) - c["offset"][left],
        )
        return _closest_first(pairs, candidate[left], k)

    # Parts by candidate image: each part's k closest per candidate are final. Each part
    # in chunks of whole candidate images, in order: the same pairs in the same order as
    # the part at once, without all its key matches in memory together.
    matches = np.searchsorted(right_sorted[0], c["key"], side="right") - np.searchsorted(
        right_sorted[0], c["key"], side="left"
    )
    chunks = [
        chunk
        for i in range(nd.THREADS)
        for chunk in _chunks(np.flatnonzero(candidate % nd.THREADS == i), candidate, matches)
    ]
    pairs = np.concatenate(nd.parallel_map(closest_pairs, chunks))
    for batch, part in _split_by(pairs, pairs["batch"]).items():
        yield candidate_keys[batch], (reference_keys, part)


def closest_of(parts: Iterable[tuple[list[str], Any]], k: int) -> tuple[list[str], Any]:
    """One candidate batch's (reference batch keys, pairs) parts, from `join_bucket` or
    from this function, as one part of each candidate's k closest references (by hash
    distance, then reference id), numbered by the keys it returns (those its pairs name);
    ([], None) holds none. A candidate's k closest of a union of parts are among its k
    closest in each part that holds them, so any grouping and order of the parts gives
    the same pairs: a combiner's."""
    parts = [(keys, table) for keys, table in parts if table is not None]
    if not parts:
        return [], None
    union = sorted({key for keys, _ in parts for key in keys})
    index = {key: i for i, key in enumerate(union)}
    merged = np.concatenate([table for _, table in parts])
    # Each part numbers its reference batches by its own key list: renumber by the union.
    merged["reference_batch"] = np.concatenate(
        [
            np.array([index[key] for key in keys], dtype=np.int32)[t["reference_batch"]]
            for keys, t in parts
        ]
    )
    merged = _closest_first(merged, merged["row"].astype(np.int64), k)
    used, renumbered = np.unique(merged["reference_batch"], return_inverse=True)
    merged["reference_batch"] = renumbered
    return [union[i] for i in used], merged


def requests(candidate_key: str, closest: tuple[list[str], Any]) -> Iterator[Any]:
    """`closest_of`'s pairs requested from their reference batches: (reference batch
    key, (candidate batch key, arrays))."""
    reference_keys, merged = closest
    if merged is None:
        return
    requested = _table(
        row=merged["row"],
        reference_row=merged["reference_row"],
        distance=merged["distance"],
        offset=merged["offset"],
    )
    for batch, part in _split_by(requested, merged["reference_batch"]).items():
        yield reference_keys[batch], (candidate_key, part)


def closest_references(grouped: tuple[Any, Any], k: int) -> Iterator[Any]:
    """Each candidate's k closest references (by hash distance, then reference id) of a
    candidate batch's grouped parts, requested from their batches (`requests`)."""
    candidate_key, parts = grouped
    yield from requests(candidate_key, closest_of(parts, k))


def attach_references(joined: tuple[Any, Any]) -> Iterator[Any]:
    """The requested references' thumbnails and names, sent to each candidate batch."""
    _, groups = joined
    (fp,) = groups["fp"]
    for candidate_key, request in groups["request"]:
        rows = np.unique(request["reference_row"])
        references = {
            "thumbnails": fp.thumbnails[rows],
            "named": [fp.named(row) for row in rows],
            "sha": [fp.pixel_sha256[row] for row in rows],
            "native": [fp.native[row] for row in rows],
        }
        request = request.copy()
        request["reference_row"] = np.searchsorted(rows, request["reference_row"])
        yield candidate_key, (references, request)


_SHARED, _NOT_SHARED = "shared", "not shared"
# Untestable: the reference has no noise to share (digit scans scaled up, flat graphics),
# or too few flat unclipped pixels are left to tell (frame-filling icons, clipped copies).
_NO_NOISE, _FEW_PIXELS = "no noise", "few pixels"
# Passed the shape test with testable noise not shared: the filter's prediction decides.
_PREDICTION = "prediction"


def _noise_tests(
    measured: dict[str, np.ndarray],
    candidates: list[np.ndarray | None],
    references: list[np.ndarray | None],
    config: "DedupConfig",
) -> list[str | None]:
    """Each aligned pair's shared-noise test (None for a pair not aligned): at the
    images' own resolution when both carry their pixels (a thumbnail averages a large
    image's noise away), else on the thumbnails. At their own resolution both the
    thumbnails' alignment and, for images of one size, the whole-pixel one
    (copy_evidence.whole_pixel_alignment) are tried: shared if either shares, untestable
    if either cannot be tested. Writes the correlation each used back into `measured`
    (the pair's report). Every pair's native tests are computed together."""
    aligned = np.isfinite(measured["residual"])
    tested = {
        i: [
            (
                measured["shared_noise"][i],
                measured["reference_noise"][i],
                measured["noise_pixels"][i],
            )
        ]
        for i in np.flatnonzero(aligned)
    }
    native: list[tuple[int, tuple[float, float, float]]] = []
    for i in tested:
        candidate, reference = candidates[i], references[i]
        if candidate is None or reference is None:
            continue
        alignment = (
            float(measured["dx"][i]),
            float(measured["dy"][i]),
            float(measured["scale"][i]),
        )
        tested[i] = []
        native.append((i, alignment))
        whole = copy_evidence.whole_pixel_alignment(
            candidate.shape, reference.shape, *alignment[:2]
        )
        if whole is not None and whole != alignment:
            native.append((i, whole))
    if native:
        results = copy_evidence.native_shared_noise(
            [candidates[i] for i, _ in native],
            [references[i] for i, _ in native],
            np.array([alignment for _, alignment in native]),
        )
        for (i, _), values in zip(native, zip(*results)):
            tested[i].append(values)
    outcomes: list[str | None] = [None] * len(aligned)
    for i, results in tested.items():
        found = []
        for correlation, level, pixels in results:
            if pixels < config.min_noise_pixels:
                found.append(_FEW_PIXELS)
            elif level < config.min_reference_noise:
                found.append(_NO_NOISE)
            else:
                found.append(_SHARED if correlation >= config.min_shared_noise else _NOT_SHARED)
        measured["shared_noise"][i] = max(correlation for correlation, _, _ in results)
        outcomes[i] = next(
            (o for o in (_SHARED, _NO_NOISE, _FEW_PIXELS) if o in found), _NOT_SHARED
        )
    return outcomes


def _same_pixels(
    measured: dict[str, np.ndarray],
    candidates: list[np.ndarray | None],
    references: list[np.ndarray | None],
    asked: list[int],
) -> np.ndarray:
    """[P] whether pair i (of `asked`, both images carrying their pixels) is the
    reference's own pixels through a grey map (copy_evidence.grey_map_spread); False for
    the pairs not asked."""
    same = np.zeros(len(candidates), dtype=bool)
    if asked:
        spreads = copy_evidence.grey_map_spread(
            [candidates[i] for i in asked],
            [references[i] for i in asked],
            np.stack([measured["dx"][asked], measured["dy"][asked]], axis=1),
        )
        same[asked] = spreads <= copy_evidence.SAME_PIXELS_TOLERANCE
    return same


def _copy_evidence(
    measured: dict[str, np.ndarray],
    candidate_native: list,
    candidate_jpeg: list,
    reference_native: list,
    pairs: np.ndarray,
    config: "DedupConfig",
) -> list[str | None]:
    """Per pair: why it is a copy (the copy_evidence module's names), or None. A pair
    aligned (past the coarse gate) whose candidate shares the reference's noise is a copy
    even if resampling changed its shape more than the shape test allows, and so is one
    whose pixels are the reference's through one grey map at a whole-pixel shift
    (`same_pixels`: a shifted or clipped copy, whatever its flat pixels); otherwise the
    shape test must pass, and then an exact JPEG re-encoding, noise that cannot be
    tested (none in the reference, or too few flat pixels: the shape alone), or a lossless
    candidate that a filter of the reference predicts within MAX_PREDICTED grey levels
    (`predicted_pixels`) makes it a copy. A lossless pair that passed by shared noise or
    the shape alone with a residual over max_residual (by the detail allowance) is a
    look-alike after all when a filter of the reference leaves more than MAX_UNEXPLAINED
    of it (copy_prediction). Else it is a look-alike, kept. The pixel tests of all the
    pairs run together (copy_evidence's pair-batched functions)."""
    shape = (
        measured["residual"]
        <= config.max_residual + config.residual_per_detail * (measured["detail"])
    )
    candidates = [candidate_native[row] for row in pairs[:, 0]]
    references = [reference_native[row] for row in pairs[:, 1]]
    noise = _noise_tests(measured, candidates, references, config)
    # The reference's own pixels through a grey map: a copy whatever its shape or flat
    # pixels (a shifted or clipped copy of a frame-filling image).
    same_pixels = _same_pixels(
        measured,
        candidates,
        references,
        [
            i
            for i, outcome in enumerate(noise)
            if outcome not in (None, _SHARED)
            and candidates[i] is not None
            and references[i] is not None
        ],
    )
    # Each pair's evidence short of the filter's prediction, which one more test decides.
    provisional: list[str | None] = []
    for i in range(len(pairs)):
        if noise[i] is None:
            provisional.append(None)
        elif noise[i] == _SHARED:
            provisional.append("shared_noise")
        elif same_pixels[i]:
            provisional.append("same_pixels")
        elif not shape[i]:
            provisional.append(None)
        elif noise[i] in (_NO_NOISE, _FEW_PIXELS):
            # No floor without the detail allowance here: it lost resized photo copies
            # (busy, few flat pixels; BENCHMARKS.md, "Same pixels"); the prediction check
            # below asks the allowance's question instead.
            provisional.append("shape_only")
        else:
            provisional.append(_PREDICTION)
    unexplained = _unexplained(
        measured,
        candidates,
        references,
        [candidate_jpeg[row] for row in pairs[:, 0]],
        [
            i
            for i, e in enumerate(provisional)
            if e == _PREDICTION
            or (
                e in ("shared_noise", "shape_only")
                and measured["residual"][i] > config.max_residual
            )
        ],
    )
    evidence = []
    for i, found in enumerate(provisional):
        if found == _PREDICTION:
            if unexplained[i] <= copy_prediction.MAX_PREDICTED:
                # A lossless candidate whose pixels a filter of the reference predicts to
                # within a render's noise: a resampled copy (a crop resized back) whose
                # noise correlation resampling weakened; another render carries its own.
                found = "predicted_pixels"
            else:
                form, reference = candidate_jpeg[pairs[i, 0]], references[i]
                difference = (
                    copy_evidence.reencode_difference(
                        reference,
                        form,
                        float(measured["dx"][i]),
                        float(measured["dy"][i]),
                        float(measured["scale"][i]),
                    )
                    if form is not None and reference is not None
                    else float("inf")
                )
                found = "jpeg_reencode" if difference <= config.jpeg_tolerance else None
        elif (
            found in ("shared_noise", "shape_only")
            and measured["residual"][i] > config.max_residual
            and unexplained[i] > copy_prediction.MAX_UNEXPLAINED
        ):
            # It passed only by the detail allowance (or shared "noise" past the shape):
            # a lossless copy that lost detail is still its reference through a filter;
            # another render of the shape is not (copy_prediction).
            found = None
        evidence.append(found)
    return evidence


def _unexplained(
    measured: dict[str, np.ndarray],
    candidates: list[np.ndarray | None],
    references: list[np.ndarray | None],
    jpeg: list[copy_evidence.JpegForm | None],
    asked: list[int],
) -> np.ndarray:
    """[P] grey levels of pair i's (of `asked`) lossless candidate that no filter of the
    reference predicts (copy_prediction.unexplained_pairs, all asked pairs together);
    nan when it cannot be told (a JPEG, whose own error is unexplained too; no native
    pixels; too few pixels; a pair not asked): a nan passes no comparison, so an untold
    pair stays as the other tests judged it."""
    values = np.full(len(candidates), np.nan)
    told = [
        i
        for i in asked
        if jpeg[i] is None and candidates[i] is not None and references[i] is not None
    ]
    if told:
        values[told] = copy_prediction.unexplained_pairs(
            [candidates[i] for i in told],
            [references[i] for i in told],
            np.stack([measured["dx"][told], measured["dy"][told], measured["scale"][told]], 1),
        )
    return values


def verified_pairs(joined: tuple[Any, Any], config: "DedupConfig") -> Iterator[Any]:
    """(candidate record id, pair) for each candidate image near a reference: the closest
    verified one (by residual, then record) with evidence that it is a copy
    (`_copy_evidence`)."""
    _, groups = joined
    (fp,) = groups["fp"]
    attached = sorted(groups["references"], key=lambda a: a[0]["named"][0]["record"])
    if not attached:
        return
    thumbnails = np.concatenate([references["thumbnails"] for references, _ in attached])
    named = [n for references, _ in attached for n in references["named"]]
    sha = [s for references, _ in attached for s in references["sha"]]
    native = [n for references, _ in attached for n in references["native"]]
    starts = np.cumsum([0] + [len(references["named"]) for references, _ in attached])
    pairs = np.concatenate(
        [
            np.stack(
                [
                    request["row"],
                    request["reference_row"] + start,
                    request["offset"][:, 0],
                    request["offset"][:, 1],
                    request["distance"],
                ],
                axis=1,
            )
            for (_, request), start in zip(attached, starts)
        ]
    )
    # Pairs both of whose images carry their pixels test their noise there only
    # (_noise_tests): the thumbnails' test would be thrown away.
    measured = nd.verify(
        fp.thumbnails,
        thumbnails,
        pairs[:, :4],
        config.max_shift + 1,
        thumbnail_noise=np.array(
            [fp.native[c] is None or native[r] is None for c, r in pairs[:, :2]], dtype=bool
        ),
    )
    evidence = _copy_evidence(measured, fp.native, fp.jpeg, native, pairs, config)
    allowed = config.max_residual + config.residual_per_detail * measured["detail"]
    Metrics.counter(METRICS_NAMESPACE, "pairs_verified").inc(len(pairs))
    best = {}
    for i in np.flatnonzero([e is not None for e in evidence]):
        row = int(pairs[i, 0])
        rank = (round(float(measured["residual"][i]), 6), named[pairs[i, 1]]["record"])
        if row not in best or rank < best[row][0]:
            best[row] = (rank, i)
    for row, (_, i) in sorted(best.items()):
        reference = int(pairs[i, 1])
        yield (
            fp.record_ids[row],
            pair(
                EXACT if sha[reference] == fp.pixel_sha256[row] else NEAR,
                fp.named(row),
                named[reference],
                hamming_distance=int(pairs[i, 4]),
                residual=round(float(measured["residual"][i]), 4),
                allowed_residual=round(float(allowed[i]), 4),
                correlation=round(float(measured["coarse"][i]), 4),
                shared_noise=round(float(measured["shared_noise"][i]), 4),
                evidence=evidence[i],
            ),
        )

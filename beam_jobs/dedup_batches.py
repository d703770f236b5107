"""Steps 1-5 of the dedup join (beam_jobs/dedup.py), on whole batches of images.

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
6. `dedup_verification.verified_pairs` (with each candidate batch): pixel verification
   (near_duplicates) and the evidence of a copy, in a module of its own.

Ties are broken by record ids and shifts, never by batch or arrival order, so any runner
and any batching give the same pairs.
"""

import dataclasses
import hashlib
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from apache_beam import pvalue
from apache_beam.metrics import Metrics

from beam_jobs import copy_evidence, schema
from beam_jobs import near_duplicates as nd

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

"""Step 6 of the dedup join (beam_jobs/dedup_batches.py has steps 1-5): each candidate
batch's pixel verification against the references attached to it, and the evidence that
a verified pair is a copy rather than a look-alike.

`verified_pairs` keeps, per candidate image, the closest reference its pixels verify
(`near_duplicates`), and only with evidence (`_copy_evidence`): the same pixels, shared
noise (`copy_evidence`), or a shape the filter's prediction explains (`copy_prediction`).
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from apache_beam.metrics import Metrics

from beam_jobs import copy_evidence, copy_prediction
from beam_jobs import near_duplicates as nd
from beam_jobs.dedup_batches import EXACT, METRICS_NAMESPACE, NEAR, pair

if TYPE_CHECKING:
    from beam_jobs.dedup import DedupConfig

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

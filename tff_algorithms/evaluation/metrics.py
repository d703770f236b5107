"""Verification metrics on embeddings: exact all-pairs recall@FAR, ROC, minibatch approximation.

Pairs are all unordered pairs {i, j}, i != j, of the evaluation images. A pair is
genuine when both images have the same identity, impostor otherwise. Its score is
the cosine similarity of the two embeddings.

Genuine pairs across users (`users` given; split mode held_out_images, where many users
photograph one landmark): a genuine pair must also join images of two different users.
Two photos of one landmark by one photographer are often near-copies (same visit, same
camera), which would inflate recall; the question is whether the model recognises the
identity in another user's image. Impostor pairs stay all pairs of different identities,
those of one user included: one photographer's two landmarks are true non-matches, and
sharing a camera makes them harder, so the threshold (the FAR) stays conservative.

Tie rule (stated once, used everywhere): a pair is ACCEPTED when its similarity is
STRICTLY GREATER than the threshold. For a target FAR with n impostor pairs, at most
a = floor(FAR·n) impostors may be accepted; the threshold is the (a+1)-th largest
impostor similarity (or -inf when a >= n). Impostors tied with the threshold are
rejected, so the achieved false-accept rate is always <= FAR, and it is the most
permissive such threshold among impostor similarities. recall@FAR is the fraction
of genuine pairs accepted (genuine pairs tied with the threshold are rejected too).

The exact computation streams over blocks of the similarity matrix twice and never
holds the N×N matrix: the first pass stores the genuine similarities (their number
grows with images per identity, not with N²) and a fine histogram of impostor
similarities; the second pass collects only the impostors in the histogram bins
around each threshold and selects it exactly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

DEFAULT_FARS = (1e-1, 1e-2, 1e-3)
_NUM_BINS = 1 << 16


@dataclasses.dataclass(frozen=True)
class RecallAtFar:
    """recall and threshold per target FAR, with the pair counts they come from."""

    recall: dict[float, float]
    threshold: dict[float, float]
    num_genuine_pairs: int
    num_impostor_pairs: int

    def as_json_dict(self) -> dict[str, float]:
        """{"0.001": recall, ...}: FAR keys as the strings metrics.json uses."""
        return {format(far, "g"): value for far, value in self.recall.items()}


def _normalized(embeddings: np.ndarray) -> np.ndarray:
    embeddings = np.asarray(embeddings, np.float64)
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [N, d], got shape {embeddings.shape}")
    norms = np.linalg.norm(embeddings, axis=1, keepdims=True)
    return embeddings / np.maximum(norms, 1e-12)


def _label_codes(labels: Sequence | np.ndarray, n: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {labels.shape}")
    return np.unique(labels, return_inverse=True)[1]


def _pair_block_masks(
    embeddings: np.ndarray,
    codes: np.ndarray,
    block_size: int,
    user_codes: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, slice, slice]]:
    """(similarity, genuine mask, impostor mask, rows, columns) over the pairs i < j.

    With `user_codes`, genuine pairs are those of two different users only."""
    n = len(embeddings)
    for r0 in range(0, n, block_size):
        r1 = min(n, r0 + block_size)
        for c0 in range(r0, n, block_size):
            c1 = min(n, c0 + block_size)
            similarity = embeddings[r0:r1] @ embeddings[c0:c1].T
            same = codes[r0:r1, None] == codes[None, c0:c1]
            impostor = ~same
            genuine = same
            if user_codes is not None:
                genuine = same & (user_codes[r0:r1, None] != user_codes[None, c0:c1])
            if c0 == r0:
                upper = np.triu(np.ones(similarity.shape, bool), k=1)
                genuine, impostor = upper & genuine, upper & impostor
            yield similarity, genuine, impostor, slice(r0, r1), slice(c0, c1)


def _pair_blocks(
    embeddings: np.ndarray,
    codes: np.ndarray,
    block_size: int,
    user_codes: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(genuine, impostor) similarities of the pairs i < j, one block at a time."""
    for similarity, genuine, impostor, _, _ in _pair_block_masks(
        embeddings, codes, block_size, user_codes
    ):
        yield similarity[genuine], similarity[impostor]


def _bin_index(similarity: np.ndarray) -> np.ndarray:
    scaled = np.floor((similarity + 1.0) * (_NUM_BINS / 2.0)).astype(np.int64)
    return np.clip(scaled, 0, _NUM_BINS - 1)


def _allowed_false_accepts(far: float, num_impostors: int) -> int:
    return int(np.floor(far * num_impostors))


def _threshold_from_sorted(impostors_descending: np.ndarray, far: float) -> float:
    allowed = _allowed_false_accepts(far, len(impostors_descending))
    if allowed >= len(impostors_descending):
        return -np.inf
    return float(impostors_descending[allowed])


def _recall(genuine_sorted: np.ndarray, threshold: float) -> float:
    accepted = len(genuine_sorted) - np.searchsorted(genuine_sorted, threshold, side="right")
    return float(accepted / len(genuine_sorted))


def _check_fars(fars: Sequence[float]) -> tuple[float, ...]:
    fars = tuple(float(f) for f in fars)
    if not fars or not all(0.0 < f <= 1.0 for f in fars):
        raise ValueError(f"FARs must be in (0, 1], got {fars}")
    return fars


def _result(genuine: np.ndarray, thresholds: dict[float, float], num_impostors: int) -> RecallAtFar:
    genuine_sorted = np.sort(genuine)
    return RecallAtFar(
        recall={far: _recall(genuine_sorted, t) for far, t in thresholds.items()},
        threshold=thresholds,
        num_genuine_pairs=len(genuine),
        num_impostor_pairs=num_impostors,
    )


def _user_codes(users: Sequence | np.ndarray | None, n: int) -> np.ndarray | None:
    return None if users is None else _label_codes(users, n)


def _check_counts(num_genuine: int, num_impostors: int, across_users: bool = False) -> None:
    if num_genuine == 0 and across_users:
        raise ValueError(
            "no genuine pairs across users: recall needs at least one identity with images "
            "of two users"
        )
    if num_genuine == 0:
        raise ValueError("no genuine pairs: recall needs at least one identity with two images")
    if num_impostors == 0:
        raise ValueError("no impostor pairs: FAR needs at least two identities")


def recall_at_far(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
    block_size: int = 2048,
    users: Sequence | np.ndarray | None = None,
) -> RecallAtFar:
    """Exact all-pairs recall@FAR (tie rule in the module docstring), blockwise.

    `users`: each image's user; given, genuine pairs are those across users only
    (module docstring). Memory is O(block_size² + genuine pairs + impostors near the
    thresholds).
    """
    fars = _check_fars(fars)
    embeddings = _normalized(embeddings)
    codes = _label_codes(labels, len(embeddings))
    user_codes = _user_codes(users, len(embeddings))

    genuine_parts = []
    impostor_histogram = np.zeros(_NUM_BINS, np.int64)
    for genuine, impostors in _pair_blocks(embeddings, codes, block_size, user_codes):
        genuine_parts.append(genuine)
        impostor_histogram += np.bincount(_bin_index(impostors), minlength=_NUM_BINS)
    genuine = np.concatenate(genuine_parts) if genuine_parts else np.zeros(0)
    num_impostors = int(impostor_histogram.sum())
    _check_counts(len(genuine), num_impostors, user_codes is not None)

    # Per FAR: the rank (from the top) of the threshold and the bin holding it.
    count_from_top = np.cumsum(impostor_histogram[::-1])
    targets = {}
    for far in fars:
        allowed = _allowed_false_accepts(far, num_impostors)
        if allowed < num_impostors:
            rank = allowed + 1
            targets[far] = (rank, _NUM_BINS - 1 - int(np.searchsorted(count_from_top, rank)))

    # Second pass: impostors in the bins next to each threshold bin. A neighbour
    # bin on each side absorbs any last-bit difference between the two passes.
    thresholds = {far: -np.inf for far in fars}
    if targets:
        windows = {
            far: (max(b - 1, 0), min(b + 1, _NUM_BINS - 1)) for far, (_, b) in targets.items()
        }
        candidates = {far: [] for far in targets}
        above = dict.fromkeys(targets, 0)
        for _, impostors in _pair_blocks(embeddings, codes, block_size):
            bins = _bin_index(impostors)
            for far, (low, high) in windows.items():
                above[far] += int(np.count_nonzero(bins > high))
                candidates[far].append(impostors[(bins >= low) & (bins <= high)])
        for far, (rank, _) in targets.items():
            window = np.sort(np.concatenate(candidates[far]))[::-1]
            thresholds[far] = float(window[rank - above[far] - 1])
    return _result(genuine, thresholds, num_impostors)


def roc_curve(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    fars: Sequence[float] | None = None,
    block_size: int = 2048,
    users: Sequence | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(FARs, exact recalls) on a log grid of FARs (default 1e-6 .. 1, 10 per decade);
    `users` as in `recall_at_far`."""
    if fars is None:
        fars = np.logspace(-6, 0, 61)
    result = recall_at_far(embeddings, labels, fars, block_size, users)
    grid = np.asarray(list(result.recall.keys()))
    return grid, np.asarray([result.recall[f] for f in grid])


def approximate_recall_at_far(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
    minibatch_size: int = 512,
    seed: int = 0,
    users: Sequence | np.ndarray | None = None,
) -> RecallAtFar:
    """recall@FAR from pairs within random minibatches only (paper's "approx").

    Images are shuffled with `seed` and split into minibatches; only pairs inside a
    minibatch are scored, then pooled and thresholded with the same tie rule. `users`
    as in `recall_at_far`.
    """
    fars = _check_fars(fars)
    embeddings = _normalized(embeddings)
    codes = _label_codes(labels, len(embeddings))
    user_codes = _user_codes(users, len(embeddings))
    order = np.random.default_rng(seed).permutation(len(embeddings))
    genuine_parts, impostor_parts = [], []
    for start in range(0, len(order), minibatch_size):
        batch = order[start : start + minibatch_size]
        batch_users = None if user_codes is None else user_codes[batch]
        for genuine, impostors in _pair_blocks(
            embeddings[batch], codes[batch], minibatch_size, batch_users
        ):
            genuine_parts.append(genuine)
            impostor_parts.append(impostors)
    genuine = np.concatenate(genuine_parts)
    impostors = np.sort(np.concatenate(impostor_parts))[::-1]
    _check_counts(len(genuine), len(impostors), user_codes is not None)
    thresholds = {far: _threshold_from_sorted(impostors, far) for far in fars}
    return _result(genuine, thresholds, len(impostors))


def bootstrap_recall_at_far(
    embeddings: Mapping[str, np.ndarray],
    labels: Sequence | np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
    num_resamples: int = 1000,
    seed: int = 0,
    block_size: int = 2048,
    users: Sequence | np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """recall@FAR of each model on `num_resamples` bootstrap resamples of the identities.

    Returns {model: [num_resamples, len(fars)]}. Every model is scored on the SAME
    resamples (same images, same labels, in the same order for each model), so the
    difference of two models' rows is a paired bootstrap of their difference.

    A resample draws identities with replacement (the unit that varies between evaluation
    sets). An identity drawn w times weighs its genuine pairs by w and its impostor pairs
    with an identity drawn v times by w*v; pairs between two draws of one identity are no
    pairs at all. The threshold and recall follow the exact tie rule on those weights (with
    every weight 1 they equal `recall_at_far`). Only impostors above the exact threshold at
    FAR min(1, 4*max(fars)) are kept, so memory stays near that fraction of all pairs.
    With `users` (as in `recall_at_far`) the genuine pairs are those across users; the
    resampled unit stays the identity.
    """
    fars = _check_fars(fars)
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    if not embeddings:
        raise ValueError("no models to score")
    n = len(next(iter(embeddings.values())))
    codes = _label_codes(labels, n)
    user_codes = _user_codes(users, n)
    num_identities = int(codes.max()) + 1
    images_per_identity = np.bincount(codes, minlength=num_identities)
    weights = identity_resample_weights(num_identities, num_resamples, seed)
    # Impostor weight in total: pairs of images of different draws, by identity counts.
    mass = weights * images_per_identity
    total_impostor = (mass.sum(axis=1) ** 2 - (mass**2).sum(axis=1)) / 2.0
    keep_far = min(1.0, 4.0 * max(fars))
    results = {}
    for name, values in embeddings.items():
        normalized = _normalized(values)
        try:
            results[name] = _bootstrap_one(
                normalized, codes, user_codes, weights, total_impostor, fars, keep_far, block_size
            )
        except _KeptTooFewImpostors:
            # Few identities: a resample that weighs a handful of them heavily can put
            # its threshold below the kept impostors. Keep them all (small sets only).
            results[name] = _bootstrap_one(
                normalized, codes, user_codes, weights, total_impostor, fars, 1.0, block_size
            )
    return results


class _KeptTooFewImpostors(Exception):
    """A resample's threshold lies below the impostors `_bootstrap_one` kept."""


def identity_resample_weights(num_identities: int, num_resamples: int, seed: int) -> np.ndarray:
    """[num_resamples, num_identities] draw counts: identities drawn with replacement."""
    rng = np.random.default_rng(seed)
    uniform = np.full(num_identities, 1.0 / num_identities)
    return rng.multinomial(num_identities, uniform, size=num_resamples).astype(np.float64)


def _bootstrap_one(
    embeddings: np.ndarray,
    codes: np.ndarray,
    user_codes: np.ndarray | None,
    weights: np.ndarray,
    total_impostor: np.ndarray,
    fars: tuple[float, ...],
    keep_far: float,
    block_size: int,
) -> np.ndarray:
    floor = recall_at_far(embeddings, codes, (keep_far,), block_size).threshold[keep_far]
    genuine, genuine_codes, impostors, impostor_codes = [], [], [], []
    for similarity, is_genuine, is_impostor, rows, cols in _pair_block_masks(
        embeddings, codes, block_size, user_codes
    ):
        row_codes = np.broadcast_to(codes[rows, None], similarity.shape)
        col_codes = np.broadcast_to(codes[None, cols], similarity.shape)
        genuine.append(similarity[is_genuine])
        genuine_codes.append(row_codes[is_genuine])
        kept = is_impostor & (similarity >= floor)
        impostors.append(similarity[kept])
        impostor_codes.append(np.stack([row_codes[kept], col_codes[kept]], axis=1))
    genuine, genuine_codes = np.concatenate(genuine), np.concatenate(genuine_codes)
    _check_counts(len(genuine), int(np.count_nonzero(total_impostor)), user_codes is not None)
    order = np.argsort(genuine, kind="stable")
    genuine, genuine_codes = genuine[order], genuine_codes[order]
    impostors, impostor_codes = np.concatenate(impostors), np.concatenate(impostor_codes)
    order = np.argsort(-impostors, kind="stable")
    impostors, impostor_codes = impostors[order], impostor_codes[order]

    recalls = np.empty((len(weights), len(fars)))

    def resampled(rows: np.ndarray) -> None:
        for r in rows:
            w = weights[r]
            allowed = np.floor(np.asarray(fars) * total_impostor[r])
            crossings = _mass_crossings(impostor_codes, w, allowed)
            genuine_mass = np.cumsum(w[genuine_codes])
            for f in range(len(fars)):
                index = crossings[f]
                if index < len(impostors):
                    threshold = impostors[index]
                elif keep_far >= 1.0:
                    threshold = -np.inf
                else:
                    raise _KeptTooFewImpostors
                rejected = int(np.searchsorted(genuine, threshold, side="right"))
                below = genuine_mass[rejected - 1] if rejected else 0.0
                # No genuine pair drawn (every multi-image identity missed): no recall.
                recalls[r, f] = (
                    (genuine_mass[-1] - below) / genuine_mass[-1] if genuine_mass[-1] else np.nan
                )

    # Resamples are independent and numpy leaves the GIL in their array work: one
    # range of them per core.
    threads = max(1, min(len(os.sched_getaffinity(0)), len(weights)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        parts = np.array_split(np.arange(len(weights)), threads)
        for done in [pool.submit(resampled, rows) for rows in parts]:
            done.result()
    return recalls


# Impostors weighed per step of `_mass_crossings`: the scan stops at the largest FAR's
# threshold, a quarter of the kept impostors on average (keep_far is 4 x the largest FAR).
_MASS_CHUNK = 1 << 15


def _mass_crossings(
    impostor_codes: np.ndarray, weights: np.ndarray, allowed: np.ndarray
) -> list[int]:
    """Per allowance: how many impostors (most similar first, identity codes [M, 2]) have
    a cumulative resample weight of at most it, i.e. searchsorted(cumulative weight,
    allowed, "right"). The weights are draw counts, so every partial sum is an integer
    and summing chunk by chunk gives exactly the whole cumulative sum's values."""
    crossings = [len(impostor_codes)] * len(allowed)
    pending = list(range(len(allowed)))
    before = 0.0
    for start in range(0, len(impostor_codes), _MASS_CHUNK):
        codes = impostor_codes[start : start + _MASS_CHUNK]
        mass = before + np.cumsum(weights[codes[:, 0]] * weights[codes[:, 1]])
        for f in [f for f in pending if mass[-1] > allowed[f]]:
            crossings[f] = start + int(np.searchsorted(mass, allowed[f], side="right"))
            pending.remove(f)
        if not pending:
            break
        before = mass[-1]
    return crossings


def percentile_interval(samples: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Central `confidence` interval of bootstrap samples (percentile method)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.nanpercentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)

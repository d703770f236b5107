"""Does the reference explain the candidate's pixels? (a check on the shape allowance)

The shape test (beam_jobs/near_duplicates.py) lets a pair differ by more than re-encoding
leaves when the reference has fine detail (`residual_per_detail`): resizing a busy photo
destroys detail, so its copy differs from it by more than a flat image's would. A second
render of a frame-filling icon at a slightly other pose differs by about as much, and
passes by the same allowance; its noise test cannot tell (too few flat pixels), or is
fooled (low-contrast shading in the "flat" pixels correlates across renders: structure,
not noise).

What a lossless copy that lost detail still is: the reference's pixels through a filter
(resampling is one, linear in the pixels; brightness and contrast are a line of the grey
level). So the candidate is predicted from the reference sampled at the pair's alignment
by the best 5x5 linear filter and offset, fitted by least squares, one filter per phase
of a 2x2 pixel grid (halving and doubling back alternate between two filters), per colour
channel when both are colour (a channel clips alone). What it leaves is `unexplained`,
RMS grey levels (degrees of freedom taken out): a copy's is its resampling's small error;
another render's is at least its own render noise (no filter of one render predicts the
other's noise) plus its pose difference. Measured on bench/bench_dedup.py's quick sets
(BENCHMARKS.md, "Predicted pixels"): at most 4.9 for the 421 lossless copies that needed
the allowance (28x28 photo tiles stored at 3/4 size), at least 6.75 for the four
look-alikes it let through. It is a check, not a separator: other renders that the noise
test already tells leave as little as 3.4 (a render with little noise, at a close pose).

The same measure is also evidence for a copy (`predicted_pixels`): a lossless candidate
that passes the shape test and that a filter of the reference predicts within
MAX_PREDICTED grey levels carries no noise of its own. Resampling a crop back to size
blurs the shared noise under the correlation test's limit (112x112 icons cropped by 4
pixels: 10% of such copies were kept), but leaves 0.7-1.7 grey levels unexplained;
another render leaves at least 3.4 (its own noise, sigma >= 2 in bench/rendered_images.py,
and its pose).

Only lossless (non-JPEG) candidates are judged: a JPEG's own quantization error is
unexplained too (up to 13 grey levels on 28x28 photo tiles at quality 30), and a JPEG
copy is told by re-encoding where it can be (copy_evidence.reencode_difference).
"""

import numpy as np

from beam_jobs import copy_evidence
from beam_jobs import near_duplicates as nd

# RMS grey levels a lossless copy's pixels may leave unexplained by a filter of its
# reference: between the copies' largest (4.9) and the look-alikes' smallest (6.75),
# nearer the look-alikes: a copy must never stay, so recall gets the wider margin.
MAX_UNEXPLAINED = 6.0
# RMS grey levels under which a lossless candidate that passes the shape test is its
# reference through a filter: missed crop copies leave <= 1.7, other renders >= 3.4.
MAX_PREDICTED = 2.5
_REACH = 2  # the filter is (2 _REACH + 1) pixels square
_PHASES = 2  # one filter per phase of a _PHASES x _PHASES pixel grid
# The thumbnails align to a fraction of a thumbnail pixel; at the images' own pixels the
# filter absorbs a shift, but not a scale error: a small search around the alignment.
_SCALE_STEPS = (-0.02, -0.01, 0.01, 0.02)
_SHIFT_STEPS = (-0.25, 0.0, 0.25)  # thumbnail pixels


def _channels(candidate: np.ndarray, reference: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(candidate, reference) planes, float64: each colour channel when both are colour,
    else grey."""
    if candidate.ndim == 3 and reference.ndim == 3 and candidate.shape[2] == reference.shape[2]:
        return [
            (candidate[..., k].astype(np.float64), reference[..., k].astype(np.float64))
            for k in range(candidate.shape[2])
        ]
    return [
        (
            copy_evidence._grey(candidate).astype(np.float64),
            copy_evidence._grey(reference).astype(np.float64),
        )
    ]


def _aligned(
    shape: tuple[int, int], references: np.ndarray, alignments: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Reference planes [B, h, w] sampled at the candidates' pixels (`shape`), each at its
    alignment [B, 3] (thumbnail dx, dy, scale about the centre, as
    copy_evidence.native_shared_noise): [B, H, W] samples and where inside."""
    t = nd.THUMBNAIL
    centre = (t - 1) / 2
    dx, dy, scale = (alignments[:, k, None] for k in range(3))

    def coordinates(size_x: int, size_y: int, shift: np.ndarray) -> np.ndarray:
        u = (np.arange(size_x, dtype=np.float64) + 0.5) * t / size_x - 0.5
        return (centre + scale * (u - centre) + shift + 0.5) * size_y / t - 0.5

    rows = coordinates(shape[0], references.shape[1], dy)
    columns = coordinates(shape[1], references.shape[2], dx)
    return copy_evidence._bilinear(references, rows, columns)


def _solved(gram: np.ndarray, right: np.ndarray) -> np.ndarray:
    """gram [B, n, n] (symmetric positive definite) solved for right [B, n], by Cholesky
    and two substitutions over the whole batch: numpy's solve (LAPACK's pivoting solver,
    one system at a time) cost 0.1-1 ms a 26x26 system on this project's 2-core host,
    the Cholesky factor 0.015 ms."""
    lower = np.linalg.cholesky(gram)
    size = gram.shape[1]
    forward = np.empty_like(right)
    for i in range(size):
        known = np.einsum("bk,bk->b", lower[:, i, :i], forward[:, :i])
        forward[:, i] = (right[:, i] - known) / lower[:, i, i]
    solution = np.empty_like(right)
    for i in reversed(range(size)):
        known = np.einsum("bk,bk->b", lower[:, i + 1 :, i], solution[:, i + 1 :])
        solution[:, i] = (forward[:, i] - known) / lower[:, i, i]
    return solution


def _squares_left(
    x: np.ndarray, aligned: np.ndarray, inside: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(sum of squares, degrees of freedom) [B] the per-phase filters leave of each plane
    x [B, H, W], predicted from its `aligned` [B, H, W] (`inside`: where sampled). A
    pixel a phase does not use is a zero row of its design: it adds nothing to the sums."""
    reach, (count, height, width) = _REACH, x.shape
    side = 2 * reach + 1
    features = side * side + 1
    total, freedom = np.zeros(count), np.zeros(count, dtype=np.int64)
    if height < side or width < side:
        return total, freedom
    inner = (slice(None), slice(reach, height - reach), slice(reach, width - reach))
    # Pixels whose whole filter window lies inside the reference, neither side clipped.
    windows = np.lib.stride_tricks.sliding_window_view(inside, (side, side), axis=(1, 2))
    usable = windows.all(axis=(3, 4)) & (x > 1)[inner] & (x < 254)[inner]
    usable &= (aligned > 1)[inner] & (aligned < 254)[inner]
    # Feature (i, j): the reference at (row - (i - reach), column - (j - reach)).
    windows = np.lib.stride_tricks.sliding_window_view(aligned, (side, side), axis=(1, 2))
    windows = windows[..., ::-1, ::-1]
    for phase_y in range(_PHASES):
        for phase_x in range(_PHASES):
            # This phase's rows and columns, counted in the inner grid.
            at = (
                slice(None),
                slice((phase_y - reach) % _PHASES, None, _PHASES),
                slice((phase_x - reach) % _PHASES, None, _PHASES),
            )
            chosen = usable[at].reshape(count, -1)
            design = np.empty((*chosen.shape, features))
            design[..., :-1] = windows[at].reshape(*chosen.shape, features - 1)
            design[..., -1] = 1.0
            design *= chosen[..., None]
            target = np.where(chosen, x[inner][at].reshape(chosen.shape), 0.0)
            pixels = chosen.sum(axis=1)
            # Too few pixels of this phase to fit its filter: left out (solved as identity).
            enough = pixels >= 2 * features
            # Normal equations (26 unknowns): an SVD per phase cost 10x the rest at 112x112.
            transposed = design.transpose(0, 2, 1)
            gram = transposed @ design
            diagonal = np.arange(features)
            gram[:, diagonal, diagonal] += (1e-6 * np.trace(gram, axis1=1, axis2=2) / features)[
                :, None
            ]
            gram[~enough] = np.eye(features)
            fitted = _solved(gram, (transposed @ target[..., None])[..., 0])
            left = target - (design @ fitted[..., None])[..., 0]
            total += np.where(enough, np.einsum("bp,bp->b", left, left), 0.0)
            freedom += np.where(enough, pixels - features, 0)
    return total, freedom


# Pixels (fits x plane pixels) computed at once: bounded memory whatever the image size.
_PART_PIXELS = 1 << 17


def _unexplained_at(
    planes: list[list[tuple[np.ndarray, np.ndarray]]], asked: list[tuple[int, tuple]]
) -> np.ndarray:
    """RMS grey levels left [len(asked)] of pair p's `planes` at each asked (p, (dx, dy,
    scale)); nan where no pixels are left. Fits of one pair of plane sizes are computed
    together, in parts over near_duplicates.THREADS."""
    total, freedom = np.zeros(len(asked)), np.zeros(len(asked), dtype=np.int64)
    fits: dict[tuple, list[tuple[int, int]]] = {}  # sizes -> (asked index, plane)
    for index, (pair, _) in enumerate(asked):
        for plane, (x, y) in enumerate(planes[pair]):
            fits.setdefault((x.shape, y.shape), []).append((index, plane))
    parts = []
    for (shape, _), members in fits.items():
        step = max(1, _PART_PIXELS // (shape[0] * shape[1]))
        parts.extend(members[start : start + step] for start in range(0, len(members), step))

    def fitted(part: list[tuple[int, int]]) -> tuple[list, tuple[np.ndarray, np.ndarray]]:
        x = np.stack([planes[asked[i][0]][plane][0] for i, plane in part])
        y = np.stack([planes[asked[i][0]][plane][1] for i, plane in part])
        alignments = np.array([asked[i][1] for i, _ in part], dtype=np.float64)
        return part, _squares_left(x, *_aligned(x.shape[1:], y, alignments))

    for part, (squares, dof) in nd.parallel_map(fitted, parts):
        index = np.array([i for i, _ in part])
        np.add.at(total, index, squares)
        np.add.at(freedom, index, dof)
    return np.where(freedom > 0, np.sqrt(total / np.maximum(freedom, 1)), np.nan)


def unexplained_pairs(
    candidates: list[np.ndarray], references: list[np.ndarray], alignments: np.ndarray
) -> np.ndarray:
    """[P] RMS grey levels of candidate i's pixels that no filter of reference i's
    predicts (module docstring), at the thumbnails' alignment alignments[i] (dx, dy,
    scale), searched a little around it in scale, then in shift, and at the whole-pixel
    alignment between images of one size; the least found. nan where too few pixels are
    left to tell. Every pair's scale search is fitted together, then every shift search."""
    if not candidates:
        return np.zeros(0)
    planes = [_channels(c, r) for c, r in zip(candidates, references)]
    starts = []  # (pair, (dx, dy, scale)) for each start
    for pair, (candidate, reference, (dx, dy, scale)) in enumerate(
        zip(candidates, references, np.asarray(alignments, dtype=np.float64).tolist())
    ):
        starts.append((pair, (dx, dy, scale)))
        whole = copy_evidence.whole_pixel_alignment(candidate.shape, reference.shape, dx, dy)
        if whole is not None:
            starts.append((pair, whole))
    scales = [
        (pair, (dx, dy, scale + step))
        for pair, (dx, dy, scale) in starts
        for step in (0.0, *_SCALE_STEPS)
    ]
    by_scale = _unexplained_at(planes, scales).reshape(len(starts), -1)
    searched = []  # (pair, start shift, its least value, the scale it was at)
    for (pair, (dx, dy, scale)), values in zip(starts, by_scale):
        tried = [scale, *(scale + step for step in _SCALE_STEPS)]
        finite = [(v, s) for v, s in zip(values.tolist(), tried) if np.isfinite(v)]
        if finite:
            searched.append((pair, (dx, dy), *min(finite)))
    shifts = [(x, y) for y in _SHIFT_STEPS for x in _SHIFT_STEPS if x or y]
    by_shift = _unexplained_at(
        planes,
        [(pair, (dx + x, dy + y, s)) for pair, (dx, dy), _, s in searched for x, y in shifts],
    ).reshape(len(searched), len(shifts))
    best = np.full(len(candidates), np.nan)
    for (pair, _, value, _), values in zip(searched, by_shift):
        value = min([value, *values.tolist()])
        best[pair] = value if not np.isfinite(best[pair]) else min(best[pair], value)
    return best


def unexplained(
    candidate: np.ndarray, reference: np.ndarray, dx: float, dy: float, scale: float
) -> float:
    """`unexplained_pairs` of one pair."""
    return float(unexplained_pairs([candidate], [reference], np.array([[dx, dy, scale]]))[0])

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
    shape: tuple[int, int], reference: np.ndarray, dx: float, dy: float, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """The reference plane sampled at the candidate's pixels (thumbnail alignment dx, dy,
    scale about the centre, as copy_evidence.native_shared_noise), and where inside."""
    t = nd.THUMBNAIL
    centre = (t - 1) / 2

    def coordinates(size_x: int, size_y: int, shift: float) -> np.ndarray:
        u = (np.arange(size_x, dtype=np.float64) + 0.5) * t / size_x - 0.5
        return (centre + scale * (u - centre) + shift + 0.5) * size_y / t - 0.5

    rows = coordinates(shape[0], reference.shape[0], dy)
    columns = coordinates(shape[1], reference.shape[1], dx)
    return copy_evidence._bilinear(reference, rows, columns)


def _squares_left(x: np.ndarray, aligned: np.ndarray, inside: np.ndarray) -> tuple[float, int]:
    """(sum of squares, degrees of freedom) the per-phase filters leave of plane x."""
    reach, (height, width) = _REACH, x.shape
    # Pixels whose whole filter window lies inside the reference, neither side clipped.
    usable = inside.copy()
    for dy in range(-reach, reach + 1):
        for dx in range(-reach, reach + 1):
            usable &= np.roll(inside, (dy, dx), axis=(0, 1))
    usable[:reach] = usable[height - reach :] = False
    usable[:, :reach] = usable[:, width - reach :] = False
    usable &= (x > 1) & (x < 254) & (aligned > 1) & (aligned < 254)
    window = [
        np.roll(aligned, (dy, dx), axis=(0, 1))
        for dy in range(-reach, reach + 1)
        for dx in range(-reach, reach + 1)
    ]
    features = np.stack(window + [np.ones_like(aligned)], axis=-1)
    rows, columns = np.mgrid[:height, :width]
    total, freedom = 0.0, 0
    for phase_y in range(_PHASES):
        for phase_x in range(_PHASES):
            chosen = usable & (rows % _PHASES == phase_y) & (columns % _PHASES == phase_x)
            design, target = features[chosen], x[chosen]
            if len(target) < 2 * design.shape[1]:
                continue  # too few pixels of this phase to fit its filter
            # Normal equations (26 unknowns): an SVD per phase cost 10x the rest at 112x112.
            gram = design.T @ design
            gram[np.diag_indices_from(gram)] += 1e-6 * np.trace(gram) / len(gram)
            fitted = np.linalg.solve(gram, design.T @ target)
            left = target - design @ fitted
            total += float(left @ left)
            freedom += len(target) - design.shape[1]
    return total, freedom


def _unexplained_at(
    planes: list[tuple[np.ndarray, np.ndarray]], dx: float, dy: float, scale: float
) -> float:
    total, freedom = 0.0, 0
    for x, y in planes:
        aligned, inside = _aligned(x.shape, y, dx, dy, scale)
        squares, dof = _squares_left(x, aligned, inside)
        total, freedom = total + squares, freedom + dof
    return float(np.sqrt(total / freedom)) if freedom > 0 else float("nan")


def unexplained(
    candidate: np.ndarray, reference: np.ndarray, dx: float, dy: float, scale: float
) -> float:
    """RMS grey levels of the candidate's pixels that no filter of the reference's predicts
    (module docstring), at the thumbnails' alignment (dx, dy, scale), searched a little
    around it in scale, then in shift, and at the whole-pixel alignment between images of
    one size; the least found. nan where too few pixels are left to tell."""
    planes = _channels(candidate, reference)
    starts = [(dx, dy, scale)]
    whole = copy_evidence.whole_pixel_alignment(candidate.shape, reference.shape, dx, dy)
    if whole is not None:
        starts.append(whole)
    best = float("nan")
    for start_dx, start_dy, start_scale in starts:
        scored = [(_unexplained_at(planes, start_dx, start_dy, start_scale), start_scale)]
        for step in _SCALE_STEPS:
            scored.append(
                (
                    _unexplained_at(planes, start_dx, start_dy, start_scale + step),
                    start_scale + step,
                )
            )
        finite = [s for s in scored if np.isfinite(s[0])]
        if not finite:
            continue
        value, best_scale = min(finite)
        for shift_y in _SHIFT_STEPS:
            for shift_x in _SHIFT_STEPS:
                if shift_x or shift_y:
                    value = min(
                        value,
                        _unexplained_at(planes, start_dx + shift_x, start_dy + shift_y, best_scale),
                    )
        best = value if not np.isfinite(best) else min(best, value)
    return best

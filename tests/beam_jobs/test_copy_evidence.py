"""copy_evidence's pair-batched pixel tests, against plain computations of one pair.

Dedup runs the tests of all the pairs a batch verifies together (pairs of one size at
once). On real images (bench/real_images.py: photo tiles, colour and grey, and digit
scans; copies made by its transforms) each pair's result must be what a plain loop over
that one pair computes, written here apart from the module's code.
"""

import io

import numpy as np
import pytest
from PIL import Image

from beam_jobs import copy_evidence, near_duplicates
from bench import real_images

_TRANSFORMS = ("shift_1px", "shift_2px", "brighter_40", "jpeg_q60", "resize_half_and_back")


def _decoded(image: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image)))


@pytest.fixture(scope="module")
def pairs() -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """(candidates, references, alignments [P, 3]): copies and other images of
    references at 28 and 40 pixels, and pairs of two sizes."""
    candidates, references, alignments = [], [], []
    rng = np.random.default_rng(0)
    for size in (28, 40):
        originals = real_images.originals(size, digits_per_class=2)[::6]
        for k, original in enumerate(originals):
            copies = [_decoded(real_images.TRANSFORMS[t](original)) for t in _TRANSFORMS]
            others = [originals[(k + 1) % len(originals)].pixels]
            for candidate in copies + others:
                candidates.append(candidate)
                references.append(original.pixels)
                alignments.append(
                    (rng.uniform(-2.5, 2.5), rng.uniform(-2.5, 2.5), rng.uniform(0.93, 1.07))
                )
    small, large = real_images.originals(28, 2)[0], real_images.originals(40, 2)[0]
    candidates += [small.pixels, large.pixels]
    references += [large.pixels, small.pixels]
    alignments += [(0.0, 0.0, 1.0)] * 2
    return candidates, references, np.array(alignments, dtype=np.float32)


def _grey(pixels: np.ndarray) -> np.ndarray:
    if pixels.ndim == 2:
        return pixels
    return np.asarray(Image.fromarray(pixels).convert("L"))


def _plain_spread(candidate: np.ndarray, reference: np.ndarray, dx: float, dy: float) -> float:
    """The documented measure, one pair and one shift at a time: the overlap sliced out,
    numpy's unique for the grey map, its polyfit for the line."""
    x, y = _grey(candidate).astype(float), _grey(reference).astype(float)
    if x.shape != y.shape:
        return float("inf")
    height, width = x.shape
    t = near_duplicates.THUMBNAIL
    best = float("inf")
    for shift_y in range(round(dy * height / t) - 1, round(dy * height / t) + 2):
        for shift_x in range(round(dx * width / t) - 1, round(dx * width / t) + 2):
            if abs(shift_x) >= width // 2 or abs(shift_y) >= height // 2:
                continue
            # Candidate pixel (r, c) against reference pixel (r + shift_y, c + shift_x).
            a = x[max(0, -shift_y) : height - shift_y, max(0, -shift_x) : width - shift_x]
            b = y[max(0, shift_y) : height + shift_y, max(0, shift_x) : width + shift_x]
            clear = (a > 1) & (a < 254) & (b > 1) & (b < 254)
            a, b = a[clear], b[clear]
            by_levels = max(_around_levels(a, b), _around_levels(b, a))
            by_line = max(_around_line(a, b), _around_line(b, a))
            best = min(best, by_levels, by_line)
    return best


def _around_levels(values: np.ndarray, levels: np.ndarray) -> float:
    found, group = np.unique(levels, return_inverse=True)
    freedom = len(values) - len(found)
    if freedom < 64:
        return float("inf")
    means = np.bincount(group, values) / np.bincount(group)
    return float(np.sqrt(((values - means[group]) ** 2).sum() / freedom))


def _around_line(values: np.ndarray, levels: np.ndarray) -> float:
    freedom = len(values) - 2
    if freedom < 16:
        return float("inf")
    if np.ptp(levels) == 0:
        return float(np.sqrt(((values - values.mean()) ** 2).sum() / freedom))
    slope, intercept = np.polyfit(levels, values, 1)
    return float(np.sqrt(((values - slope * levels - intercept) ** 2).sum() / freedom))


def test_grey_map_spread_of_each_pair_is_its_plain_computation(pairs):
    candidates, references, alignments = pairs
    spreads = copy_evidence.grey_map_spread(candidates, references, alignments[:, :2])
    expected = np.array(
        [
            _plain_spread(c, r, float(a[0]), float(a[1]))
            for c, r, a in zip(candidates, references, alignments)
        ]
    )
    assert np.array_equal(np.isinf(spreads), np.isinf(expected))
    assert np.isinf(spreads[-2:]).all()  # two sizes
    finite = np.isfinite(expected)
    assert finite.sum() > len(expected) // 2
    np.testing.assert_allclose(spreads[finite], expected[finite], rtol=1e-7, atol=1e-9)
    # Both sides of the tolerance occur: copies under it, other images over.
    assert (spreads <= copy_evidence.SAME_PIXELS_TOLERANCE).sum() >= 5
    assert (spreads[finite] > copy_evidence.SAME_PIXELS_TOLERANCE).sum() >= 5


def test_shared_noise_of_a_pair_does_not_depend_on_the_pairs_beside_it(pairs):
    candidates, references, alignments = pairs
    together = copy_evidence.native_shared_noise(candidates, references, alignments)
    for i in range(0, len(candidates), 7):
        alone = copy_evidence.native_shared_noise([candidates[i]], [references[i]], alignments[i])
        for measure, value in zip(together, alone):
            np.testing.assert_allclose(measure[i], value[0], rtol=1e-5, atol=1e-6)
    correlation, level, pixels = together
    assert (pixels > 0).any() and np.isfinite(correlation).all()

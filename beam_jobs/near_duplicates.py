"""Near-duplicate images in numpy: thumbnails, shift-probed hashes, pixel verification.

Everything here works on batches (of images, of pairs) so that one Beam stage
(beam_jobs/dedup_batches.py) or one plain loop (bench/bench_beam.py) handles a thousand
images a call; nothing here knows about Beam.

Thumbnail: every image, whatever its size or colour, becomes a THUMBNAIL x THUMBNAIL grey
image (luma, antialiased resize). A 28x28 and a 112x112 copy of one picture then meet at
one scale, and a colour image meets its grey copy exactly; shifts are in thumbnail pixels
(2 of them are 1.75 pixels at 28x28, 7 at 112x112).

Hash (candidate generation only): the pHash of the thumbnail's interior, lightly blurred:
the 63 lowest non-constant DCT coefficients, one bit each for above or below their median.
A shifted copy is found by hashing one side at every integer shift up to `max_shift`, and
more copies are found by also keying the other side's hash with its least certain bits
(coefficients nearest the median) flipped, the bits a re-encoded copy most often loses.

Verification (the decision): a hash cannot tell a re-encoded copy from another scan of the
same glyph; low-entropy images (digits, sketches, small faces) of different people often
share most hash bits. So a pair is aligned and compared pixel by pixel, over the overlap
of the two images only: the integer shift within a pixel of the one its hashes met at;
then, when the images correlate at all there (GATE, at scales 1 and +-7% for crops
resized back), Gauss-Newton steps on shift and scale. The candidate's grey levels are
rank-matched to the reference's, so any monotone change (brightness, contrast, gamma,
clipping) vanishes; what remains is blurred (sigma 1.5 px: JPEG and resampling noise
averages out, a stroke that differs does not) and its peak, in units of the reference's
standard deviation, is the residual. Re-encoding and resizing destroy fine detail, so a
copy may leave a residual that grows with the reference's own detail (mean |reference -
blurred reference|, same units): near duplicates have residual <= max_residual +
residual_per_detail * detail (beam_jobs/dedup.py). bench/bench_dedup.py measures this on
real images; the thresholds were chosen on one half of them and checked on the other.
The shape is not the whole decision: two renders of one glyph can pass it, and
beam_jobs/copy_evidence.py (whose thumbnail test `verify` runs on each aligned pair)
asks whether the candidate carries the reference's own noise.
"""

import concurrent.futures
import functools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from beam_jobs import copy_evidence

THUMBNAIL = 32
_CENTRE = (THUMBNAIL - 1) / 2
_DCT_SIDE = 8  # 8x8 lowest frequencies, less the constant one: 63 hash bits
HASH_BITS = _DCT_SIDE * _DCT_SIDE - 1
_HASH_BLUR = 0.8  # keeps JPEG ringing and noise out of the hash
_RESIDUAL_BLUR = 1.5
_DETAIL_BLUR = 1.0
# Residuals are in units of max(std, _MIN_STD) grey levels: on a nearly flat image the
# noise of re-encoding is not magnified into a difference.
_MIN_STD = 8.0
# Scales tried before refinement besides 1 (crops resized back: 2 pixels of 28 are 7%),
# and the range refinement stays in.
_GATE_SCALES = (0.93, 1.07)
_SCALE_RANGE = (0.85, 1.18)
# Pairs less correlated than this after coarse alignment are not refined: bench_dedup's
# copies all correlate >= 0.73, 86% of the default synthetic data's closest pairs < 0.7.
GATE = 0.7
_GRID = np.arange(THUMBNAIL, dtype=np.float32) - _CENTRE
# Verification chunks and join parts run on this many threads: numpy releases the GIL in
# its array work, so one process uses every core it may run on (the DirectRunner this
# project defaults to runs one bundle at a time).
THREADS = max(1, len(os.sched_getaffinity(0)))
_MIN_PART = 128  # images: smaller parts cost more in threads than they save


def thumbnail(pixels: np.ndarray) -> np.ndarray:
    """THUMBNAIL x THUMBNAIL uint8 grey thumbnail of HxW or HxWx3 uint8 pixels."""
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if image.mode != "L":
        image = image.convert("L")  # ITU-R 601 luma, as a grey copy is made
    # PIL's bilinear filter widens with the reduction: an area average when shrinking.
    return np.asarray(image.resize((THUMBNAIL, THUMBNAIL), Image.BILINEAR))


@functools.cache
def _blur_matrix(sigma: float, size: int) -> np.ndarray:
    """[size, size] Gaussian blur as a matrix (edges repeated): blurred = B @ image @ B.T."""
    radius = int(np.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    matrix = np.zeros((size, size), dtype=np.float64)
    for i in range(size):
        for offset, weight in zip(range(-radius, radius + 1), taps):
            matrix[i, min(max(i + offset, 0), size - 1)] += weight
    return matrix


def blur(images: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur of [..., T, T] images (edges repeated), as two matrix products:
    in float64 for float64 images, else in float32. BLAS sums a product in an order
    that depends on its kernel and the batch size; in float64 those differences stay
    ~1e-13, far below any threshold a decision compares a blurred value with."""
    dtype = np.float64 if images.dtype == np.float64 else np.float32
    matrix = _blur_matrix(sigma, images.shape[-1]).astype(dtype)
    rows = matrix @ images.astype(dtype).reshape(-1, *images.shape[-2:])
    return (rows.reshape(-1, images.shape[-1]) @ matrix.T).reshape(images.shape)


def _dct_matrix(size: int) -> np.ndarray:
    k = np.arange(_DCT_SIDE)[:, None]
    i = np.arange(size)[None, :]
    return np.cos(np.pi * (2 * i + 1) * k / (2 * size)).astype(np.float32)


def probe_offsets(max_shift: int) -> list[tuple[int, int]]:
    return [
        (dx, dy)
        for dy in range(-max_shift, max_shift + 1)
        for dx in range(-max_shift, max_shift + 1)
    ]


def _coefficients(thumbnails: np.ndarray, max_shift: int, probe: bool):
    """([N, probes, HASH_BITS] DCT coefficients of the interior windows, their medians)."""
    count, side = len(thumbnails), THUMBNAIL - 2 * max_shift
    images = blur(thumbnails, _HASH_BLUR)
    dct = _dct_matrix(side)
    offsets = probe_offsets(max_shift) if probe else [(0, 0)]
    # D W D^T of each window W, in large products: first D times each row band, shared by
    # every horizontal offset of that band.
    by_row = {}
    for dy in sorted({dy for _, dy in offsets}):
        band = images[:, max_shift + dy : max_shift + dy + side, :]  # [N, side, T]
        product = dct @ band.transpose(1, 0, 2).reshape(side, -1)  # [8, N * T]
        by_row[dy] = product.reshape(_DCT_SIDE, count, THUMBNAIL).transpose(1, 0, 2)
    coefficients = np.stack(
        [
            (
                by_row[dy][:, :, max_shift + dx : max_shift + dx + side].reshape(-1, side) @ dct.T
            ).reshape(count, -1)[:, 1:]
            for dx, dy in offsets
        ],
        axis=1,
    )
    median = np.partition(coefficients, HASH_BITS // 2, axis=-1)[..., HASH_BITS // 2, None]
    return coefficients, median


def _by_parts(function: Callable[[np.ndarray], np.ndarray], thumbnails: np.ndarray) -> np.ndarray:
    """function(thumbnails), image by image independent, computed in parts on THREADS."""
    if len(thumbnails) < 2 * _MIN_PART:
        return function(thumbnails)
    parts = np.array_split(thumbnails, min(THREADS, len(thumbnails) // _MIN_PART))
    return np.concatenate(parallel_map(function, parts))


def hashes(thumbnails: np.ndarray, max_shift: int, probe: bool) -> np.ndarray:
    """[N, probes] uint64 pHashes of the interior (a max_shift border off), at every offset
    up to max_shift when `probe`, else only at (0, 0) (probes = 1)."""

    def part_hashes(part: np.ndarray) -> np.ndarray:
        coefficients, median = _coefficients(part, max_shift, probe)
        return _packed(coefficients > median)

    return _by_parts(part_hashes, thumbnails)


def flipped_hashes(thumbnails: np.ndarray, max_shift: int, flips: int) -> np.ndarray:
    """[N, 1 + flips] uint64: the unshifted hash, then the hash with each of its `flips`
    least certain bits flipped (coefficients closest to the median): the bits a copy's
    hash most often differs in, so band keys of these variants find it more often."""

    def part_hashes(part: np.ndarray) -> np.ndarray:
        coefficients, median = _coefficients(part, max_shift, probe=False)
        coefficients, median = coefficients[:, 0], median[:, 0]
        base = _packed(coefficients > median)
        weakest = np.argsort(np.abs(coefficients - median), axis=1, kind="stable")[:, :flips]
        flipped = base[:, None] ^ (np.uint64(1) << weakest.astype(np.uint64))
        return np.concatenate([base[:, None], flipped], axis=1)

    return _by_parts(part_hashes, thumbnails)


def _packed(bits: np.ndarray) -> np.ndarray:
    """[..., HASH_BITS] booleans -> [...] uint64, bit i of the hash = bits[..., i]."""
    packed = np.packbits(bits, axis=-1, bitorder="little")  # [..., 8] bytes, little end first
    return np.ascontiguousarray(packed).view("<u8")[..., 0].astype(np.uint64)


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise distance of uint64 arrays (broadcast): a population count in a few whole-
    array operations (bit pairs, nibbles, bytes, then one multiply sums the bytes)."""
    x = np.bitwise_xor(a, b).astype(np.uint64)
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return ((x * np.uint64(0x0101010101010101)) >> np.uint64(56)).astype(np.int32)


def band_bits(num_bands: int, bits_per_band: int) -> np.ndarray:
    """[num_bands] uint64 masks of hash bit positions, bits_per_band each: fixed, so every
    worker agrees."""
    rng = np.random.default_rng(0)
    positions = [rng.choice(HASH_BITS, bits_per_band, replace=False) for _ in range(num_bands)]
    return np.array([sum(1 << int(bit) for bit in band) for band in positions], dtype=np.uint64)


MAX_BANDS = 256
# Mixed into each band's key, so that equal bits in two bands make different keys.
_BAND_SALTS = (
    np.random.default_rng(1).integers(0, 2**63, size=MAX_BANDS, dtype=np.int64).astype(np.uint64)
)


def band_keys(hash_values: np.ndarray, bands: np.ndarray) -> np.ndarray:
    """[..., num_bands] int64 join keys: the band's bits of the hash, salted by the band.
    Two hashes agreeing on a band's bits share its key; any other coincidence (1 in 2^50)
    only proposes a pair that the Hamming distance then turns away."""
    keys = (hash_values[..., None] & bands) ^ _BAND_SALTS[: len(bands)]
    return keys.view(np.int64)


def sorted_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys sorted, the order that sorts them): one side of `join_keys`, sorted once."""
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def join_keys(
    left_keys: np.ndarray, right_sorted: np.ndarray, right_order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(left positions, right positions) of every pair of equal keys (1-D int64 arrays;
    the right side as `sorted_keys` gives it)."""
    start = np.searchsorted(right_sorted, left_keys, side="left")
    count = np.searchsorted(right_sorted, left_keys, side="right") - start
    left = np.repeat(np.arange(len(left_keys)), count)
    # Position within each left key's run of equal right keys.
    within = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return left, right_order[np.repeat(start, count) + within]


def closest(
    candidates: np.ndarray, references: np.ndarray, distances: np.ndarray, k: int
) -> np.ndarray:
    """Indices of the pairs to verify: per candidate, its k closest references (each pair
    once, at its smallest distance; ties broken by reference, so the choice is stable)."""
    by_pair = np.lexsort((distances, references, candidates))
    c, r = candidates[by_pair], references[by_pair]
    first = np.r_[True, (c[1:] != c[:-1]) | (r[1:] != r[:-1])]
    pairs = by_pair[first]
    pairs = pairs[np.lexsort((references[pairs], distances[pairs], candidates[pairs]))]
    c = candidates[pairs]
    run_start = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    rank = np.arange(len(pairs)) - np.repeat(run_start, np.diff(np.r_[run_start, len(pairs)]))
    return pairs[rank < k]


def _integer_alignment(
    x: np.ndarray, y: np.ndarray, dx: np.ndarray, dy: np.ndarray, search: int
) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dy) [P]: the integer shift within one pixel of (dx, dy), and inside
    [-search, search]^2, at which y is best correlated with x's centre (T - 2 search)^2."""
    count, side, steps = len(x), THUMBNAIL - 2 * search, 2 * search + 1
    centre = x[:, search : search + side, search : search + side].reshape(count, -1)
    centre = centre - centre.mean(axis=1, keepdims=True)
    # [P, 2 search + 1, 2 search + 1, side, side]: a view, nothing copied yet.
    windows = np.lib.stride_tricks.sliding_window_view(y, (side, side), axis=(1, 2))
    around = np.array([-1, 0, 1])
    rows = np.clip(dy.astype(np.intp)[:, None] + around + search, 0, steps - 1)
    columns = np.clip(dx.astype(np.intp)[:, None] + around + search, 0, steps - 1)
    chosen = windows[np.arange(count)[:, None, None], rows[:, :, None], columns[:, None, :]]
    chosen = chosen.reshape(count, 9, -1)
    sums = chosen.sum(axis=2)
    norms = np.sqrt(np.maximum((chosen * chosen).sum(axis=2) - sums * sums / side**2, 1e-6))
    best = np.argmax((chosen @ centre[:, :, None])[..., 0] / norms, axis=1)
    pick = np.arange(count)
    return (
        (columns[pick, best % 3] - search).astype(np.float32),
        (rows[pick, best // 3] - search).astype(np.float32),
    )


def _interpolation(coordinates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[P, T, T] matrices that sample rows (or columns) at `coordinates` [P, T] linearly,
    and [P, T] whether each coordinate lies inside the image."""
    count = len(coordinates)
    inside = (coordinates >= -1e-3) & (coordinates <= THUMBNAIL - 1 + 1e-3)
    clipped = np.clip(coordinates, 0, THUMBNAIL - 1)
    low = np.minimum(clipped.astype(np.intp), THUMBNAIL - 2)
    weight = (clipped - low).astype(np.float32)
    matrix = np.zeros((count, THUMBNAIL, THUMBNAIL), dtype=np.float32)
    pairs, out = np.arange(count)[:, None], np.arange(THUMBNAIL)[None, :]
    matrix[pairs, out, low] = 1 - weight
    matrix[pairs, out, low + 1] += weight
    return matrix, inside


def _sample(images: np.ndarray, scale: np.ndarray, dx: np.ndarray, dy: np.ndarray):
    """images [P, T, T] (or [P, K, T, T]) resampled bilinearly at centre + scale * (p -
    centre) + (dx, dy) for every thumbnail pixel p, and [P, T, T] whether that lies inside
    the image; scale, dx, dy per pair [P]. Two small matrix products per image."""
    rows, inside_rows = _interpolation(_CENTRE + _GRID[None, :] * scale[:, None] + dy[:, None])
    columns, inside_columns = _interpolation(
        _CENTRE + _GRID[None, :] * scale[:, None] + dx[:, None]
    )
    if images.ndim == 4:
        rows, columns = rows[:, None], columns[:, None]
    sampled = rows @ images @ np.swapaxes(columns, -1, -2)
    return sampled, inside_rows[:, :, None] & inside_columns[:, None, :]


def _correlation(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Pearson correlation of x and y over the valid pixels, per pair."""
    m = valid.astype(np.float32)
    n = np.maximum(m.sum(axis=(1, 2)), 1.0)
    xm, ym = x * m, y * m
    sx, sy = xm.sum(axis=(1, 2)), ym.sum(axis=(1, 2))
    cov = (xm * y).sum(axis=(1, 2)) - sx * sy / n
    vx = (xm * x).sum(axis=(1, 2)) - sx * sx / n
    vy = (ym * y).sum(axis=(1, 2)) - sy * sy / n
    return cov / np.sqrt(np.maximum(vx * vy, 1e-6))


def _gradients(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Central differences along columns and rows (one-sided at the edges)."""
    gx = np.empty_like(y)
    gx[:, :, 1:-1] = (y[:, :, 2:] - y[:, :, :-2]) / 2
    gx[:, :, 0], gx[:, :, -1] = y[:, :, 1] - y[:, :, 0], y[:, :, -1] - y[:, :, -2]
    gy = np.empty_like(y)
    gy[:, 1:-1] = (y[:, 2:] - y[:, :-2]) / 2
    gy[:, 0], gy[:, -1] = y[:, 1] - y[:, 0], y[:, -1] - y[:, -2]
    return gx, gy


def _refine(x, y, dx, dy, scale, iterations: int = 4):
    """Gauss-Newton steps on (dx, dy, scale), grey levels fitted by gain and offset; the
    best correlation seen wins (a step may overshoot). Returns y sampled there, where it
    is valid, and that alignment (dx, dy, scale)."""
    gradients = np.stack(_gradients(y), axis=1)  # [P, 2, T, T]
    best, valid = _sample(y, scale, dx, dy)
    score = _correlation(x, best, valid)
    sampled, current_valid = best, valid
    best_dx, best_dy, best_scale = dx, dy, scale
    eye = np.eye(5, dtype=np.float32) * 1e-3
    for _ in range(iterations):
        gx, gy = _sample(gradients, scale, dx, dy)[0].transpose(1, 0, 2, 3)
        # d sample / d scale at pixel p is the gradient times (p - centre).
        gs = gx * _GRID[None, None, :] + gy * _GRID[None, :, None]
        m = current_valid.astype(np.float32)
        features = np.stack([sampled, np.ones_like(sampled), gx, gy, gs], axis=1)
        features = (features * m[:, None]).reshape(len(x), 5, -1)
        gram = features @ features.transpose(0, 2, 1) + eye
        target = features @ (x * m).reshape(len(x), -1, 1)
        theta = np.linalg.solve(gram, target)[..., 0]
        gain = np.where(np.abs(theta[:, 0]) > 1e-3, theta[:, 0], 1e-3)
        step = theta[:, 2:] / gain[:, None]
        dx = dx + np.clip(step[:, 0], -1, 1).astype(np.float32)
        dy = dy + np.clip(step[:, 1], -1, 1).astype(np.float32)
        scale = np.clip(scale + np.clip(step[:, 2], -0.05, 0.05), *_SCALE_RANGE).astype(np.float32)
        sampled, current_valid = _sample(y, scale, dx, dy)
        current = _correlation(x, sampled, current_valid)
        better = current > score
        score = np.where(better, current, score)
        best = np.where(better[:, None, None], sampled, best)
        valid = np.where(better[:, None, None], current_valid, valid)
        best_dx = np.where(better, dx, best_dx)
        best_dy = np.where(better, dy, best_dy)
        best_scale = np.where(better, scale, best_scale)
    return best, valid, (best_dx, best_dy, best_scale)


def _rank_matched(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[P, N] x (integer grey levels) replaced by the y levels of equal rank over the valid
    pixels; pixels of one x level share the mean of their y levels, so ties carry no order."""
    count, size = x.shape
    levels = x.astype(np.intp)
    # Sorted valid y, and its running sum: the y of ranks [start, end) sum to a difference.
    y_sorted = np.sort(np.where(valid, y, np.inf), axis=1)
    running = np.zeros((count, size + 1))
    running[:, 1:] = np.cumsum(np.where(np.isfinite(y_sorted), y_sorted, 0), axis=1)
    histogram = np.bincount(
        (np.arange(count)[:, None] * 256 + levels)[valid], minlength=count * 256
    ).reshape(count, 256)
    end = np.cumsum(histogram, axis=1)
    start = end - histogram
    rows = np.arange(count)[:, None]
    means = (running[rows, end] - running[rows, start]) / np.maximum(histogram, 1)
    return np.where(valid, np.take_along_axis(means, levels, axis=1), 0).astype(np.float32)


def _residual(x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    count = len(x)
    flat_valid = valid.reshape(count, -1)
    n = np.maximum(flat_valid.sum(axis=1), 1)
    y_flat = np.where(flat_valid, y.reshape(count, -1), 0)
    matched = _rank_matched(x.reshape(count, -1), y_flat, flat_valid)
    difference = np.where(flat_valid, matched - y_flat, 0).reshape(x.shape)
    mean = y_flat.sum(axis=1) / n
    std = np.sqrt(np.maximum((y_flat * y_flat).sum(axis=1) / n - mean * mean, 0))
    unit = np.maximum(std, _MIN_STD)
    residual = np.abs(blur(difference, _RESIDUAL_BLUR)).max(axis=(1, 2)) / unit
    detail = (np.abs(y - blur(y, _DETAIL_BLUR)) * valid).sum(axis=(1, 2)) / n / unit
    return residual, detail


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="dedup")


def parallel_map(function: Callable[[Any], Any], items: list) -> list:
    """[function(item) for item in items], on THREADS threads when there are several."""
    if len(items) < 2 or THREADS < 2:
        return [function(item) for item in items]
    return list(_pool().map(function, items))


# What `verify` measures of each pair, in this order.
MEASURES = (
    "coarse",
    "residual",
    "detail",
    "shared_noise",
    "reference_noise",
    "noise_pixels",
    "dx",
    "dy",
    "scale",
)


def verify(
    candidates: np.ndarray,
    references: np.ndarray,
    pairs: np.ndarray,
    search: int,
    chunk: int = 1024,
    thumbnail_noise: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """MEASURES -> [P] of uint8 thumbnails [N, T, T] paired by `pairs` [P, 4]: candidate
    index, reference index, and the shift (dx, dy) of the reference at which their hashes
    matched (module docstring): coarse correlation, residual and detail; the shared-noise
    test of the aligned pair (beam_jobs/copy_evidence.py); the alignment. Pairs whose
    coarse correlation (best integer shift within a pixel of that, best of three scales)
    is below GATE are not refined: their residual is inf, their shared noise 0.
    `thumbnail_noise` [P]: the pairs whose shared-noise test is wanted on the thumbnails
    (None: all); the others' is left at 0 (a caller that tests them at their own
    resolution: copy_evidence.native_shared_noise)."""
    wanted = np.ones(len(pairs), dtype=bool) if thumbnail_noise is None else thumbnail_noise

    def verified(start: int) -> tuple[np.ndarray, ...]:
        part = pairs[start : start + chunk]
        return _verify(
            candidates[part[:, 0]].astype(np.float32),
            references[part[:, 1]].astype(np.float32),
            part[:, 2].astype(np.float32),
            part[:, 3].astype(np.float32),
            search,
            wanted[start : start + chunk],
        )

    results = parallel_map(verified, list(range(0, len(pairs), chunk)))
    if not results:
        return {name: np.zeros(0, dtype=np.float32) for name in MEASURES}
    return {name: np.concatenate(parts) for name, parts in zip(MEASURES, zip(*results))}


def _verify(x, y, dx, dy, search, noise_wanted):
    dx, dy = _integer_alignment(x, y, dx, dy, search)
    scale = np.ones(len(x), dtype=np.float32)
    coarse = _correlation(x, *_sample(y, scale, dx, dy))
    for factor in _GATE_SCALES:
        v_scale = np.full(len(x), factor, dtype=np.float32)
        v_score = _correlation(x, *_sample(y, v_scale, dx, dy))
        scale = np.where(v_score > coarse, v_scale, scale)
        coarse = np.maximum(coarse, v_score)
    residual = np.full(len(x), np.inf, dtype=np.float32)
    measured = [np.zeros(len(x), dtype=np.float32) for _ in range(4)]  # detail, noise
    close = np.flatnonzero(coarse >= GATE)
    if len(close):
        best, valid, alignment = _refine(x[close], y[close], dx[close], dy[close], scale[close])
        residual[close], measured[0][close] = _residual(x[close], best, valid)
        noise = np.flatnonzero(noise_wanted[close])
        if len(noise):
            tested = copy_evidence.shared_noise(x[close[noise]], best[noise], valid[noise])
            for column, values in zip(measured[1:], tested):
                column[close[noise]] = values
        dx, dy, scale = dx.copy(), dy.copy(), scale.copy()
        dx[close], dy[close], scale[close] = alignment
    return (coarse, residual, *measured, dx, dy, scale)

"""Is a near pair one image and its copy, or two images of one shape? (dedup's last test)

The shape verification (beam_jobs/near_duplicates.py) says that two images, aligned in
shift and scale, differ by no more than re-encoding leaves. That holds for a copy, and
also for two separate renders or scans of one shape (two writers' "o", two renders of a
glyph, two photos of one icon) whose poses happen to agree: low-detail images have little
else to differ in. What tells them apart is the fine detail each image has of its own:
sensor or render noise, grain, dither. A copy carries its original's (attenuated by
resizing or re-encoding); a separate render carries independent detail, uncorrelated with
the other's. So a pair that passed the shape test is a copy only when one of:

- `shared_noise`: over the flat parts of both images (away from edges, where shape
  differences live), the band-pass residuals of the aligned pair correlate at least
  `min_shared_noise`; independent renders correlate about 0 there;
- `jpeg_reencode`: the candidate is a JPEG and the reference, re-cropped at the pair's
  shift and re-encoded with the candidate's own quantization tables, decodes to the
  candidate within `jpeg_tolerance` grey levels: strong re-encoding (JPEG quality 30 of
  a small image) wipes the noise out, but re-encoding is deterministic;
- `shape_only`: the test cannot apply, and the shape verification decides alone: the
  reference has no fine detail to share (band-pass level under `min_reference_noise`,
  e.g. a digit scan scaled up from 8x8, flat graphics), or fewer than `min_noise_pixels`
  flat, unclipped pixels are left (a frame-filling icon, a busy photo).

The noise is compared at the thumbnails' alignment and, between images of one size, at
whole pixels and scale 1 (`whole_pixel_alignment`), where a clipped copy sits exactly.

- `same_pixels`, which needs no flat pixels: between images of one size, at a whole-pixel
  shift, the candidate's grey level is one function of the reference's, or a line of it
  where few unclipped pixels are left (`grey_map_spread` under SAME_PIXELS_TOLERANCE,
  both ways). A shifted, re-cropped, brightened or contrast-changed copy (clipped or not)
  is its reference's pixels through a fixed grey map, so it leaves no spread; a separate
  render carries its own noise on every pixel, which no grey map of the other image
  reproduces (spread about its noise level, >= 2 grey levels in bench/rendered_images.py),
  and a different pose adds its edges on top.

A lossless candidate can also be told by a linear filter of the reference
(beam_jobs/copy_prediction.py): `predicted_pixels` when the filter predicts it, and no
copy after all when it passed only by the shape's detail allowance and the filter leaves
more than a copy's resampling would.

bench/bench_dedup.py measures each on real images (BENCHMARKS.md, "Dedup: copies vs
look-alikes"). Known gap: a copy both resized and strongly re-encoded (JPEG) shares
neither noise nor an exact re-encoding, and is kept.
"""

import dataclasses
import io

import numpy as np
from PIL import Image, JpegImagePlugin

# near_duplicates imports this module too; each uses the other only at call time.
from beam_jobs import near_duplicates

# Defaults of the settings (DedupConfig and the pipeline's dedup section use these).
MIN_SHARED_NOISE = 0.45
MIN_REFERENCE_NOISE = 0.3
MIN_NOISE_PIXELS = 48
JPEG_TOLERANCE = 1.0
# Grey levels (RMS) a same_pixels copy may spread around one grey map: a grey map leaves
# none, a colour copy's luma rounding about 0.5; independent renders leave their noise.
SAME_PIXELS_TOLERANCE = 1.0
# Degrees of freedom (pixels tested less grey levels fitted) below which same_pixels
# cannot tell: a map with a level per pixel fits anything.
_MIN_SAME_PIXELS = 64
# The same for a line: independent renders' noise (sigma >= 2) over 16 pixels stays
# above 1 grey level RMS by far (bench_dedup's look-alikes: >= 6 at their best shift).
_MIN_LINE_PIXELS = 16

# Images up to this many pixels carry their own pixels to the verification (the JPEG
# test needs them); larger ones rely on the thumbnail's tests: bounded memory per batch.
MAX_NATIVE_PIXELS = 160 * 160
# Band-pass of the residual, in the compared images' own pixels.
_BAND = (0.7, 2.0)
_EDGE_BLUR = 1.0
_EDGE_REACH = 2  # thumbnail pixels around an edge that are not flat
# Flat: no (blurred) grey gradient over this many grey levels per thumbnail pixel within
# _EDGE_REACH: an icon's or photo's busy parts are structure, not noise.
_FLAT_GRADIENT = 8.0
_BORDER = 2  # thumbnail pixels off each side: resampling edges
# Native pixels searched around the shift the thumbnails were aligned at.
_JPEG_SEARCH = 2


@dataclasses.dataclass(frozen=True)
class JpegForm:
    """What re-encoding needs of a JPEG: its tables, chroma sampling, mode and pixels (as
    PIL decodes them, the decoder the re-encoded reference goes through too)."""

    qtables: tuple[tuple[int, ...], ...]
    subsampling: int
    mode: str
    pixels: np.ndarray


def native_pixels(pixels: np.ndarray) -> np.ndarray | None:
    """The image's pixels when small enough to carry (MAX_NATIVE_PIXELS), else None."""
    return pixels if pixels.shape[0] * pixels.shape[1] <= MAX_NATIVE_PIXELS else None


def jpeg_form(image: bytes) -> JpegForm | None:
    """The JpegForm of a grey or RGB baseline JPEG up to MAX_NATIVE_PIXELS, else None.
    The record passed validation already; anything PIL reads otherwise is not tested."""
    if not image.startswith(b"\xff\xd8"):
        return None
    try:
        with Image.open(io.BytesIO(image), formats=("JPEG",)) as opened:
            if opened.mode not in ("L", "RGB") or opened.width * opened.height > MAX_NATIVE_PIXELS:
                return None
            tables = opened.quantization
            subsampling = JpegImagePlugin.get_sampling(opened)
            pixels = np.asarray(opened.convert(opened.mode))
            mode = opened.mode
    except Exception:  # noqa: BLE001 - not re-encodable: the other tests decide
        return None
    if not tables:
        return None
    return JpegForm(tuple(tuple(tables[k]) for k in sorted(tables)), subsampling, mode, pixels)


def _blur(images: np.ndarray, sigma: float) -> np.ndarray:
    return near_duplicates.blur(images, sigma)


def _gradient_size(images: np.ndarray, factor: float) -> np.ndarray:
    smooth = _blur(images, _EDGE_BLUR * factor)
    gy, gx = np.gradient(smooth, axis=(1, 2))
    return np.hypot(gx, gy)


def _spread(values: np.ndarray, reach: int) -> np.ndarray:
    """Max over a (2 reach + 1)^2 window, edges repeated: [P, T, T]."""
    padded = np.pad(values, ((0, 0), (reach, reach), (reach, reach)), mode="edge")
    side = values.shape[1]
    out = values.copy()
    for dy in range(2 * reach + 1):
        for dx in range(2 * reach + 1):
            np.maximum(out, padded[:, dy : dy + side, dx : dx + side], out=out)
    return out


def shared_noise(
    candidates: np.ndarray, aligned: np.ndarray, valid: np.ndarray, factor: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(correlation, reference noise level, pixels tested) [P] of candidate thumbnails
    [P, T, T] and references sampled at their alignment (`aligned`, where `valid`): the
    band-pass residuals correlated over the flat part of the overlap, away from edges
    of either image and from clipped pixels of either. `factor`: image pixels per
    thumbnail pixel (edges and borders are judged at the thumbnail's scale)."""
    # float64: the flat-pixel mask is a threshold on blurred gradients, and a float32
    # matrix product's rounding (which moves with the BLAS kernel and batch size) can
    # flip a pixel at the threshold and move the correlation by 1e-4.
    x = candidates.astype(np.float64)
    y = aligned.astype(np.float64)
    border = max(_BORDER, round(_BORDER * factor))
    inner = valid.copy()
    inner[:, :border] = inner[:, x.shape[1] - border :] = False
    inner[:, :, :border] = inner[:, :, x.shape[2] - border :] = False
    inner &= (x > 1) & (x < 254) & (y > 1) & (y < 254)
    edges = _spread(
        np.maximum(_gradient_size(x, factor), _gradient_size(y, factor)),
        max(1, round(_EDGE_REACH * factor)),
    )
    flat = inner & (edges <= _FLAT_GRADIENT / factor)
    # The band in the image's own pixels: noise is per pixel, whatever the image size.
    band_x = _blur(x, _BAND[0]) - _blur(x, _BAND[1])
    band_y = _blur(y, _BAND[0]) - _blur(y, _BAND[1])
    weights = flat.astype(np.float64)
    pixels = weights.sum(axis=(1, 2))
    n = np.maximum(pixels, 1.0)
    band_x = (band_x - ((band_x * weights).sum(axis=(1, 2)) / n)[:, None, None]) * weights
    band_y = (band_y - ((band_y * weights).sum(axis=(1, 2)) / n)[:, None, None]) * weights
    sx, sy = (band_x * band_x).sum(axis=(1, 2)), (band_y * band_y).sum(axis=(1, 2))
    correlation = (band_x * band_y).sum(axis=(1, 2)) / np.sqrt(np.maximum(sx * sy, 1e-6))
    return correlation, np.sqrt(sy / n), pixels


def _bilinear(images: np.ndarray, rows: np.ndarray, columns: np.ndarray):
    """images [..., H, W] sampled at (rows[..., :, None], columns[..., None, :])
    bilinearly, and where inside; leading axes are images sampled each at their own."""
    height, width = images.shape[-2:]
    inside = ((rows >= 0) & (rows <= height - 1))[..., :, None] & (
        (columns >= 0) & (columns <= width - 1)
    )[..., None, :]
    r = np.clip(rows, 0, height - 1)
    c = np.clip(columns, 0, width - 1)
    r0 = np.minimum(r.astype(np.intp), height - 2) if height > 1 else np.zeros_like(r, np.intp)
    c0 = np.minimum(c.astype(np.intp), width - 2) if width > 1 else np.zeros_like(c, np.intp)
    wr, wc = (r - r0)[..., :, None], (c - c0)[..., None, :]
    r1, c1 = np.minimum(r0 + 1, height - 1), np.minimum(c0 + 1, width - 1)

    def at(rows_at: np.ndarray, columns_at: np.ndarray) -> np.ndarray:
        picked = np.take_along_axis(images, rows_at[..., :, None], axis=-2)
        return np.take_along_axis(picked, columns_at[..., None, :], axis=-1)

    top = at(r0, c0) * (1 - wc) + at(r0, c1) * wc
    bottom = at(r1, c0) * (1 - wc) + at(r1, c1) * wc
    return top * (1 - wr) + bottom * wr, inside


def whole_pixel_alignment(
    candidate_shape: tuple[int, ...], reference_shape: tuple[int, ...], dx: float, dy: float
) -> tuple[float, float, float] | None:
    """Between images of one size, the thumbnails' shift rounded to whole image pixels at
    scale 1 (dx, dy, scale), the second alignment the noise test tries; else None. A
    copy whose shape a clip changed (brightened until its paper is white) is aligned by
    the thumbnails a few per cent off scale, which at 112 pixels moves its noise by
    pixels; re-encoded, shifted or brightened copies sit exactly there."""
    if candidate_shape[:2] != reference_shape[:2]:
        return None
    t = near_duplicates.THUMBNAIL
    height, width = candidate_shape[:2]
    return (round(dx * width / t) * t / width, round(dy * height / t) * t / height, 1.0)


# Elements (pairs x pixels) computed at once by the pair-batched tests: bounded memory
# whatever the image size, and parts enough to spread over near_duplicates.THREADS.
_PART_ELEMENTS = 1 << 18


def _parts_by_size(shapes: list[tuple]) -> list[np.ndarray]:
    """Indices of pairs grouped by their images' sizes (`shapes`, one hashable key a
    pair), each group cut into parts of about _PART_ELEMENTS pixels."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(shapes):
        groups.setdefault(key, []).append(i)
    parts = []
    for key, indices in groups.items():
        pixels = max(int(np.prod(key[0][:2])), 1)
        step = max(1, _PART_ELEMENTS // pixels)
        parts.extend(
            np.array(indices[start : start + step]) for start in range(0, len(indices), step)
        )
    return parts


def grey_map_spread(
    candidates: list[np.ndarray], references: list[np.ndarray], shifts: np.ndarray
) -> np.ndarray:
    """[P] RMS grey levels by which candidate i's pixels spread around a grey map of
    reference i's, and the reference's around one of the candidate's (the larger), over
    their overlap at whole-pixel shifts within one of the thumbnails' (shifts[i] = dx,
    dy), at the best shift and the better map: any function of the grey level (gamma),
    or a line (brightness, contrast: two parameters, so it tells with the few pixels a
    copy brightened until its paper clips leaves). Pixels clipped in either are left
    out (a clip merges levels). inf between images of different sizes or with too few
    pixels. Pairs of one size are computed together."""
    spreads = np.full(len(candidates), np.inf)
    x_grey, y_grey = _greys(candidates), _greys(references)
    same = [i for i in range(len(candidates)) if x_grey[i].shape == y_grey[i].shape]
    shifts = np.asarray(shifts, dtype=np.float64)

    def spread(part: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.stack([x_grey[i] for i in part])
        y = np.stack([y_grey[i] for i in part])
        return part, _best_grey_map_spread(x, y, shifts[part])

    parts = [np.array(same)[p] for p in _parts_by_size([(x_grey[i].shape,) for i in same])]
    for part, values in near_duplicates.parallel_map(spread, parts):
        spreads[part] = values
    return spreads


def _best_grey_map_spread(x: np.ndarray, y: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """`grey_map_spread` of uint8 images x, y [G, H, W] at their shifts [G, 2]. Each
    shift's tested pixels are gathered flat, pair after pair in pixel order."""
    count, height, width = x.shape
    t = near_duplicates.THUMBNAIL
    centre_x = np.round(shifts[:, 0] * width / t).astype(np.intp)
    centre_y = np.round(shifts[:, 1] * height / t).astype(np.intp)
    x_flat, y_flat = x.ravel(), y.ravel()
    row = np.arange(height)[None, :, None]
    column = np.arange(width)[None, None, :]
    clear_x = (x > 1) & (x < 254)
    best = np.full(count, np.inf)
    for offset_y in (-1, 0, 1):
        for offset_x in (-1, 0, 1):
            shift_y, shift_x = centre_y + offset_y, centre_x + offset_x
            tried = (np.abs(shift_x) < width // 2) & (np.abs(shift_y) < height // 2)
            # Candidate pixel (r, c) shows reference pixel (r + shift_y, c + shift_x).
            moved_row = row + shift_y[:, None, None]
            moved_column = column + shift_x[:, None, None]
            inside = (
                (moved_row >= 0)
                & (moved_row < height)
                & (moved_column >= 0)
                & (moved_column < width)
                & tried[:, None, None]
            )
            positions = np.flatnonzero(inside & clear_x)
            pair = positions // (height * width)
            b = y_flat[positions + (shift_y * width + shift_x)[pair]]
            kept = (b > 1) & (b < 254)
            a, b, pair = x_flat[positions[kept]], b[kept], pair[kept]
            one_way, other_way = _map_spreads(a, b, pair, count), _map_spreads(b, a, pair, count)
            for measured, reverse in zip(one_way, other_way):
                best = np.minimum(best, np.where(tried, np.maximum(measured, reverse), np.inf))
    return best


_LEVELS = np.arange(256, dtype=np.int64)


def _map_spreads(
    values: np.ndarray, levels: np.ndarray, pair: np.ndarray, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """[count] RMS of each pair's `values` (uint8; `pair` says whose each pixel is)
    around their mean per grey level of its `levels` (uint8), with the levels fitted
    taken out of the count (inf with fewer than _MIN_SAME_PIXELS left); and [count] RMS
    around their least-squares line in `levels`, two parameters out of the count (inf
    with fewer than _MIN_LINE_PIXELS left). Both from sums per pair and level; sums of
    grey levels are integers, kept exact."""
    index = pair * 256 + levels
    # float64 weights (bincount's fast path); the sums stay exact integers below 2^53.
    v = values.astype(np.float64)
    size = count * 256
    tally = np.bincount(index, minlength=size).reshape(count, 256)
    total = np.bincount(index, v, minlength=size).reshape(count, 256).astype(np.int64)
    squares = np.bincount(index, v * v, minlength=size).reshape(count, 256).astype(np.int64)
    n = tally.sum(axis=1)
    sum_vv = squares.sum(axis=1)

    freedom = n - np.count_nonzero(tally, axis=1)
    level_means = np.divide(
        total.astype(np.float64) ** 2, tally, out=np.zeros(tally.shape), where=tally > 0
    )
    within = np.maximum(sum_vv - level_means.sum(axis=1), 0.0)
    around_levels = np.where(
        freedom >= _MIN_SAME_PIXELS, np.sqrt(within / np.maximum(freedom, 1)), np.inf
    )

    # The line's moments: within a level bin, the level is the bin's.
    sum_u, sum_uu = tally @ _LEVELS, tally @ _LEVELS**2
    sum_v, sum_uv = total.sum(axis=1), total @ _LEVELS
    # n times the centred sums: integers, exact.
    uu, vv, uv = n * sum_uu - sum_u**2, n * sum_vv - sum_v**2, n * sum_uv - sum_u * sum_v
    explained = np.divide(uv.astype(np.float64) ** 2, uu, out=np.zeros(count), where=uu > 0)
    residual = np.maximum(vv - explained, 0.0) / np.maximum(n, 1)
    line_freedom = n - 2
    around_line = np.where(
        line_freedom >= _MIN_LINE_PIXELS,
        np.sqrt(residual / np.maximum(line_freedom, 1)),
        np.inf,
    )
    return around_levels, around_line


def native_shared_noise(
    candidates: list[np.ndarray], references: list[np.ndarray], alignments: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`shared_noise` [P] at the candidates' own resolution: reference i's own pixels
    sampled at the thumbnails' alignment alignments[i] (shift dx, dy and scale, in
    thumbnail pixels, about the centre). A thumbnail averages a large image's noise away;
    here it is whole. Pairs of one pair of sizes are computed together."""
    measured = np.zeros((3, len(candidates)), dtype=np.float32)
    x_grey, y_grey = _greys(candidates), _greys(references)
    # float32 as the thumbnails' alignment is measured (near_duplicates.verify).
    alignments = np.asarray(alignments, dtype=np.float32).reshape(-1, 3)
    t = near_duplicates.THUMBNAIL
    centre = (t - 1) / 2

    def coordinates(size_x: int, size_y: int, shift: np.ndarray, scale: np.ndarray):
        # candidate pixel -> thumbnail -> aligned reference thumbnail -> reference pixel
        u = (np.arange(size_x, dtype=np.float32) + 0.5) * t / size_x - 0.5
        v = centre + scale[:, None] * (u - centre) + shift[:, None]
        return (v + 0.5) * size_y / t - 0.5

    def tested(part: np.ndarray) -> tuple[np.ndarray, tuple]:
        x = np.stack([x_grey[i] for i in part]).astype(np.float32)
        y = np.stack([y_grey[i] for i in part]).astype(np.float32)
        dx, dy, scale = alignments[part].T
        rows = coordinates(x.shape[1], y.shape[1], dy, scale)
        columns = coordinates(x.shape[2], y.shape[2], dx, scale)
        aligned, valid = _bilinear(y, rows, columns)
        # Measures at this resolution: blurs in thumbnail pixels scale with the image.
        return part, shared_noise(x, aligned, valid, x.shape[1] / t)

    shapes = [(x.shape, y.shape) for x, y in zip(x_grey, y_grey)]
    for part, values in near_duplicates.parallel_map(tested, _parts_by_size(shapes)):
        measured[:, part] = values
    correlation, level, pixels = measured
    return correlation, level, pixels


def reencode_difference(
    reference: np.ndarray, form: JpegForm, dx: float, dy: float, scale: float
) -> float:
    """Mean absolute grey difference between the candidate (`form`) and the reference
    re-cropped at the pair's alignment (thumbnail shift dx, dy; scale 1 only) and
    encoded with the candidate's tables, at the best integer shift within _JPEG_SEARCH
    native pixels; compared over the JPEG blocks the re-crop fills. inf when not
    applicable (other size or scale, colour against grey)."""
    height, width = form.pixels.shape[:2]
    if reference.shape[:2] != (height, width) or abs(scale - 1) > 0.05:
        return float("inf")
    if form.mode == "RGB" and reference.ndim != 3:
        return float("inf")
    source = reference if form.mode == "RGB" else _grey(reference)
    candidate = _grey(form.pixels).astype(np.float32)
    # The reference pixel a candidate pixel shows: candidate + (dx, dy) thumbnail pixels.
    centre_x = round(dx * width / near_duplicates.THUMBNAIL)
    centre_y = round(dy * height / near_duplicates.THUMBNAIL)
    block = 8 * (2 if form.mode == "RGB" and form.subsampling > 0 else 1)
    best = float("inf")
    for shift_y in range(centre_y - _JPEG_SEARCH, centre_y + _JPEG_SEARCH + 1):
        for shift_x in range(centre_x - _JPEG_SEARCH, centre_x + _JPEG_SEARCH + 1):
            if abs(shift_x) >= width // 2 or abs(shift_y) >= height // 2:
                continue
            shifted = np.roll(source, (-shift_y, -shift_x), axis=(0, 1))
            buffer = io.BytesIO()
            Image.fromarray(shifted).save(
                buffer,
                format="JPEG",
                qtables=[list(t) for t in form.qtables],
                subsampling=form.subsampling,
            )
            with Image.open(buffer, formats=("JPEG",)) as opened:
                again = _grey(np.asarray(opened)).astype(np.float32)
            # Blocks holding a pixel rolled in from the other side differ: left out.
            rows = _untouched(height, shift_y, block)
            columns = _untouched(width, shift_x, block)
            if not rows.any() or not columns.any():
                continue
            difference = np.abs(again - candidate)[rows][:, columns]
            best = min(best, float(difference.mean()))
    return best


def _untouched(size: int, shift: int, block: int) -> np.ndarray:
    """Pixels (along one axis) in blocks holding no pixel rolled around by `shift`."""
    index = np.arange(size)
    rolled = (index >= size - shift) if shift > 0 else (index < -shift)
    blocks = index // block
    return ~np.isin(blocks, blocks[rolled])


def _greys(images: list[np.ndarray]) -> list[np.ndarray]:
    """`_grey` of each image, converting each distinct image (object) once: an image
    is in several pairs (its references, both alignments), and a colour one's grey is
    a new array."""
    converted: dict[int, np.ndarray] = {}
    greys = []
    for image in images:
        if id(image) not in converted:
            converted[id(image)] = _grey(image)
        greys.append(converted[id(image)])
    return greys


def _grey(pixels: np.ndarray) -> np.ndarray:
    if pixels.ndim == 2:
        return pixels
    return np.asarray(Image.fromarray(pixels).convert("L"))

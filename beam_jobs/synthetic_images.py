"""Synthetic identity images: the project's embedded default dataset (docs/design.md section 3).

Each identity is a random composition of parts (filled ellipses, rings, strokes,
rectangles) in a canonical frame, so identities differ in structure. Each image renders
the identity under a random pose (rotation, translation, scale), per-part jitter and
occlusion, a clutter part, lighting (gain, bias, gradient, gamma) and pixel noise, so a
model must learn the structure to tell identities apart. Everything is a pure function of
(seed, identity index, image index): adding identities never changes existing ones, and
any slice can be rendered independently (the Beam transform renders slices in parallel).

Users hold identities in one of two ways. By default each user holds identities of their
own (`identities_per_user` consecutive ones; 1 is faces-like). With
`users_sharing_identities` N > 0, N users each draw `identities_per_user` distinct
identities from the one pool of `identities`, popular ones far more often (Zipf-like, as
photographers meet landmarks and writers meet characters), and every (user, identity)
holding gets `images_per_identity` images of its own: the data where users share
identities, which the split modes `identity` and `held_out_images` are for
(beam_jobs/split_protocols.py).

This module renders pixels and writes image files with numpy and PIL alone, so processes
that render a large folder in parallel (`beam_jobs.synthetic.write_image_folder`) start
without TensorFlow or Beam; the Beam source and the folder writer are in
`beam_jobs.synthetic`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from beam_jobs import png_encoding

_PART_KINDS = ("ellipse", "ring", "stroke", "rectangle")
# Rendering styles (`SyntheticConfig.style`): the same kind of identity structure seen
# through two different cameras. "photo" fills the parts in light colours over a dark,
# unevenly lit background; "sketch" draws only their outlines in dark ink on light paper.
# A backbone pretrained on one style and evaluated on the other meets a domain gap, as
# an ImageNet backbone meets faces in the paper (section 3, "public pretraining").
PHOTO = "photo"
SKETCH = "sketch"
STYLES = (PHOTO, SKETCH)
# Stream tags keep the structure and per-image random streams independent.
_STRUCTURE_STREAM = 0
_IMAGE_STREAM = 1
_HOLDINGS_STREAM = 2
# Popularity of the identity of rank r (0 the most popular) is proportional to
# (r + 1) ** -_ZIPF_EXPONENT when users share identities.
_ZIPF_EXPONENT = 1.0


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    identities: int = 1000
    images_per_identity: int = 20
    image_size: int = 28
    channels: int = 1  # 1: grayscale (small-CNN input), 3: RGB
    identities_per_user: int = 1  # 1: faces-like; >1: landmarks-like
    seed: int = 0
    style: str = PHOTO
    # 0: every user holds identities of their own; N > 0: N users draw their identities
    # from one shared pool (module docstring).
    users_sharing_identities: int = 0

    def __post_init__(self) -> None:
        if self.identities < 1:
            raise ValueError(f"identities must be >= 1, got {self.identities}")
        if self.images_per_identity < 1:
            raise ValueError(f"images per identity must be >= 1, got {self.images_per_identity}")
        if not 8 <= self.image_size <= 512:
            raise ValueError(f"image size must be in [8, 512], got {self.image_size}")
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.identities_per_user < 1:
            raise ValueError(f"identities per user must be >= 1, got {self.identities_per_user}")
        if self.style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {self.style!r}")
        if self.users_sharing_identities < 0:
            raise ValueError(
                f"users sharing identities must be >= 0, got {self.users_sharing_identities}"
            )
        if self.shares_identities and self.identities_per_user > self.identities:
            raise ValueError(
                f"identities per user ({self.identities_per_user}) must not exceed the shared "
                f"pool of identities ({self.identities})"
            )

    @property
    def shares_identities(self) -> bool:
        return self.users_sharing_identities > 0

    @property
    def users(self) -> int:
        if self.shares_identities:
            return self.users_sharing_identities
        return -(-self.identities // self.identities_per_user)

    @property
    def images(self) -> int:
        holdings = (
            self.users * self.identities_per_user if self.shares_identities else self.identities
        )
        return holdings * self.images_per_identity

    def identity_name(self, identity_index: int) -> str:
        return f"id{identity_index:0{len(str(self.identities - 1))}d}"

    def user_name(self, identity_index: int) -> str:
        """The user holding an identity when users hold identities of their own."""
        # Consecutive identities share a user; the last user may hold fewer.
        return self.user_index_name(identity_index // self.identities_per_user)

    def user_index_name(self, user_index: int) -> str:
        return f"u{user_index:0{len(str(self.users - 1))}d}"

    @property
    def units(self) -> int:
        """What the dataset is rendered by, in slices: users when they share identities
        (`user_holdings`), identities otherwise."""
        return self.users if self.shares_identities else self.identities


def user_holdings(config: SyntheticConfig, user_index: int) -> list[int]:
    """Identity indices a user holds when users share identities: `identities_per_user`
    distinct ones drawn by Zipf-like popularity, fixed by (seed, user)."""
    rng = np.random.default_rng([config.seed, _HOLDINGS_STREAM, user_index])
    popularity = np.arange(1, config.identities + 1, dtype=np.float64) ** -_ZIPF_EXPONENT
    chosen = rng.choice(
        config.identities,
        size=config.identities_per_user,
        replace=False,
        p=popularity / popularity.sum(),
    )
    return sorted(int(i) for i in chosen)


def holdings_of_units(config: SyntheticConfig, start: int, stop: int) -> Iterator[tuple]:
    """(user index, identity index, first image index) of units [start, stop), in order.

    A shared identity's images are indexed per holding (user index x images per
    identity), so two users never hold the same image."""
    for unit in range(start, min(stop, config.units)):
        if config.shares_identities:
            for identity_index in user_holdings(config, unit):
                yield unit, identity_index, unit * config.images_per_identity
        else:
            yield unit // config.identities_per_user, unit, 0


@dataclasses.dataclass(frozen=True)
class _Part:
    kind: str
    center: np.ndarray  # (2,)
    half_sizes: np.ndarray  # (2,) semi-axes / half-length and half-width
    angle: float
    thickness: float
    color: np.ndarray  # (channels,) in [0, 1]


def _random_part(rng: np.random.Generator, channels: int) -> _Part:
    kind = _PART_KINDS[rng.integers(len(_PART_KINDS))]
    if kind == "stroke":
        half_sizes = np.array([rng.uniform(0.2, 0.5), 0.0])
    else:
        half_sizes = rng.uniform(0.1, 0.35, size=2)
    return _Part(
        kind=kind,
        center=rng.uniform(-0.55, 0.55, size=2),
        half_sizes=half_sizes,
        angle=rng.uniform(0.0, np.pi),
        thickness=rng.uniform(0.05, 0.12),
        color=rng.uniform(0.35, 1.0, size=channels),
    )


# An identity's images are rendered one after another: its structure is drawn once.
@functools.lru_cache(maxsize=256)
def identity_parts(config: SyntheticConfig, identity_index: int) -> tuple[_Part, ...]:
    """The identity's structure: 4 to 7 parts, fixed by (seed, identity)."""
    rng = np.random.default_rng([config.seed, _STRUCTURE_STREAM, identity_index])
    return tuple(_random_part(rng, config.channels) for _ in range(rng.integers(4, 8)))


@functools.lru_cache(maxsize=8)
def _pixel_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres of a size x size image in [-1, 1] (x, y), read-only."""
    grid = (np.arange(size) + 0.5) / size * 2.0 - 1.0
    gx, gy = np.meshgrid(grid, grid)
    gx.flags.writeable = gy.flags.writeable = False
    return gx, gy


def _signed_distance(part: _Part, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Approximate signed distance (canonical units) from points to the part's outline."""
    cos, sin = np.cos(part.angle), np.sin(part.angle)
    dx, dy = x - part.center[0], y - part.center[1]
    u, v = cos * dx + sin * dy, -sin * dx + cos * dy
    a, b = part.half_sizes
    if part.kind == "stroke":
        along = np.clip(u, -a, a)
        return np.hypot(u - along, v) - part.thickness / 2
    if part.kind == "rectangle":
        qx, qy = np.abs(u) - a, np.abs(v) - b
        outside = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0))
        return outside + np.minimum(np.maximum(qx, qy), 0)
    ellipse = (np.hypot(u / a, v / b) - 1.0) * min(a, b)
    return np.abs(ellipse) - part.thickness / 2 if part.kind == "ring" else ellipse


def render_image(config: SyntheticConfig, identity_index: int, image_index: int) -> np.ndarray:
    """One image of an identity as uint8 pixels, HxW (grayscale) or HxWx3."""
    rng = np.random.default_rng([config.seed, _IMAGE_STREAM, identity_index, image_index])
    size, channels = config.image_size, config.channels
    # Pose: map pixel centres back into the identity's canonical frame.
    angle = rng.uniform(-0.5, 0.5)  # about +-29 degrees
    scale = rng.uniform(0.8, 1.15)
    shift = rng.uniform(-0.15, 0.15, size=2)
    gx, gy = _pixel_grid(size)
    px, py = (gx - shift[0]) / scale, (gy - shift[1]) / scale
    cos, sin = np.cos(angle), np.sin(angle)
    x, y = cos * px + sin * py, -sin * px + cos * py
    pixel_width = 2.0 / (size * scale)

    if config.style == SKETCH:
        return _render_sketch(rng, config, identity_index, x, y, pixel_width)
    background = rng.uniform(0.0, 0.25, size=channels)
    canvas = np.broadcast_to(background, (size, size, channels)).copy()
    for part in _view_parts(rng, config, identity_index):
        coverage = np.clip(0.5 - _signed_distance(part, x, y) / pixel_width, 0.0, 1.0)
        canvas += coverage[..., None] * (part.color - canvas)

    # Lighting: gain and bias, a directional gradient, then gamma.
    direction = rng.uniform(0.0, 2 * np.pi)
    gradient = rng.uniform(0.0, 0.35) * (np.cos(direction) * gx + np.sin(direction) * gy)
    lit = canvas * rng.uniform(0.6, 1.3) + rng.uniform(-0.1, 0.15) + gradient[..., None]
    lit = np.clip(lit, 0.0, 1.0) ** rng.uniform(0.7, 1.4)
    return _to_pixels(rng, lit, rng.uniform(0.02, 0.1))


def _view_parts(rng: np.random.Generator, config: SyntheticConfig, identity_index: int) -> list:
    """The identity's parts as one view shows them: jittered, some occluded, maybe clutter."""
    parts = []
    for part in identity_parts(config, identity_index):
        if rng.random() < 0.1:  # occlusion: the part is missing from this view
            continue
        parts.append(
            dataclasses.replace(
                part,
                center=part.center + rng.normal(0.0, 0.04, size=2),
                half_sizes=part.half_sizes * rng.uniform(0.9, 1.1, size=2),
                angle=part.angle + rng.normal(0.0, 0.1),
                color=np.clip(part.color * rng.uniform(0.85, 1.15), 0.0, 1.0),
            )
        )
    if rng.random() < 0.3:  # clutter that belongs to no identity
        parts.insert(rng.integers(len(parts) + 1), _random_part(rng, config.channels))
    return parts


def _render_sketch(
    rng: np.random.Generator,
    config: SyntheticConfig,
    identity_index: int,
    x: np.ndarray,
    y: np.ndarray,
    pixel_width: float,
) -> np.ndarray:
    """Outlines of the view's parts in dark ink on light paper, evenly lit."""
    size, channels = config.image_size, config.channels
    paper = rng.uniform(0.75, 1.0, size=channels)
    canvas = np.broadcast_to(paper, (size, size, channels)).copy()
    line_width = rng.uniform(0.6, 1.2) * pixel_width
    for part in _view_parts(rng, config, identity_index):
        outline = np.abs(_signed_distance(part, x, y)) - line_width / 2
        coverage = np.clip(0.5 - outline / pixel_width, 0.0, 1.0)
        ink = 0.4 * (1.0 - part.color)  # the brighter a part in a photo, the darker its ink
        canvas += coverage[..., None] * (ink - canvas)
    return _to_pixels(rng, canvas, rng.uniform(0.01, 0.05))


def _to_pixels(rng: np.random.Generator, image: np.ndarray, noise_std: float) -> np.ndarray:
    noisy = image + rng.normal(0.0, noise_std, size=image.shape)
    pixels = np.round(np.clip(noisy, 0.0, 1.0) * 255).astype(np.uint8)
    return pixels[..., 0] if image.shape[-1] == 1 else pixels


TEMPORARY_SUFFIX = ".partial"


def write_images(
    out_dir: str, config: SyntheticConfig, planned: Sequence[tuple[str, int, int]]
) -> None:
    """Renders and writes each planned (path relative to OUT, identity index, image
    index) whose file is not there yet; its folder must exist. Each image is written to a
    temporary name and renamed, so an image that exists is whole."""
    for path, identity_index, image_index in planned:
        final = os.path.join(out_dir, path)
        if os.path.isfile(final):
            continue
        pixels = render_image(config, identity_index, image_index)
        with open(final + TEMPORARY_SUFFIX, "wb") as f:
            f.write(png_encoding.encode_png(pixels))
        os.replace(final + TEMPORARY_SUFFIX, final)


if __name__ == "__main__":
    # One slice of `beam_jobs.synthetic.write_image_folder`, given as JSON on stdin. An
    # OSError goes back whole (errno, reason, file) as the last line of stderr.
    job = json.load(sys.stdin)
    try:
        write_images(
            job["out_dir"],
            SyntheticConfig(**job["config"]),
            [(path, identity, image) for path, identity, image in job["images"]],
        )
    except OSError as e:
        print(
            json.dumps({"errno": e.errno, "strerror": e.strerror, "filename": e.filename}),
            file=sys.stderr,
        )
        sys.exit(1)

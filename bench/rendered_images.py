"""Real low-detail images for the dedup benchmark: characters and icons, rendered.

Characters, icons and sketches are low-detail images: two renders of one shape (two
writers' "o", two renders of one glyph) look alike without being copies of one image.
Dedup must remove a copy of an evaluation image and keep a look-alike; this module makes
both from files that installed packages ship (nothing is downloaded, no apt):

- characters: glyphs of the TrueType fonts in matplotlib's mpl-data/fonts/ttf (DejaVu,
  Bitstream Vera licence; STIX, SIL OFL; Computer Modern, BaKoMa licence), the same font
  files as Debian's fonts-dejavu-core and fonts-stix packages;
- icons: matplotlib's toolbar icons (mpl-data/images/*.png, matplotlib licence) and the
  pictographs of DejaVu Sans (arrows, card suits, weather and office symbols).

Every image is its own render (no two images from one render): the shape drawn at a
random pose (rotation, scale, position), ink and paper grey levels, then blurred and
noised by random amounts. An identity is one shape (a glyph of one font, an icon); a user
holds renders of one identity. The renders come on a canvas with a margin, as
bench/real_images.py's `Original`, so its `TRANSFORMS` make real copies of them (a shift
is a re-crop of the render, not a black border).

Split modes, as beam_jobs/split_protocols.py splits users: `by_identity` (the evaluation side
holds other identities: look-alikes are other glyphs, "O" beside "0") and `by_user`
(both sides hold every identity, by different users: look-alikes are other renders of
the same glyph, the hardest case).
"""

import functools
import hashlib
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from bench import real_images

BY_IDENTITY, BY_USER = "by_identity", "by_user"
SOURCES = ("characters", "icons")
SPLIT_MODES = (BY_IDENTITY, BY_USER)
FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSansMono.ttf",
    "STIXGeneral.ttf",
    "cmr10.ttf",
    "cmss10.ttf",
)
# Look-alike groups among them: O 0 o Q, l I 1 i, S 5 s, Z 2 z, B 8, C c G, ...
CHARACTERS = "0125689ABCGIOQSZabceilnorsz"
# DejaVu Sans pictographs: arrows, suits, office and weather symbols, check marks.
PICTOGRAPHS = "\u2190\u2192\u2191\u21d2\u2602\u2605\u2606\u260e\u2660\u2663\u2665\u2666\u263a\u2691\u2699\u2702\u2709\u2713\u2717\u231a"
MPL_ICONS = (
    "back",
    "filesave",
    "forward",
    "help",
    "home",
    "matplotlib",
    "move",
    "qt4_editor_options",
    "subplots",
    "zoom_to_rect",
)
_SUPERSAMPLE = 4  # shapes are drawn this much larger, then reduced (antialiasing)


def _mpl_data(*parts: str) -> str:
    import matplotlib

    return os.path.join(matplotlib.get_data_path(), *parts)


@functools.cache
def _font(name: str, pixels: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(_mpl_data("fonts", "ttf", name), pixels)


@functools.cache
def _icon(name: str) -> Image.Image:
    """The icon's alpha as an L image (ink where opaque): toolbar icons are black line art."""
    with Image.open(_mpl_data("images", f"{name}_large.png")) as image:
        rgba = np.asarray(image.convert("RGBA")).astype(np.float64)
    darkness = 1 - rgba[..., :3].mean(axis=2) / 255
    return Image.fromarray(np.round(255 * darkness * rgba[..., 3] / 255).astype(np.uint8))


def _shape(identity: str, side: int) -> Image.Image:
    """The identity's ink as an L image (255 ink) of side x side, centred, unrotated."""
    kind, _, rest = identity.partition(":")
    if kind == "icon":
        return _icon(rest).resize((side, side), Image.BICUBIC)
    font_name, _, text = rest.rpartition(":")
    font = _font(font_name, side * 3 // 4)
    canvas = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((side - right - left) / 2, (side - bottom - top) / 2), text, fill=255, font=font)
    return canvas


def identities() -> dict[str, list[str]]:
    """Source ("characters", "icons") -> identity names, fixed order."""
    characters = [f"glyph:{font}:{c}" for font in FONTS for c in CHARACTERS]
    icons = [f"icon:{name}" for name in MPL_ICONS] + [
        f"glyph:DejaVuSans.ttf:{c}" for c in PICTOGRAPHS
    ]
    return {"characters": characters, "icons": icons}


def render(identity: str, size: int, margin: int, seed: int) -> np.ndarray:
    """One render of the identity: (size + 2 margin) square uint8 grey, random pose
    (rotation +-15 degrees, scale 0.7-0.95 of the frame, offset up to 8% of it), ink and
    paper levels, blur (sigma 0.3-1.2 pixels at 28x28) and noise (sigma 2-8 grey levels)."""
    rng = np.random.default_rng(seed)
    side = size + 2 * margin
    big = side * _SUPERSAMPLE
    shape_side = round(size * _SUPERSAMPLE * rng.uniform(0.7, 0.95))
    shape = _shape(identity, shape_side).rotate(
        rng.uniform(-15, 15), resample=Image.BICUBIC, expand=True
    )
    ink = Image.new("L", (big, big), 0)
    offset = rng.uniform(-0.08, 0.08, size=2) * size * _SUPERSAMPLE
    ink.paste(
        shape,
        (
            round((big - shape.width) / 2 + offset[0]),
            round((big - shape.height) / 2 + offset[1]),
        ),
    )
    scale = size / 28
    ink = ink.resize((side, side), Image.BOX).filter(
        ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2) * scale)
    )
    paper, ink_level = rng.uniform(170, 250), rng.uniform(0, 70)
    coverage = np.asarray(ink, dtype=np.float64) / 255
    pixels = paper + (ink_level - paper) * coverage
    pixels += rng.normal(0, rng.uniform(2, 8), size=pixels.shape)
    return np.clip(np.round(pixels), 0, 255).astype(np.uint8)


def seed_of(*parts: object) -> int:
    """A render seed from any parts (stable across runs and machines)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def originals(size: int, mode: str, renders: int, source: str) -> list[real_images.Original]:
    """Renders of every identity of `source`: `renders` users per identity, one render
    each. References (the evaluation side): in `by_user` mode the even users of every
    identity, in `by_identity` mode every user of the even identities. Group: the
    identity, so a distinct image names the shape it looks like."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"split mode must be one of {SPLIT_MODES}, got {mode!r}")
    margin = real_images.margin_for(size)
    result = []
    for number, identity in enumerate(identities()[source]):
        for user in range(renders):
            reference = user % 2 == 0 if mode == BY_USER else number % 2 == 0
            result.append(
                real_images.Original(
                    name=f"{identity}#{user}",
                    source=source,
                    group=identity,
                    reference=reference,
                    canvas=render(identity, size, margin, seed_of(identity, user, size)),
                    margin=margin,
                )
            )
    return result

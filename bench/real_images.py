"""Real images shipped inside packages of the venv, and near-duplicate copies of them.

Used by the dedup benchmark (bench/bench_dedup.py) and its Beam test
(tests/beam_jobs/test_dedup.py), so both judge dedup on the same images. Nothing is
downloaded; every source is a file an installed package ships:

- scikit-learn (BSD-3-Clause): `load_digits()`, 1,797 real 8x8 scans of handwritten
  digits (UCI "Optical Recognition of Handwritten Digits", 43 writers); `china.jpg` and
  `flower.jpg` (sklearn/datasets/images, photos under CC BY 2.0 by danielbuechele and
  vultilion on Flickr, per that folder's README.txt).
- matplotlib (PSF-style matplotlib license), mpl-data/sample_data: `grace_hopper.jpg`
  (US Navy portrait, public domain), `s1045.ima.gz` (a 256x256 MRI slice),
  `jacksboro_fault_dem.npz` (a 344x403 elevation model), `Minduka_Present_Blue_Pack.png`
  and `logo2.png` (graphics).

An `Original` is one distinct image at the benchmark's size: a digit scan scaled up, or
one tile of a non-overlapping grid over a photo, the MRI slice, the elevation model
(stretched to 0..255 per tile) or a graphic. Tiles are cut with a margin so that a
shifted copy is a real re-crop of the source, not a black border. Originals split into
references (the evaluation side of dedup) and distinct images (training candidates that
must be kept): digits alternate within their class, so every distinct digit has
references of the same class by another scan, and tiles alternate as a checkerboard, so
a distinct tile's neighbours in the same photo are references.

`TRANSFORMS` make copies of a reference that dedup must remove (re-encoding, resizing,
crops, shifts, brightness and contrast, grey conversion); their pixel amounts scale
with the image side (1 px at 28x28 is 4 px at 112x112).
"""

import dataclasses
import functools
import hashlib
import io
from collections.abc import Callable

import numpy as np
from PIL import Image

# Tiles of this many source pixels become one image (before the margin).
_TILE = 48
# Tiles flatter than this (std of grey levels) are sky or background: two of them have no
# content to tell apart, so they are neither originals nor distinct images.
_MIN_TILE_STD = 16.0
# Margin (in output pixels at 28x28) around each image: the largest shift of a copy.
_MARGIN_28 = 2


@dataclasses.dataclass(frozen=True)
class Original:
    name: str  # unique, e.g. "digit7-0412" or "china-r2c5"
    source: str  # digits, china, flower, grace_hopper, mri, elevation, graphics
    group: str  # what a distinct image is hard against: "digit7", or its source image
    reference: bool  # evaluation side (copies made of it) or a distinct candidate
    canvas: np.ndarray  # (size + 2 margin) square, HxW or HxWx3 uint8
    margin: int

    @property
    def pixels(self) -> np.ndarray:
        m = self.margin
        return self.canvas[m : self.canvas.shape[0] - m, m : self.canvas.shape[1] - m]

    @property
    def half(self) -> int:
        """0 or 1, fixed by the name: thresholds are chosen on half 0, checked on half 1."""
        return hashlib.sha256(self.name.encode()).digest()[0] & 1


def _scale(image: Image.Image, size: int) -> np.ndarray:
    return np.asarray(image.resize((size, size), Image.BICUBIC))


def margin_for(size: int) -> int:
    return round(_MARGIN_28 * size / 28)


def _digits(size: int, per_class: int) -> list[Original]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    margin = margin_for(size)
    originals = []
    for label in range(10):
        indices = np.flatnonzero(digits.target == label)[: 2 * per_class]
        for position, index in enumerate(indices):
            scan = np.round(digits.images[index] * (255 / 16)).astype(np.uint8)
            pixels = np.clip(_scale(Image.fromarray(scan), size), 0, 255)
            originals.append(
                Original(
                    name=f"digit{label}-{index:04d}",
                    source="digits",
                    group=f"digit{label}",
                    reference=position % 2 == 0,
                    # Digit scans have a black background: the margin is background too.
                    canvas=np.pad(pixels, margin),
                    margin=margin,
                )
            )
    return originals


def _sample_data(name: str):
    from matplotlib import cbook

    return cbook.get_sample_data(name)


@functools.cache
def sources() -> dict[str, np.ndarray]:
    """Source name -> uint8 HxW or HxWx3 array."""
    from sklearn.datasets import load_sample_image

    with _sample_data("s1045.ima.gz") as f:
        mri = np.frombuffer(f.read(), ">u2").reshape(256, 256)  # values 0..215
    elevation = _sample_data("jacksboro_fault_dem.npz")["elevation"].astype(np.float64)

    def rgb(name: str) -> np.ndarray:
        with Image.open(_sample_data(name)) as image:
            if image.mode == "RGBA":  # graphics: composed on white, as a viewer shows them
                white = Image.new("RGBA", image.size, (255, 255, 255, 255))
                return np.asarray(Image.alpha_composite(white, image).convert("RGB"))
            return np.asarray(image.convert("RGB"))

    return {
        "china": load_sample_image("china.jpg"),
        "flower": load_sample_image("flower.jpg"),
        "grace_hopper": rgb("grace_hopper.jpg"),
        "mri": mri.astype(np.uint8),
        "elevation": elevation,  # stretched per tile below
        "blue_pack": rgb("Minduka_Present_Blue_Pack.png"),
        "logo": rgb("logo2.png"),
    }


def _grey(pixels: np.ndarray) -> np.ndarray:
    if pixels.ndim == 2:
        return pixels.astype(np.float64)
    return pixels.astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def _tiles(size: int) -> list[Original]:
    margin = margin_for(size)
    # Source pixels of the margin: a shift of d output pixels re-crops d * tile/size.
    source_margin = -(-margin * _TILE // size)
    stride = _TILE + 2 * source_margin
    originals = []
    for source, image in sources().items():
        height, width = image.shape[:2]
        for row, top in enumerate(range(0, height - stride + 1, stride)):
            for column, left in enumerate(range(0, width - stride + 1, stride)):
                crop = image[top : top + stride, left : left + stride]
                if source == "elevation":
                    low, high = crop.min(), crop.max()
                    crop = np.round((crop - low) * 255 / max(high - low, 1)).astype(np.uint8)
                inner = crop[source_margin:-source_margin, source_margin:-source_margin]
                if _grey(inner).std() < _MIN_TILE_STD:
                    continue
                canvas = _scale(Image.fromarray(crop), size + 2 * margin)
                originals.append(
                    Original(
                        name=f"{source}-r{row}c{column}",
                        source="graphics" if source in ("blue_pack", "logo") else source,
                        group=source,
                        reference=(row + column) % 2 == 0,
                        canvas=canvas,
                        margin=margin,
                    )
                )
    return originals


def originals(size: int, digits_per_class: int = 30) -> list[Original]:
    """Distinct real images of `size` x `size` pixels: 2 x digits_per_class digits of each
    class (half references) and every tile with content (about half references)."""
    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    return _digits(size, digits_per_class) + _tiles(size)


def encode(pixels: np.ndarray, image_format: str = "PNG", quality: int = 95) -> bytes:
    buffer = io.BytesIO()
    options = {"quality": quality} if image_format == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format=image_format, **options)
    return buffer.getvalue()


def _px(original: Original, pixels_at_28: int) -> int:
    return max(1, round(pixels_at_28 * original.pixels.shape[0] / 28))


def _shifted(original: Original, dx: int, dy: int) -> np.ndarray:
    """The source re-cropped (dx, dy) output pixels away: content moves by (-dx, -dy)."""
    dx, dy = _px(original, dx) * np.sign(dx), _px(original, dy) * np.sign(dy)
    m, size = original.margin, original.pixels.shape[0]
    if max(abs(dx), abs(dy)) > m:
        raise ValueError(f"shift ({dx}, {dy}) beyond the margin {m}")
    return original.canvas[m + dy : m + dy + size, m + dx : m + dx + size]


def _resized(pixels: np.ndarray, size: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((size, size), Image.BICUBIC))


def _crop_resize(original: Original, pixels_at_28: int) -> np.ndarray:
    """`pixels_at_28` (scaled) cropped off the top and left, resized back."""
    k, size = _px(original, pixels_at_28), original.pixels.shape[0]
    return _resized(original.pixels[k:, k:], size)


def _brightness(pixels: np.ndarray, offset: float, gain: float) -> np.ndarray:
    values = pixels.astype(np.float64)
    values = (values - values.mean()) * gain + values.mean() + offset
    return np.clip(np.round(values), 0, 255).astype(np.uint8)


def _grey_copy(original: Original) -> bytes | None:
    if original.pixels.ndim == 2:
        return None  # already grey: the copy would be the same pixels
    return encode(np.asarray(Image.fromarray(original.pixels).convert("L")))


def _size(original: Original) -> int:
    return original.pixels.shape[0]


# name -> copy of a reference as encoded image bytes (None: does not apply to it).
TRANSFORMS: dict[str, Callable[[Original], bytes | None]] = {
    "jpeg_q90": lambda o: encode(o.pixels, "JPEG", 90),
    "jpeg_q60": lambda o: encode(o.pixels, "JPEG", 60),
    "jpeg_q30": lambda o: encode(o.pixels, "JPEG", 30),
    "resize_half_and_back": lambda o: encode(_resized(_resized(o.pixels, _size(o) // 2), _size(o))),
    "resize_double_and_back": lambda o: encode(
        _resized(_resized(o.pixels, 2 * _size(o)), _size(o))
    ),
    "stored_at_3_4_size": lambda o: encode(_resized(o.pixels, 3 * _size(o) // 4)),
    "crop_1px_resize": lambda o: encode(_crop_resize(o, 1)),
    "crop_2px_resize": lambda o: encode(_crop_resize(o, 2)),
    "shift_1px": lambda o: encode(_shifted(o, 1, -1)),
    "shift_2px": lambda o: encode(_shifted(o, -2, 1)),
    "shift_2px_jpeg_q60": lambda o: encode(_shifted(o, 2, 2), "JPEG", 60),
    "brighter_40": lambda o: encode(_brightness(o.pixels, 40, 1.0)),
    "contrast_0_6": lambda o: encode(_brightness(o.pixels, 0, 0.6)),
    "darker_contrast_1_3": lambda o: encode(_brightness(o.pixels, -20, 1.3)),
    "grey": _grey_copy,
}

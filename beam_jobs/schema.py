"""The one canonical record schema (docs/design.md section 3); every reader and writer uses it.

A canonical record is a `tf.train.Example` with three single-valued bytes features:
`user_id`, `identity` and `image/encoded` (PNG or JPEG bytes). Pipelines pass records
between stages serialized, so the wire form is the schema.

Hostile input (issue 8): a record is rejected with a `RecordError` whose `reason` ingest
counts, never a crash:
- names (user_id, identity) must be valid UTF-8, non-empty, at most `MAX_NAME_BYTES`,
  and free of control, line-separator and bidirectional-override characters (they would
  forge log lines or reorder what an operator reads). Path separators and ".." are
  allowed: names are opaque data. A name becomes a file or folder name only through
  `path_component`, the one sanitiser.
- images: PNG or JPEG magic, dimensions read from the header (PIL, which decodes
  nothing yet) and refused above `max_pixels` before any pixel is decoded
  (decompression bombs); zero-size images and truncated or corrupt data are rejected.
  Pixels are decoded by `tf.io.decode_image`, the decoder training and serving use
  (`tff_algorithms.modeling.export.decode_image`), so an accepted record never fails in
  training and dedup sees the pixels the model sees. Other pixel formats are
  converted, not skipped: alpha is dropped, palettes are expanded, 16-bit samples keep
  their high byte, and colour goes to grey by luma when the model takes one channel.
"""

import dataclasses
import hashlib
import io
import struct
import unicodedata
import warnings

import numpy as np
import tensorflow as tf
from PIL import Image

# Part of the schema's API (records hold PNG or JPEG bytes); defined apart so that image
# writers need neither TensorFlow nor Beam.
from beam_jobs.png_encoding import encode_png  # noqa: F401

USER_ID_KEY = "user_id"
IDENTITY_KEY = "identity"
IMAGE_KEY = "image/encoded"

FEATURE_KEYS = (USER_ID_KEY, IDENTITY_KEY, IMAGE_KEY)

# Parsing spec for tf.data (`tf.io.parse_example` / `parse_single_example`).
FEATURE_SPEC = {key: tf.io.FixedLenFeature([], tf.string) for key in FEATURE_KEYS}

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JPEG_MAGIC = b"\xff\xd8\xff"

# Reasons a record is rejected; ingest counts them under these names.
MISSING_FIELD = "missing_field"
CORRUPT_IMAGE = "corrupt_image"
UNSUPPORTED_IMAGE_FORMAT = "unsupported_image_format"
IMAGE_TOO_LARGE = "image_too_large"
EMPTY_IMAGE = "empty_image"
INVALID_NAME = "invalid_name"

# 25 megapixels: a 5000x5000 photo; decoding one takes at most 75 MB as RGB.
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000
MAX_NAME_BYTES = 1024
# Formatting characters that reorder displayed text ("Trojan Source").
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
# PIL modes of one-channel images.
# PNG colour types PIL decodes to the pixels TensorFlow gives (8 bits a sample).
_PNG_8BIT_MODES = {0: "L", 2: "RGB"}
_GREY_MODES = ("1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N")
# Characters kept as they are by path_component; everything else is %XX-escaped.
_PATH_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")
_MAX_PATH_COMPONENT = 200


class RecordError(ValueError):
    """A record that does not satisfy the canonical schema; `reason` names the kind."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class CanonicalRecord:
    user_id: str
    identity: str
    image: bytes  # encoded PNG or JPEG


def to_example(record: CanonicalRecord) -> tf.train.Example:
    example = tf.train.Example()
    feature = example.features.feature
    feature[USER_ID_KEY].bytes_list.value.append(record.user_id.encode("utf-8"))
    feature[IDENTITY_KEY].bytes_list.value.append(record.identity.encode("utf-8"))
    feature[IMAGE_KEY].bytes_list.value.append(record.image)
    return example


def serialize(record: CanonicalRecord) -> bytes:
    # Deterministic: map fields sorted, so equal records have equal bytes everywhere.
    return to_example(record).SerializeToString(deterministic=True)


def _single_bytes(example: tf.train.Example, key: str) -> bytes:
    feature = example.features.feature.get(key)
    if feature is None or feature.WhichOneof("kind") != "bytes_list":
        raise RecordError(MISSING_FIELD, f"record has no bytes feature {key!r}")
    values = feature.bytes_list.value
    if len(values) != 1 or not values[0]:
        raise RecordError(MISSING_FIELD, f"feature {key!r} must hold exactly one non-empty value")
    return values[0]


def parse(serialized: bytes) -> CanonicalRecord:
    """Parses a serialized canonical example; raises RecordError on schema violations."""
    example = tf.train.Example()
    try:
        example.ParseFromString(serialized)
    except Exception as e:  # protobuf raises its own DecodeError type
        raise RecordError(MISSING_FIELD, f"not a tf.train.Example: {e}") from e
    try:
        user_id = _single_bytes(example, USER_ID_KEY).decode("utf-8")
        identity = _single_bytes(example, IDENTITY_KEY).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(INVALID_NAME, "user_id/identity must be UTF-8") from e
    return CanonicalRecord(user_id, identity, _single_bytes(example, IMAGE_KEY))


def check_name(name: str, field: str) -> None:
    """Raises RecordError(INVALID_NAME) unless `name` is a valid user or identity name.

    The message shows the name ASCII-escaped, so it cannot forge or split a log line.
    """
    if not isinstance(name, str) or not name:
        raise RecordError(MISSING_FIELD, f"{field} must be a non-empty string")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates: undecodable bytes from a file name
        raise RecordError(INVALID_NAME, f"{field} {ascii(name)[:80]} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise RecordError(INVALID_NAME, f"{field} is {size} bytes long, over {MAX_NAME_BYTES}")
    for character in name:
        if unicodedata.category(character) in ("Cc", "Zl", "Zp") or character in _BIDI_CONTROLS:
            raise RecordError(
                INVALID_NAME,
                f"{field} {ascii(name)[:80]} holds control character {ascii(character)}",
            )


def path_component(name: str) -> str:
    """`name` as one safe file or folder name: the only way a name becomes part of a path.

    Letters, digits, "-", "_" and "." stay; every other byte of the UTF-8 form (also "%",
    separators, control bytes) becomes %XX, a leading "." too (so neither "." nor ".."
    nor hidden names appear). Names are distinct when their results are: the escaping
    is reversible, and a result that would pass 200 characters is cut and ends in a hash
    of the whole name. Lone surrogates (undecodable bytes of a listed file name, as
    os.fsdecode gives them) are escaped as the bytes they stand for.
    """
    escaped = "".join(
        chr(byte) if chr(byte) in _PATH_SAFE else f"%{byte:02X}"
        for byte in name.encode("utf-8", "surrogateescape")
    )
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    if not escaped:
        return "%"  # the empty name: "%" alone is never produced by escaping
    if len(escaped) > _MAX_PATH_COMPONENT:
        digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=16)
        escaped = f"{escaped[: _MAX_PATH_COMPONENT - 33]}~{digest.hexdigest()}"
    return escaped


def image_format(image: bytes) -> str:
    """Returns "png" or "jpeg" from the magic bytes; raises RecordError otherwise."""
    if image.startswith(_PNG_MAGIC):
        return "png"
    if image.startswith(_JPEG_MAGIC):
        return "jpeg"
    raise RecordError(UNSUPPORTED_IMAGE_FORMAT, "image is neither PNG nor JPEG")


def _first_line(error: Exception) -> str:
    text = str(error).splitlines()
    return text[0][:200] if text else type(error).__name__


def _header(image: bytes, max_pixels: int) -> str:
    """The PIL mode of an image whose header is sane and within `max_pixels`; PIL's
    open() reads only the header, so nothing is decoded yet."""
    try:
        with warnings.catch_warnings():
            # PIL warns about large images in open(); the limit below decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(image)) as opened:
                width, height = opened.size
                mode = opened.mode
    except Image.DecompressionBombError as e:
        raise RecordError(IMAGE_TOO_LARGE, f"image is too large: {_first_line(e)}") from e
    except Exception as e:  # PIL raises many unrelated types for broken files
        raise RecordError(CORRUPT_IMAGE, f"image header does not parse: {_first_line(e)}") from e
    if width < 1 or height < 1:
        raise RecordError(CORRUPT_IMAGE, f"image is {width}x{height} pixels")
    if width * height > max_pixels:
        raise RecordError(
            IMAGE_TOO_LARGE, f"image is {width}x{height} pixels, over the limit of {max_pixels}"
        )
    return mode


def _decode(image: bytes, max_pixels: int) -> tuple[np.ndarray, str]:
    """(uint8 pixels HxW or HxWx3, the image's own PIL mode); see decode_image."""
    if not image:
        raise RecordError(EMPTY_IMAGE, "image is empty (0 bytes)")
    image_format(image)
    mode = _header(image, max_pixels)
    channels = 1 if mode in _GREY_MODES else 3
    try:
        # The decoder training and serving use (tff_algorithms.modeling.export.decode_image): a
        # record that passes here can never stop a training round, and dedup sees the
        # pixels the model sees. PIL accepts some data it rejects (fuzzing found them).
        # The op tf.io.decode_image runs, called without its Python wrapper: half the time
        # per small image, and dedup decodes every image of every split.
        pixels = tf.raw_ops.DecodeImage(
            contents=image, channels=channels, expand_animations=False
        ).numpy()
    except tf.errors.OpError as e:
        # TF prefixes "{{function_node ...}}"; the reason follows it.
        message = e.message.split("}}", 1)[-1].strip()
        raise RecordError(CORRUPT_IMAGE, f"image does not decode: {message[:200]}") from None
    return (pixels[:, :, 0] if channels == 1 else pixels), mode


def decode_image(image: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """Decodes PNG/JPEG bytes to uint8 pixels, HxW (grey) or HxWx3 (colour).

    The size is checked from the header, before decoding (module docstring); other
    pixel formats are converted as `tf.io.decode_image` converts them.
    """
    return _decode(image, max_pixels)[0]


def _plain_png_pixels(image: bytes, mode: str, width: int, height: int) -> np.ndarray | None:
    """The pixels of a PNG whose chunks are IHDR, IDAT and IEND only (what encode_png and
    most writers produce), None for any other: its IDAT data goes straight to PIL's PNG
    (zip) decoder, without PIL's per-chunk Python (about half the cost per small image).
    Any other chunk (transparency, palette, gamma...) takes the general path."""
    data, position = [], len(_PNG_MAGIC)
    while position + 8 <= len(image):
        length, kind = struct.unpack(">I4s", image[position : position + 8])
        if kind == b"IDAT":
            data.append(image[position + 8 : position + 8 + length])
        elif kind == b"IEND":
            break
        elif kind != b"IHDR":
            return None
        position += 12 + length
    else:
        return None
    try:
        decoded = Image.frombytes(mode, (width, height), b"".join(data), "zip", mode)
    except Exception:  # noqa: BLE001 - the general path decides (and names the error)
        return None
    return np.asarray(decoded)


def decode_validated_image(image: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray:
    """decode_image for a record that already passed `validate` (dedup decodes every image
    of every split). An 8-bit grey or RGB PNG, the canonical records' usual form, is
    decoded by PIL straight from its IHDR: lossless, so the pixels are TensorFlow's to the
    bit (tests/beam_jobs/test_schema.py), at about half the cost of a TensorFlow op call per
    image. Any other image, or a PNG that PIL does not decode, takes decode_image."""
    if image.startswith(_PNG_MAGIC) and image[12:16] == b"IHDR" and len(image) >= 29:
        width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", image[16:29])
        mode = _PNG_8BIT_MODES.get(colour)
        if depth == 8 and mode and interlace == 0 and 0 < width * height <= max_pixels:
            pixels = _plain_png_pixels(image, mode, width, height)
            if pixels is not None:
                return pixels
        if depth == 8 and mode and interlace in (0, 1) and 0 < width * height <= max_pixels:
            try:
                with Image.open(io.BytesIO(image), formats=("PNG",)) as opened:
                    if opened.mode == mode and opened.size == (width, height):
                        return np.asarray(opened)
            except Exception:  # noqa: BLE001 - TensorFlow's decoder decides below
                pass
    return decode_image(image, max_pixels)


def validate(record: CanonicalRecord, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str:
    """Raises RecordError unless the names are valid (`check_name`) and the image decodes
    within `max_pixels`; returns the image's own PIL mode ("L", "RGB", "RGBA", "I;16",
    ...), so callers can count conversions."""
    check_name(record.user_id, USER_ID_KEY)
    check_name(record.identity, IDENTITY_KEY)
    return _decode(record.image, max_pixels)[1]


def parse_tf_example(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
    """tf.data parser: serialized canonical example -> dict of scalar string tensors."""
    return tf.io.parse_single_example(serialized, FEATURE_SPEC)

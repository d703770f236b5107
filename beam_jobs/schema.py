"""The one canonical record schema (DESIGN.md section 3); every reader and writer uses it.

A canonical record is a `tf.train.Example` with three single-valued bytes features:
`user_id`, `identity` and `image/encoded` (PNG or JPEG bytes). Pipelines pass records
between stages serialized, so the wire form is the schema.
"""

import dataclasses
import io

import numpy as np
import tensorflow as tf
from PIL import Image

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
        raise RecordError(MISSING_FIELD, "user_id/identity must be UTF-8") from e
    return CanonicalRecord(user_id, identity, _single_bytes(example, IMAGE_KEY))


def image_format(image: bytes) -> str:
    """Returns "png" or "jpeg" from the magic bytes; raises RecordError otherwise."""
    if image.startswith(_PNG_MAGIC):
        return "png"
    if image.startswith(_JPEG_MAGIC):
        return "jpeg"
    raise RecordError(UNSUPPORTED_IMAGE_FORMAT, "image is neither PNG nor JPEG")


def decode_image(image: bytes) -> np.ndarray:
    """Decodes PNG/JPEG bytes to uint8 pixels, HxW (grayscale) or HxWx3 (RGB)."""
    image_format(image)
    try:
        with Image.open(io.BytesIO(image)) as opened:
            opened.load()
            mode = "L" if opened.mode in ("L", "1", "I;16", "I", "F") else "RGB"
            return np.asarray(opened.convert(mode))
    except Exception as e:  # PIL raises many unrelated types for broken files
        raise RecordError(CORRUPT_IMAGE, f"image does not decode: {e}") from e


def encode_png(pixels: np.ndarray) -> bytes:
    """Encodes HxW or HxWx3 uint8 pixels as PNG."""
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3):
        raise ValueError(f"expected uint8 HxW or HxWxC pixels, got {pixels.dtype} {pixels.shape}")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def validate(record: CanonicalRecord) -> None:
    """Raises RecordError unless the ids are non-empty and the image decodes."""
    if not record.user_id or not record.identity:
        raise RecordError(MISSING_FIELD, "user_id and identity must be non-empty")
    decode_image(record.image)


def parse_tf_example(serialized: tf.Tensor) -> dict[str, tf.Tensor]:
    """tf.data parser: serialized canonical example -> dict of scalar string tensors."""
    return tf.io.parse_single_example(serialized, FEATURE_SPEC)

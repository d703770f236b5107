"""The canonical record schema: round trips and rejections."""

import glob
import io
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from beam_jobs import schema
from bench import real_images


def _png(value: int = 7) -> bytes:
    return schema.encode_png(np.full((4, 4), value, dtype=np.uint8))


def test_serialize_parse_round_trip_and_tf_parse():
    record = schema.CanonicalRecord("user-1", "identity-1", _png())
    serialized = schema.serialize(record)
    assert schema.parse(serialized) == record
    features = schema.parse_tf_example(tf.constant(serialized))
    assert features[schema.USER_ID_KEY].numpy() == b"user-1"
    assert features[schema.IMAGE_KEY].numpy() == record.image


def test_missing_field_is_rejected_with_reason():
    example = schema.to_example(schema.CanonicalRecord("u", "i", _png()))
    del example.features.feature[schema.IDENTITY_KEY]
    with pytest.raises(schema.RecordError) as error:
        schema.parse(example.SerializeToString())
    assert error.value.reason == schema.MISSING_FIELD


@pytest.mark.parametrize(
    "image, reason",
    [(b"GIF89a...", schema.UNSUPPORTED_IMAGE_FORMAT), (_png()[:20], schema.CORRUPT_IMAGE)],
)
def test_bad_images_are_rejected_with_reason(image, reason):
    with pytest.raises(schema.RecordError) as error:
        schema.validate(schema.CanonicalRecord("u", "i", image))
    assert error.value.reason == reason


def test_decode_image_keeps_grayscale_and_rgb():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    np.testing.assert_array_equal(schema.decode_image(schema.encode_png(rgb)), rgb)
    assert schema.decode_image(_png()).shape == (4, 4)


def _png_variants(pixels: np.ndarray) -> list[bytes]:
    """The real image as PNGs of every colour type and depth PIL writes: 8-bit grey and
    RGB (decode_validated_image's own path), with a transparent colour, palette, grey and
    colour with alpha, 16-bit grey, 1-bit."""
    image = Image.fromarray(pixels).convert("RGB")
    grey = image.convert("L")
    variants = [
        image,
        grey,
        image.convert("P", palette=Image.Palette.ADAPTIVE),
        image.convert("RGBA"),
        grey.convert("LA"),
        Image.fromarray(np.asarray(grey).astype(np.uint16) * 257),
        grey.convert("1"),
    ]
    encoded = []
    for variant in variants:
        buffer = io.BytesIO()
        variant.save(buffer, format="PNG")
        encoded.append(buffer.getvalue())
    for variant in (grey, image):  # tRNS chunk: a transparent grey level / colour
        buffer = io.BytesIO()
        variant.save(buffer, format="PNG", transparency=0 if variant.mode == "L" else (0, 0, 0))
        encoded.append(buffer.getvalue())
    return encoded


def test_validated_decode_gives_tensorflows_pixels_on_real_images():
    """Dedup's fast decoder must see what training sees, bit for bit: real photos and
    graphics that scikit-learn and matplotlib ship, as PNGs of every colour type, as
    JPEG, and matplotlib's own icon files as they are."""
    from matplotlib import get_data_path

    sources = real_images.sources()
    photos = [pixels for pixels in sources.values() if pixels.dtype == np.uint8]
    images = [png for pixels in photos for png in _png_variants(pixels[:96, :128])]
    images += [real_images.encode(sources["china"][:64, :64], "JPEG", quality=70)]
    icons = sorted(glob.glob(os.path.join(get_data_path(), "images", "*.png")))[:40]
    assert icons, "matplotlib ships its toolbar icons as PNG"
    for path in icons:
        with open(path, "rb") as f:
            images.append(f.read())
    for encoded in images:
        np.testing.assert_array_equal(
            schema.decode_validated_image(encoded), schema.decode_image(encoded)
        )


def test_validated_decode_refuses_what_decode_image_refuses():
    width_over = schema.DEFAULT_MAX_IMAGE_PIXELS + 1
    too_large = schema.encode_png(np.zeros((1, 8), np.uint8))
    too_large = too_large[:16] + width_over.to_bytes(4, "big") + too_large[20:]
    for bad in (b"", b"GIF89a", _png()[:40], too_large):
        with pytest.raises(schema.RecordError):
            schema.decode_validated_image(bad)

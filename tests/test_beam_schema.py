"""The canonical record schema: round trips and rejections."""

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import schema


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

"""Pixel bounds of the serving signature, checked from the image headers before decoding.

A PNG or JPEG of a few hundred kilobytes can declare billions of pixels (a 514 KB grey
PNG of 23000×23000 took 3.2 GB to decode; issue 63). Ingest refuses such images from
their headers (`beam_jobs.schema`); the serving SavedModel must too, since it decodes
whatever a caller sends. `check_pixel_bounds` reads each image's width and height from
its header inside the graph (the PNG IHDR chunk's two big-endian 32-bit fields, the JPEG
frame header through `tf.io.extract_jpeg_shape`), and fails the call with
`InvalidArgumentError` before any image is decoded when one image is over
`max_image_pixels` or the batch together over `max_batch_pixels`. Bytes that are neither
PNG nor JPEG fail the same way (the signature takes only those).

The defaults are ingest's bound (`schema.DEFAULT_MAX_IMAGE_PIXELS`, 25 M pixels) and four
such images a call; the model card states both.
"""

from __future__ import annotations

import tensorflow as tf

from beam_jobs import schema

MAX_IMAGE_PIXELS = schema.DEFAULT_MAX_IMAGE_PIXELS
MAX_BATCH_PIXELS = 4 * MAX_IMAGE_PIXELS
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Each side is clamped here before multiplying: a PNG may declare 2^32 - 1, and the
# product of two such sides would overflow int64.
_SIDE_CAP = 2**31


def _png_pixels(encoded: tf.Tensor) -> tf.Tensor:
    sides = tf.cast(tf.io.decode_raw(tf.strings.substr(encoded, 16, 8), tf.uint8), tf.int64)
    width = ((sides[0] * 256 + sides[1]) * 256 + sides[2]) * 256 + sides[3]
    height = ((sides[4] * 256 + sides[5]) * 256 + sides[6]) * 256 + sides[7]
    return tf.minimum(width, _SIDE_CAP) * tf.minimum(height, _SIDE_CAP)


def _jpeg_pixels(encoded: tf.Tensor) -> tf.Tensor:
    shape = tf.cast(tf.io.extract_jpeg_shape(encoded), tf.int64)
    return shape[0] * shape[1]


def _not_an_image() -> tf.Tensor:
    refused = tf.debugging.Assert(
        tf.constant(False),
        ["images must be PNG or JPEG bytes (this one has no PNG or JPEG header)"],
    )
    with tf.control_dependencies([refused]):
        return tf.constant(-1, tf.int64)


def _is_png(encoded: tf.Tensor) -> tf.Tensor:
    # The signature, then the IHDR chunk that must come first (length 13, type IHDR).
    return tf.cond(
        tf.strings.length(encoded) >= 24,
        lambda: tf.logical_and(
            tf.equal(tf.strings.substr(encoded, 0, 8), _PNG_SIGNATURE),
            tf.equal(tf.strings.substr(encoded, 8, 8), b"\x00\x00\x00\x0dIHDR"),
        ),
        lambda: tf.constant(False),
    )


@tf.autograph.experimental.do_not_convert
def header_pixels(encoded: tf.Tensor) -> tf.Tensor:
    """Width × height (int64) that a PNG or JPEG's header declares, read without
    decoding the image; bytes of another kind fail with `InvalidArgumentError`."""
    return tf.cond(
        _is_png(encoded),
        lambda: _png_pixels(encoded),
        lambda: tf.cond(tf.io.is_jpeg(encoded), lambda: _jpeg_pixels(encoded), _not_an_image),
    )


def check_pixel_bounds(
    images: tf.Tensor,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    max_batch_pixels: int = MAX_BATCH_PIXELS,
) -> tf.Tensor:
    """`images` (a [batch] string tensor) once every image's header is within
    `max_image_pixels` and the batch's total within `max_batch_pixels`; decoding that
    depends on the result starts only after the check (module docstring)."""
    pixels = tf.map_fn(header_pixels, images, fn_output_signature=tf.int64)
    image_check = tf.debugging.assert_less_equal(
        pixels,
        tf.constant(max_image_pixels, tf.int64),
        message=(
            f"an image declares more than {max_image_pixels:,} pixels (the model's bound, "
            "checked from its header before decoding); send it resized below the bound"
        ),
    )
    with tf.control_dependencies([image_check]):
        # Every image is within its bound here, so the sum cannot overflow.
        total = tf.reduce_sum(pixels)
    batch_check = tf.debugging.assert_less_equal(
        total,
        tf.constant(max_batch_pixels, tf.int64),
        message=(
            f"the images of one call declare more than {max_batch_pixels:,} pixels "
            "together (the model's bound a call); send them in smaller batches"
        ),
    )
    with tf.control_dependencies([image_check, batch_check]):
        return tf.identity(images)

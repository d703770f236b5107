"""The serving signature refuses images over its pixel bounds from their headers, before
decoding (`tff_algorithms/modeling/bounded_decode.py`; issue 63)."""

import io
import json
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tff_algorithms.config import model_config
from tff_algorithms.modeling import bounded_decode, export, models

GREY = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def grey_png(width: int, height: int) -> bytes:
    """A valid all-black grey PNG of any size, compressed row by row (never held whole)."""
    compressor = zlib.compressobj(9)
    rows = b"\x00" * (width + 1) * 1000  # filter byte 0 and the row's pixels, 1000 rows
    data = []
    for start in range(0, height, 1000):
        data.append(compressor.compress(rows[: (width + 1) * min(1000, height - start)]))
    data.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", b"".join(data))
        + _chunk(b"IEND", b"")
    )


def _jpeg(height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width), 128, np.uint8), mode="L").save(buffer, "JPEG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def serving_model(tmp_path_factory) -> str:
    backbone = models.build_backbone(GREY, seed=3)
    export_dir = str(tmp_path_factory.mktemp("model") / "saved_model")
    return export.export_serving_model(GREY, models.backbone_weights(backbone), export_dir)


def test_header_pixels_are_read_from_png_and_jpeg_headers():
    assert int(bounded_decode.header_pixels(tf.constant(grey_png(300, 7)))) == 2100
    assert int(bounded_decode.header_pixels(tf.constant(_jpeg(9, 31)))) == 279
    # A PNG declaring 2^32 - 1 on both sides: clamped, no int64 overflow to a small count.
    huge = grey_png(1, 1)[:16] + struct.pack(">II", 2**32 - 1, 2**32 - 1) + grey_png(1, 1)[24:]
    assert int(bounded_decode.header_pixels(tf.constant(huge))) == 2**62
    for other in (b"GIF89a" + b"\x00" * 30, b"", b"\x89PNG\r\n\x1a\n"):
        with pytest.raises(tf.errors.InvalidArgumentError, match="must be PNG or JPEG bytes"):
            bounded_decode.header_pixels(tf.constant(other))


def test_the_bounds_refuse_one_image_and_a_batch_total():
    small, jpeg = grey_png(100, 100), _jpeg(100, 100)
    images = tf.constant([small, jpeg])
    out = bounded_decode.check_pixel_bounds(
        images, max_image_pixels=10_000, max_batch_pixels=20_000
    )
    assert out.numpy().tolist() == [small, jpeg]
    with pytest.raises(tf.errors.InvalidArgumentError, match="more than 9,999 pixels"):
        bounded_decode.check_pixel_bounds(images, max_image_pixels=9_999)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"together \(the model's bound"):
        bounded_decode.check_pixel_bounds(images, max_image_pixels=10_000, max_batch_pixels=19_999)


def test_the_serving_signature_serves_within_the_bounds(serving_model):
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 256, (40, 30), dtype=np.uint8)
    Image.fromarray(pixels, mode="L").save(buffer, "PNG")
    loaded = tf.saved_model.load(serving_model)
    out = loaded.signatures[export.SIGNATURE](images=tf.constant([buffer.getvalue()]))
    np.testing.assert_allclose(np.linalg.norm(out[export.OUTPUT_KEY], axis=1), 1.0, rtol=1e-5)


_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import tensorflow as tf

    model = tf.saved_model.load(sys.argv[1])
    serve = model.signatures["serving_default"]
    serve(images=tf.constant([], tf.string))  # the first call's one-off allocations
    image = open(sys.argv[2], "rb").read()
    results = {}
    for count in (1, 3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            serve(images=tf.constant([image] * count))
            results[count] = "served"
        except tf.errors.InvalidArgumentError as e:
            results[count] = e.message
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        results[f"{count}_grown_kib"] = grown
    print(json.dumps(results))
    """
)


@pytest.mark.slow
def test_a_23000_square_grey_png_is_refused_in_bounded_memory(serving_model, tmp_path):
    """Decoding it would take 529 MB of pixels and 2.1 GB as float32 (issue 63: 3.2 GB
    peak); refused from its header, the call's peak memory barely moves."""
    path = tmp_path / "huge.png"
    path.write_bytes(grey_png(23000, 23000))
    assert path.stat().st_size < 1_000_000
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, serving_model, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(result.stdout.splitlines()[-1])
    for count in ("1", "3"):
        assert "declares more than 25,000,000 pixels" in found[count], found
        # Far below the 529 MB that decoding the grey pixels alone would hold.
        assert found[f"{count}_grown_kib"] < 128 * 1024, found

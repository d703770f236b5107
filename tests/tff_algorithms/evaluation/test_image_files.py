"""The one image-file reader (beam_jobs/image_files.py) behind ingest and `dp-fedemb
evaluate` (issue 37 items 5 and 6): hostile files and names are skipped and counted the
same way by both, nothing hangs or reads without bound, and the serving signature
decodes every image ingest accepted (a CMYK JPEG for a one-channel model too)."""

import io
import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from beam_jobs import image_files, ingest, schema
from tests import support
from tff_algorithms.config import model_config
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.modeling import export, models

GREY_BACKBONE = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)


def _grey_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8)
    return schema.encode_png(pixels)


def _cmyk_jpeg(seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert("CMYK").save(buffer, format="JPEG")
    return buffer.getvalue()


def _write(folder: bytes, name: bytes, data: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


# What each hostile entry of `_hostile_folder` is counted as.
HOSTILE_REASONS = {
    schema.INVALID_NAME: 3,  # undecodable bytes, a newline, a bidi override in file names
    image_files.UNREADABLE_FILE: 4,  # a FIFO, /dev/zero, a folder, a dangling link
    schema.EMPTY_IMAGE: 1,
}


def _hostile_folder(root: str) -> int:
    """ROOT/<user>/<identity>/ with good images of three identities (a CMYK JPEG and a
    link to a regular file among them) and every hostile kind of file; returns the
    number of good images. The FIFO sorts before the /dev/zero link: a reader that
    hangs on it never starts an unbounded read."""
    folder = os.fsencode(os.path.join(root, "alice", "a"))
    for index in range(3):
        _write(folder, f"{index}.png".encode(), _grey_png(index))
    _write(folder, b"cmyk.jpg", _cmyk_jpeg())
    os.symlink(os.path.join(folder, b"0.png"), os.path.join(folder, b"link.png"))
    for identity, seed in ((b"b", 10), (b"c", 20)):
        for index in range(2):
            _write(
                os.path.join(os.fsencode(root), b"bob", identity),
                b"%d.png" % index,
                _grey_png(seed + index),
            )
    image = _grey_png(99)
    _write(folder, b"bad\xff.png", image)
    _write(folder, b"new\nline.png", image)
    _write(folder, "bidi\u202egnp.png".encode(), image)
    _write(folder, b"empty.png", b"")
    os.mkfifo(os.path.join(folder, b"fifo.png"))
    os.symlink(b"/dev/zero", os.path.join(folder, b"zero.png"))
    os.symlink(b"/nonexistent/image.png", os.path.join(folder, b"dangling.png"))
    os.mkdir(os.path.join(folder, b"folder.png"))
    return 4 + 1 + 4


def test_the_reader_never_opens_special_files_and_names_why(tmp_path):
    root = str(tmp_path / "raw")
    good = _hostile_folder(root)
    read = list(image_files.read_image_folder(root, schema.DEFAULT_MAX_IMAGE_PIXELS))
    bad = {
        item.source.rsplit("/", 1)[-1]: item
        for item in read
        if isinstance(item, image_files.BadInput)
    }
    assert len(read) - len(bad) == good
    assert bad["fifo.png"].detail == "is a FIFO, not a regular file"
    assert bad["zero.png"].detail == "is a character device, not a regular file"
    assert bad["folder.png"].detail == "is a folder, not a regular file"
    assert bad["dangling.png"].reason == image_files.UNREADABLE_FILE
    assert all(item.source.isprintable() for item in bad.values())
    assert "CMYK" in {item.mode for item in read if isinstance(item, image_files.CheckedImage)}


def test_ingest_counts_hostile_file_names_and_special_files(tmp_path):
    root = str(tmp_path / "raw")
    good = _hostile_folder(root)
    summary = ingest.run_ingest([root], str(tmp_path / "out"), max_bad_fraction=1.0)
    assert summary["bad_by_reason"] == HOSTILE_REASONS
    assert summary["records"] == good
    sources = "".join(example["source"] for example in summary["bad_examples"])
    assert "bad\\udcff.png" in sources and "new\\nline.png" in sources


def test_a_file_that_grows_past_the_size_limit_is_refused_from_the_read(tmp_path):
    # The size is checked again on what was read: the bound holds for files whose size
    # the stat does not tell (or that grow after it).
    folder = os.fsencode(str(tmp_path / "raw" / "u" / "i"))
    _write(folder, b"big.png", _grey_png(0))
    max_pixels = 10
    path = os.path.join(folder, b"big.png")
    assert os.path.getsize(path) > image_files.max_encoded_bytes(max_pixels)
    refused = image_files.read_image(path, "u", "i", max_pixels)
    assert refused.reason == schema.IMAGE_TOO_LARGE


@pytest.fixture(scope="module")
def grey_model(tmp_path_factory) -> str:
    backbone = models.build_backbone(GREY_BACKBONE, seed=3)
    export_dir = str(tmp_path_factory.mktemp("model") / "saved_model")
    return export.export_serving_model(GREY_BACKBONE, models.backbone_weights(backbone), export_dir)


def _evaluate(*args: str) -> subprocess.CompletedProcess:
    # A time limit: a reader that blocks on a FIFO fails the test instead of hanging it.
    return subprocess.run(
        [support.CONSOLE_SCRIPT, "evaluate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_evaluate_skips_and_counts_hostile_files_as_ingest_does(grey_model, tmp_path):
    root = str(tmp_path / "raw")
    good = _hostile_folder(root)
    done = _evaluate(
        "--model",
        grey_model,
        "--data",
        root,
        "--max-bad-fraction=1",
        "--bootstrap-resamples=5",
        "--json",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["bad_by_reason"] == HOSTILE_REASONS
    assert result["images"] == good and result["identities"] == 3

    # The same share of bad files fails under the default limit, as in ingest: one line.
    line, _ = support.run_refused("evaluate", "--model", grey_model, "--data", root, timeout=300)
    assert "inputs are bad" in line and "> --max-bad-fraction 1.0%" in line
    assert "unreadable_file=4" in line


@pytest.mark.slow
def test_evaluate_checks_records_as_ingest_does(grey_model, tmp_path):
    # Canonical TFRecords with an empty and a corrupt image: counted, not a TF traceback.
    path = str(tmp_path / "records.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for identity, image in (("a", _grey_png(0)), ("a", _grey_png(1)), ("b", _grey_png(2))):
            writer.write(schema.serialize(schema.CanonicalRecord("u", identity, image)))
        writer.write(schema.serialize(schema.CanonicalRecord("u", "b", b"\x89PNG\r\n\x1a\nbroken")))
        writer.write(schema.serialize(schema.CanonicalRecord("u", "b", _cmyk_jpeg())))
    line, _ = support.run_refused("evaluate", "--model", grey_model, "--data", path, timeout=300)
    assert "1 of 5 inputs are bad" in line and "corrupt_image=1" in line
    done = _evaluate(
        "--model", grey_model, "--data", path, "--max-bad-fraction=0.5", "--bootstrap-resamples=5"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 images of 2 identities" in done.stdout
    assert "skipped 1 bad images: corrupt_image=1" in done.stdout


def test_a_fifo_given_as_records_is_refused_unread(tmp_path):
    fifo = str(tmp_path / "held-out.tfrecord")
    os.mkfifo(fifo)  # reading it would block for ever
    with pytest.raises(ValueError, match="held-out.tfrecord is not a regular file"):
        evaluation.embed_held_out({}, fifo)


# The serving signature decodes every image ingest accepts.

_RNG = np.random.default_rng(5)
_COLOUR = _RNG.integers(0, 256, (12, 9, 3), dtype=np.uint8)
ACCEPTED_IMAGES = {
    "CMYK JPEG": (Image.fromarray(_COLOUR).convert("CMYK"), "JPEG"),
    "grey JPEG": (Image.fromarray(_COLOUR[..., 0]), "JPEG"),
    "RGB JPEG": (Image.fromarray(_COLOUR), "JPEG"),
    "RGBA PNG": (Image.fromarray(_RNG.integers(0, 256, (12, 9, 4), dtype=np.uint8)), "PNG"),
    "palette PNG": (Image.fromarray(_COLOUR).convert("P"), "PNG"),
    "16-bit PNG": (Image.fromarray(_RNG.integers(0, 65536, (12, 9)).astype(np.uint16)), "PNG"),
}


@pytest.mark.parametrize("kind", sorted(ACCEPTED_IMAGES))
@pytest.mark.parametrize("channels", [1, 3])
def test_every_accepted_image_decodes_for_the_model(kind, channels):
    image, image_format = ACCEPTED_IMAGES[kind]
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    encoded = buffer.getvalue()
    schema.validate(schema.CanonicalRecord("u", "i", encoded))
    decoded = export.decode_image(tf.constant(encoded), (12, 9, channels))
    assert decoded.shape == (12, 9, channels)


@pytest.mark.slow
def test_the_served_model_embeds_a_cmyk_jpeg_as_its_grey_luma(grey_model):
    encoded = _cmyk_jpeg()
    serve = tf.saved_model.load(grey_model).signatures[export.SIGNATURE]
    served = serve(images=tf.constant([encoded]))[export.OUTPUT_KEY].numpy()
    # The defined conversion: JPEG's CMYK to RGB, then luma.
    grey = tf.image.rgb_to_grayscale(tf.io.decode_jpeg(encoded, channels=3))
    pixels = tf.image.resize(tf.image.convert_image_dtype(grey, tf.float32), (28, 28))
    backbone = models.load_pretrained_backbone(GREY_BACKBONE, grey_model)
    np.testing.assert_allclose(served, models.embed(backbone, pixels[tf.newaxis]), atol=1e-5)

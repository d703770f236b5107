"""Dedup: exact and near copies of evaluation images never survive in training."""

import io
import os

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from PIL import Image

from beam_jobs import dedup, records_io, schema, synthetic

_CONFIG = synthetic.SyntheticConfig(identities=60, images_per_identity=1, seed=21)
_EVAL = range(0, 30)
_TRAIN = range(30, 60)


def _jpeg(pixels: np.ndarray, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _shift(pixels: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """A shifted copy: content moves by (dx, dy), the uncovered border is black."""
    shifted = np.zeros_like(pixels)
    h, w = pixels.shape
    shifted[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = pixels[
        max(-dy, 0) : h - max(dy, 0), max(-dx, 0) : w - max(dx, 0)
    ]
    return shifted


def _png_other_compression(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


# name -> (transformation of the evaluation pixels to an encoded copy, kind expected)
_COPIES = {
    "png": (_png_other_compression, dedup.EXACT),
    "jpeg": (lambda p: _jpeg(p, 60), dedup.NEAR),
    "shift": (lambda p: schema.encode_png(_shift(p, 2, -1)), dedup.NEAR),
    "shift_jpeg": (lambda p: _jpeg(_shift(p, -1, 2), 75), dedup.NEAR),
}


def _record(user: str, identity: str, image: bytes) -> bytes:
    return schema.serialize(schema.CanonicalRecord(user, identity, image))


def _evaluation_records() -> list[bytes]:
    return [
        _record(
            f"eval_u{i}", f"eval_id{i}", schema.encode_png(synthetic.render_image(_CONFIG, i, 0))
        )
        for i in _EVAL
    ]


def _training_records() -> list[bytes]:
    originals = [
        _record(
            f"train_u{i}", f"train_id{i}", schema.encode_png(synthetic.render_image(_CONFIG, i, 0))
        )
        for i in _TRAIN
    ]
    copies = [
        _record(f"copier_u{i}", f"copier_id{i}_{name}", make(synthetic.render_image(_CONFIG, i, 0)))
        for i in _EVAL
        for name, (make, _) in _COPIES.items()
    ]
    assert (
        schema.decode_image(schema.parse(copies[0]).image).tolist()
        == synthetic.render_image(_CONFIG, 0, 0).tolist()
    )
    return originals + copies


def test_copies_of_evaluation_images_are_removed_and_nothing_else():
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        result = {
            "candidates": pipeline | "Train" >> beam.Create(_training_records()),
            "reference": pipeline | "Eval" >> beam.Create(_evaluation_records()),
        } | dedup.RemoveNearDuplicates(dedup.DedupConfig(), "train_vs_evaluation")
        kept_users = result["kept"] | "KeptUsers" >> beam.Map(lambda s: schema.parse(s).user_id)
        # Recall 1.0 on every kind of copy, and no unrelated training image removed.
        assert_that(kept_users, equal_to([f"train_u{i}" for i in _TRAIN]), label="Kept")
        removed_kinds = result["removed"] | "Kinds" >> beam.Map(
            lambda p: (
                p["candidate"]["identity"].split("_", 2)[2],
                p["kind"],
                p["reference"]["user_id"],
            )
        )
        expected = [
            (name, kind, f"eval_u{i}") for i in _EVAL for name, (_, kind) in _COPIES.items()
        ]
        assert_that(removed_kinds, equal_to(expected), label="Removed")
        counts = result["report"] | beam.Map(
            lambda r: (r["removed_exact"], r["removed_near"], r["kept"], len(r["examples"]))
        )
        assert_that(counts, equal_to([(30, 90, 30, 20)]), label="Report")


def _write(directory: str, records: list[bytes]) -> None:
    with beam.Pipeline(options=records_io.pipeline_options()) as pipeline:
        _ = pipeline | beam.Create(records) | records_io.WriteRecords(directory)


def _read(directory: str) -> list[bytes]:
    return [
        r.numpy()
        for r in tf.data.TFRecordDataset(tf.io.gfile.glob(records_io.records_pattern(directory)))
    ]


def test_run_dedup_keeps_evaluation_splits_and_writes_report(tmp_path):
    evaluation = _evaluation_records()
    training = _training_records()[:40]  # 30 originals + 10 copies of the first evaluation images
    split_dir = str(tmp_path / "split")
    for name, records in (
        ("train", training),
        ("validation", evaluation[:15]),
        ("test", evaluation[15:]),
    ):
        _write(os.path.join(split_dir, name), records)
    out = str(tmp_path / "dedup")
    report = dedup.run_dedup(split_dir, out, dedup.DedupConfig())
    assert sorted(_read(os.path.join(out, "validation"))) == sorted(evaluation[:15])
    assert sorted(_read(os.path.join(out, "test"))) == sorted(evaluation[15:])
    assert sorted(_read(os.path.join(out, "train"))) == sorted(training[:30])
    section = records_io.read_json(os.path.join(out, dedup.REPORT_FILE))["train_vs_evaluation"]
    assert section == report["train_vs_evaluation"]
    assert (section["removed_exact"], section["removed_near"], section["kept"]) == (3, 7, 30)
    assert section["thresholds"]["hamming_threshold"] == 8
    assert {"candidate", "reference", "kind", "hamming_distance"} <= set(section["examples"][0])


def test_user_overlap_between_splits_is_an_error(tmp_path):
    evaluation = _evaluation_records()
    leaked = _record(
        "eval_u3", "train_id_new", schema.encode_png(np.zeros((28, 28), dtype=np.uint8))
    )
    split_dir = str(tmp_path / "split")
    for name, records in (
        ("train", [leaked]),
        ("validation", evaluation[:2]),
        ("test", evaluation[2:5]),
    ):
        _write(os.path.join(split_dir, name), records)
    with pytest.raises(ValueError, match=r"user ids appear on both sides \(e.g. user 'eval_u3'\)"):
        dedup.run_dedup(split_dir, str(tmp_path / "out"), dedup.DedupConfig())


def test_shifted_copies_are_found_when_the_candidate_side_is_probed():
    # Fewer candidates than references: the candidates are hashed at every offset instead,
    # and a copy shifted by d must still meet its original (probing it at -d).
    unrelated = synthetic.SyntheticConfig(identities=200, images_per_identity=1, seed=5)
    padding = [
        _record(
            f"pad_u{i}", f"pad_id{i}", schema.encode_png(synthetic.render_image(unrelated, i, 0))
        )
        for i in range(200)
    ]
    copies = [
        _record(f"copier_u{i}", f"copier_id{i}", schema.encode_png(_shift(pixels, dx, dy)))
        for i, (dx, dy) in zip(_EVAL, [(2, -1), (-2, 2), (1, 0), (0, -2)] * 8)
        for pixels in [synthetic.render_image(_CONFIG, i, 0)]
    ]
    with TestPipeline(options=records_io.pipeline_options()) as pipeline:
        result = {
            "candidates": pipeline | "Train" >> beam.Create(copies),
            "reference": pipeline | "Eval" >> beam.Create(_evaluation_records() + padding),
        } | dedup.RemoveNearDuplicates(dedup.DedupConfig(), "public_vs_private")
        assert_that(result["kept"], equal_to([]), label="NoneKept")
        pairs = result["removed"] | beam.Map(
            lambda p: (p["candidate"]["user_id"], p["reference"]["user_id"], p["kind"])
        )
        assert_that(
            pairs,
            equal_to([(f"copier_u{i}", f"eval_u{i}", dedup.NEAR) for i in _EVAL]),
            label="Pairs",
        )

"""Held-out evaluation: record reading, a SavedModel scored as training scored it, and
genuine pairs across users in split mode held_out_images."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import schema, split_protocols, synthetic
from tests import support
from tff_algorithms.evaluation import metrics
from tff_algorithms.evaluation import scoring as evaluation
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import export, models

SYNTH = support.TRAIN_CLI_DATA
HELD_OUT_IDENTITIES = SYNTH.identities - support.SMALL_JOB_TRAIN_IDENTITIES


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, support.SMALL_JOB_TRAIN_IDENTITIES
    )


@pytest.fixture(scope="module")
def trained(tff_runtime, data, tmp_path_factory):
    config = dataclasses.replace(support.SMALL_JOB, rounds=1)
    return train_job.run_train_job(config, *data, str(tmp_path_factory.mktemp("trained")))


def test_serving_evaluation_matches_training_evaluation(trained, data):
    result = evaluation.evaluate_saved_model(trained.saved_model_dir, data[1])
    assert result["images"] == HELD_OUT_IDENTITIES * SYNTH.images_per_identity
    assert result["identities"] == HELD_OUT_IDENTITIES
    for far, recall in trained.recall_at_far.items():
        assert result["recall_at_far"][far] == pytest.approx(recall, abs=1e-6)
    assert len(result["roc"]["far"]) == len(result["roc"]["recall"])


def test_training_evaluation_decoded_once_scores_what_it_scores_streamed(
    trained, data, monkeypatch
):
    weights = models.backbone_weights(
        models.load_pretrained_backbone(support.SMALL_JOB.backbone_config, trained.saved_model_dir)
    )
    kept = evaluation.HeldOutEvaluator(support.SMALL_JOB.backbone_config, data[1])
    monkeypatch.setattr(export, "DECODED_IN_MEMORY_BYTES", 0)
    streamed = evaluation.HeldOutEvaluator(support.SMALL_JOB.backbone_config, data[1])
    assert isinstance(kept._batches, list) and not isinstance(streamed._batches, list)
    np.testing.assert_array_equal(kept.embeddings(weights), streamed.embeddings(weights))
    assert kept(weights) == streamed(weights)


def test_a_model_compared_with_itself_differs_by_nothing(trained, data):
    models = {"a": trained.saved_model_dir, "b": trained.saved_model_dir}
    results = evaluation.compare_saved_models(models, data[1], num_resamples=20)
    assert results["a"]["recall_at_far"] == results["b"]["recall_at_far"]
    for far, versus in results["a"]["versus"]["b"].items():
        assert versus["difference"] == 0.0, far
        assert versus["interval"] == [0.0, 0.0], far


def test_records_that_are_not_there_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no TFRecord files found"):
        evaluation.record_files(str(tmp_path / "missing-*"))
    with pytest.raises(ValueError, match="neither canonical TFRecords nor"):
        evaluation.embed_held_out({}, str(tmp_path))


def test_a_model_that_cannot_decode_an_accepted_image_is_one_line_naming_it(tmp_path):
    """A SavedModel from elsewhere (or an older export) whose signature decodes to one
    channel without converting CMYK fails on a CMYK JPEG that the input checks accept."""
    import io

    from PIL import Image

    class OneChannel(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name=export.INPUT_KEY)])
        def serve(self, images):
            def one(image):
                pixels = tf.io.decode_jpeg(image, channels=1)
                return tf.reduce_mean(tf.cast(pixels, tf.float32), axis=[0, 1])

            return {export.OUTPUT_KEY: tf.map_fn(one, images, fn_output_signature=tf.float32)}

    model = OneChannel()
    model_dir = str(tmp_path / "model")
    tf.saved_model.save(model, model_dir, signatures={export.SIGNATURE: model.serve})
    for user, mode in (("u0", "RGB"), ("u1", "RGB"), ("u2", "CMYK")):
        folder = tmp_path / "data" / user / f"id_{user}"
        folder.mkdir(parents=True)
        for n in range(2):
            image = Image.new("RGB", (16, 16), (40 * n, 90, 200)).convert(mode)
            encoded = io.BytesIO()
            image.save(encoded, format="JPEG")
            (folder / f"{n}.jpg").write_bytes(encoded.getvalue())
    with pytest.raises(ValueError, match="cannot embed an image that passed the input") as e:
        evaluation.embed_held_out({"model": model_dir}, str(tmp_path / "data"))
    assert "user 'u2'" in str(e.value) and "\n" not in str(e.value)
    assert os.path.isdir(model_dir)


def _held_out_shared_by_three_users(directory) -> str:
    """The held-out records with each identity's six images taken by three users (two
    each): 8 identities x (15 pairs - 3 one-user pairs) = 96 genuine pairs across users."""
    records = synthetic.records_for_identities(
        SYNTH, support.SMALL_JOB_TRAIN_IDENTITIES, SYNTH.identities
    )
    path = os.path.join(directory, "shared.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for index, record in enumerate(records):
            user = f"photographer-{index % SYNTH.images_per_identity // 2}"
            writer.write(schema.serialize(dataclasses.replace(record, user_id=user)))
    return str(directory)


def test_held_out_images_counts_genuine_pairs_across_users_only(trained, tmp_path):
    records = _held_out_shared_by_three_users(tmp_path)
    labels, embeddings = evaluation.embed_saved_model(trained.saved_model_dir, records)
    users = [f"photographer-{i % SYNTH.images_per_identity // 2}" for i in range(len(labels))]
    expected = metrics.recall_at_far(embeddings, labels, users=users)
    every_pair = evaluation.evaluate_saved_model(trained.saved_model_dir, records)
    assert every_pair["genuine_pairs"] == HELD_OUT_IDENTITIES * 15
    results = evaluation.compare_saved_models(
        {"a": trained.saved_model_dir},
        records,
        num_resamples=20,
        split_mode=split_protocols.HELD_OUT_IMAGES,
    )
    across = results["a"]
    assert across["genuine_pairs_across_users_only"]
    assert across["genuine_pairs"] == HELD_OUT_IDENTITIES * 12 == expected.num_genuine_pairs
    assert across["impostor_pairs"] == every_pair["impostor_pairs"]
    assert across["recall_at_far"] == pytest.approx(expected.as_json_dict())
    # Training's evaluator on the same records and mode scores what serving scores.
    evaluator = evaluation.HeldOutEvaluator(
        support.SMALL_JOB.backbone_config, records, split_protocols.HELD_OUT_IMAGES
    )
    weights = models.backbone_weights(
        models.load_pretrained_backbone(support.SMALL_JOB.backbone_config, trained.saved_model_dir)
    )
    assert evaluator(weights)["recall_at_far"] == pytest.approx(expected.as_json_dict(), abs=1e-6)


def test_held_out_images_without_two_users_of_an_identity_says_so(trained, data):
    # The synthetic held-out records have one user per identity: no pair across users.
    with pytest.raises(ValueError, match="no genuine pairs across users"):
        evaluation.evaluate_saved_model(
            trained.saved_model_dir, data[1], split_mode=split_protocols.HELD_OUT_IMAGES
        )

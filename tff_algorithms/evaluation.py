"""Held-out evaluation: reading canonical records and scoring backbones and SavedModels.

Record reading (`record_files`, `encoded_images`) and exact recall@FAR of backbone
weights during training (`HeldOutEvaluator`) or of an exported serving SavedModel
(`evaluate_saved_model`, `compare_saved_models` with bootstrap intervals). The
pipeline's evaluation component and `dp-fedemb evaluate` import this module without
importing the training job (`train_job`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import schema
from tff_algorithms import export, metrics, model_config, models

_EMBED_BATCH = 256


def record_files(records: str) -> list[str]:
    """TFRecord files of `records`: a directory (records-*, or files named *tfrecord*) or a glob."""
    if tf.io.gfile.isdir(records):
        files = tf.io.gfile.glob(os.path.join(records, "records-*"))
        if not files:
            files = [
                os.path.join(records, name)
                for name in tf.io.gfile.listdir(records)
                if "tfrecord" in name and not tf.io.gfile.isdir(os.path.join(records, name))
            ]
    else:
        files = tf.io.gfile.glob(records)
    if not files:
        raise ValueError(f"no TFRecord files found at {records}")
    return sorted(files)


def _image_folder_files(root: str) -> list[tuple[str, str]]:
    """(identity, path) of ROOT/<user>/<identity>/<image> files."""
    pattern = os.path.join(root, "*", "*", "*")
    return sorted(
        (path.split(os.sep)[-2], path)
        for path in tf.io.gfile.glob(pattern)
        if path.lower().endswith((".png", ".jpg", ".jpeg"))
    )


def encoded_images(records: str) -> tf.data.Dataset:
    """(identity, encoded image) pairs from canonical TFRecords or an image folder."""
    if tf.io.gfile.isdir(records) and not tf.io.gfile.glob(os.path.join(records, "*tfrecord*")):
        files = _image_folder_files(records)
        if not files:
            raise ValueError(
                f"{records} holds neither TFRecords nor ROOT/user/identity/image files"
            )
        identities, paths = zip(*files)
        return tf.data.Dataset.from_tensor_slices((list(identities), list(paths))).map(
            lambda identity, path: (identity, tf.io.read_file(path))
        )
    files = record_files(records)
    compression = "GZIP" if files[0].endswith(".gz") else ""
    parsed = tf.data.TFRecordDataset(files, compression_type=compression).map(
        lambda s: tf.io.parse_single_example(s, schema.FEATURE_SPEC)
    )
    return parsed.map(lambda f: (f[schema.IDENTITY_KEY], f[schema.IMAGE_KEY]))


def _identities(records: str) -> np.ndarray:
    labels = np.array(
        [
            identity
            for identity, _ in encoded_images(records).map(lambda i, _: (i, 0)).as_numpy_iterator()
        ]
    )
    if len(labels) < 2 or len(np.unique(labels)) < 2:
        raise ValueError(
            f"evaluation needs at least two identities with images, {records} has fewer"
        )
    return labels


class HeldOutEvaluator:
    """Exact recall@FAR of backbone weights on held-out records, streamed in batches.

    The Keras backbone is built per call: building TFF computations creates Keras
    models in graph mode, which invalidates eager Keras models made before them.
    """

    def __init__(self, backbone_config: model_config.BackboneConfig, records: str) -> None:
        self.records = records
        self.labels = _identities(records)
        self._backbone_config = backbone_config
        self._images = encoded_images(records).map(
            lambda _, encoded: export.decode_image(encoded, backbone_config.image_shape)
        )

    def embeddings(self, weights: tff.learning.models.ModelWeights) -> np.ndarray:
        backbone = models.build_backbone(self._backbone_config)
        models.assign_backbone_weights(backbone, weights)
        return np.concatenate(
            [models.embed(backbone, batch).numpy() for batch in self._images.batch(_EMBED_BATCH)]
        )

    def __call__(self, weights: tff.learning.models.ModelWeights) -> dict[str, Any]:
        result = metrics.recall_at_far(self.embeddings(weights), self.labels)
        return {"recall_at_far": result.as_json_dict()}


def embed_saved_model(model_dir: str, records: str) -> tuple[np.ndarray, np.ndarray]:
    """(identity labels, embeddings) of every image in `records`, in reading order.

    `records`: canonical TFRecords (directory or glob) or an image folder. Images go
    through the model's own preprocessing (encoded bytes in).
    """
    if not tf.io.gfile.exists(os.path.join(model_dir, "saved_model.pb")):
        raise ValueError(f"{model_dir} is not a SavedModel (no saved_model.pb)")
    serve = tf.saved_model.load(model_dir).signatures[export.SIGNATURE]
    pairs = encoded_images(records).batch(_EMBED_BATCH)
    labels, embeddings = [], []
    for identity, encoded in pairs:
        labels.append(identity.numpy())
        embeddings.append(serve(**{export.INPUT_KEY: encoded})[export.OUTPUT_KEY].numpy())
    if not labels:
        raise ValueError(f"no images in {records}")
    return np.concatenate(labels), np.concatenate(embeddings)


def _verification(
    model_dir: str, records: str, labels: np.ndarray, embeddings: np.ndarray
) -> dict[str, Any]:
    result = metrics.recall_at_far(embeddings, labels)
    far_grid, recall_grid = metrics.roc_curve(embeddings, labels)
    return {
        "model": model_dir,
        "records": records,
        "images": int(len(labels)),
        "identities": int(len(np.unique(labels))),
        "recall_at_far": result.as_json_dict(),
        "thresholds": {format(k, "g"): v for k, v in result.threshold.items()},
        "genuine_pairs": result.num_genuine_pairs,
        "impostor_pairs": result.num_impostor_pairs,
        "roc": {"far": far_grid.tolist(), "recall": recall_grid.tolist()},
    }


def evaluate_saved_model(model_dir: str, records: str) -> dict[str, Any]:
    """Exact all-pairs recall@FAR and ROC points of a serving SavedModel on `records`."""
    return _verification(model_dir, records, *embed_saved_model(model_dir, records))


def compare_saved_models(
    model_dirs: dict[str, str],
    records: str,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """`evaluate_saved_model` of each model, with bootstrap intervals, on the same images.

    Each result gains "recall_at_far_interval" {far: [low, high]}: the percentile
    interval over identity resamples (metrics.bootstrap_recall_at_far). The first model
    also gains "versus" {other model: {far: {"difference", "interval"}}}: its recall minus
    the other's, with the interval of the PAIRED bootstrap (both scored on each resample),
    which is much narrower than the two separate intervals suggest.
    """
    embedded = {name: embed_saved_model(path, records) for name, path in model_dirs.items()}
    labels = next(iter(embedded.values()))[0]
    for name, (other_labels, _) in embedded.items():
        if not np.array_equal(other_labels, labels):
            raise ValueError(f"model {name!r} read {records} in another order")
    samples = metrics.bootstrap_recall_at_far(
        {name: e for name, (_, e) in embedded.items()},
        labels,
        metrics.DEFAULT_FARS,
        num_resamples,
        seed,
    )
    keys = [format(far, "g") for far in metrics.DEFAULT_FARS]
    results = {}
    for name, (_, embeddings) in embedded.items():
        results[name] = _verification(model_dirs[name], records, labels, embeddings)
        results[name]["recall_at_far_interval"] = {
            key: list(metrics.percentile_interval(samples[name][:, f], confidence))
            for f, key in enumerate(keys)
        }
    first, *others = list(embedded)
    results[first]["versus"] = {
        other: {
            key: {
                "difference": results[first]["recall_at_far"][key]
                - results[other]["recall_at_far"][key],
                "interval": list(
                    metrics.percentile_interval(
                        samples[first][:, f] - samples[other][:, f], confidence
                    )
                ),
            }
            for f, key in enumerate(keys)
        }
        for other in others
    }
    return results

"""Held-out evaluation: reading canonical records and scoring backbones and SavedModels.

Record reading (`record_files`, `encoded_images`) and exact recall@FAR of backbone
weights during training (`HeldOutEvaluator`) or of an exported serving SavedModel
(`evaluate_saved_model`, `compare_saved_models` with bootstrap intervals). The
pipeline's evaluation component and `dp-fedemb evaluate` import this module without
importing the training job (`train_job`).

`split_mode` (beam_jobs.splits.MODES) is the protocol the records were split by: in mode
held_out_images a genuine pair joins images of two different users (`metrics`, genuine
pairs across users); in the other modes every same-identity pair is genuine.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import schema, splits
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


def _image_folder_files(root: str) -> list[tuple[str, str, str]]:
    """(user, identity, path) of ROOT/<user>/<identity>/<image> files."""
    pattern = os.path.join(root, "*", "*", "*")
    return sorted(
        (*path.split(os.sep)[-3:-1], path)
        for path in tf.io.gfile.glob(pattern)
        if path.lower().endswith((".png", ".jpg", ".jpeg"))
    )


def user_encoded_images(records: str) -> tf.data.Dataset:
    """(user, identity, encoded image) from canonical TFRecords or an image folder."""
    if tf.io.gfile.isdir(records) and not tf.io.gfile.glob(os.path.join(records, "*tfrecord*")):
        files = _image_folder_files(records)
        if not files:
            raise ValueError(
                f"{records} holds neither TFRecords nor ROOT/user/identity/image files"
            )
        users, identities, paths = (list(column) for column in zip(*files))
        return tf.data.Dataset.from_tensor_slices((users, identities, paths)).map(
            lambda user, identity, path: (user, identity, tf.io.read_file(path))
        )
    files = record_files(records)
    compression = "GZIP" if files[0].endswith(".gz") else ""
    parsed = tf.data.TFRecordDataset(files, compression_type=compression).map(
        lambda s: tf.io.parse_single_example(s, schema.FEATURE_SPEC)
    )
    return parsed.map(
        lambda f: (f[schema.USER_ID_KEY], f[schema.IDENTITY_KEY], f[schema.IMAGE_KEY])
    )


def encoded_images(records: str) -> tf.data.Dataset:
    """(identity, encoded image) pairs from canonical TFRecords or an image folder."""
    return user_encoded_images(records).map(lambda _, identity, image: (identity, image))


def genuine_across_users(split_mode: str) -> bool:
    """Whether genuine pairs must join two users under `split_mode` (module docstring)."""
    if split_mode not in splits.MODES:
        raise ValueError(f"split mode must be one of {splits.MODES}, got {split_mode!r}")
    return split_mode == splits.HELD_OUT_IMAGES


def _users_and_identities(records: str) -> tuple[np.ndarray, np.ndarray]:
    names = user_encoded_images(records).map(lambda user, identity, _: (user, identity))
    pairs = list(names.as_numpy_iterator())
    users = np.array([user for user, _ in pairs])
    labels = np.array([identity for _, identity in pairs])
    if len(labels) < 2 or len(np.unique(labels)) < 2:
        raise ValueError(
            f"evaluation needs at least two identities with images, {records} has fewer"
        )
    return users, labels


class HeldOutEvaluator:
    """Exact recall@FAR of backbone weights on held-out records, streamed in batches.

    The Keras backbone is built per call: building TFF computations creates Keras
    models in graph mode, which invalidates eager Keras models made before them.
    """

    def __init__(
        self,
        backbone_config: model_config.BackboneConfig,
        records: str,
        split_mode: str = splits.IDENTITY_AND_USER,
    ) -> None:
        self.records = records
        users, self.labels = _users_and_identities(records)
        # Each image's user where genuine pairs must join two users (mode held_out_images,
        # module docstring), else None: `metrics.recall_at_far`'s `users`.
        self.pair_users = users if genuine_across_users(split_mode) else None
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
        result = metrics.recall_at_far(self.embeddings(weights), self.labels, users=self.pair_users)
        return {"recall_at_far": result.as_json_dict()}


def _embed_users(model_dir: str, records: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(users, identity labels, embeddings) of every image in `records`, in reading order."""
    if not tf.io.gfile.exists(os.path.join(model_dir, "saved_model.pb")):
        raise ValueError(f"{model_dir} is not a SavedModel (no saved_model.pb)")
    serve = tf.saved_model.load(model_dir).signatures[export.SIGNATURE]
    users, labels, embeddings = [], [], []
    for user, identity, encoded in user_encoded_images(records).batch(_EMBED_BATCH):
        users.append(user.numpy())
        labels.append(identity.numpy())
        embeddings.append(serve(**{export.INPUT_KEY: encoded})[export.OUTPUT_KEY].numpy())
    if not labels:
        raise ValueError(f"no images in {records}")
    return np.concatenate(users), np.concatenate(labels), np.concatenate(embeddings)


def embed_saved_model(model_dir: str, records: str) -> tuple[np.ndarray, np.ndarray]:
    """(identity labels, embeddings) of every image in `records`, in reading order.

    `records`: canonical TFRecords (directory or glob) or an image folder. Images go
    through the model's own preprocessing (encoded bytes in).
    """
    return _embed_users(model_dir, records)[1:]


def _verification(
    model_dir: str,
    records: str,
    labels: np.ndarray,
    embeddings: np.ndarray,
    users: np.ndarray | None,
) -> dict[str, Any]:
    result = metrics.recall_at_far(embeddings, labels, users=users)
    far_grid, recall_grid = metrics.roc_curve(embeddings, labels, users=users)
    return {
        "model": model_dir,
        "records": records,
        "images": int(len(labels)),
        "identities": int(len(np.unique(labels))),
        "genuine_pairs_across_users_only": users is not None,
        "recall_at_far": result.as_json_dict(),
        "thresholds": {format(k, "g"): v for k, v in result.threshold.items()},
        "genuine_pairs": result.num_genuine_pairs,
        "impostor_pairs": result.num_impostor_pairs,
        "roc": {"far": far_grid.tolist(), "recall": recall_grid.tolist()},
    }


def evaluate_saved_model(
    model_dir: str, records: str, split_mode: str = splits.IDENTITY_AND_USER
) -> dict[str, Any]:
    """Exact all-pairs recall@FAR and ROC points of a serving SavedModel on `records`."""
    across_users = genuine_across_users(split_mode)
    users, labels, embeddings = _embed_users(model_dir, records)
    return _verification(model_dir, records, labels, embeddings, users if across_users else None)


def compare_saved_models(
    model_dirs: dict[str, str],
    records: str,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    split_mode: str = splits.IDENTITY_AND_USER,
) -> dict[str, dict[str, Any]]:
    """`evaluate_saved_model` of each model, with bootstrap intervals, on the same images.

    Each result gains "recall_at_far_interval" {far: [low, high]}: the percentile
    interval over identity resamples (metrics.bootstrap_recall_at_far). The first model
    also gains "versus" {other model: {far: {"difference", "interval"}}}: its recall minus
    the other's, with the interval of the PAIRED bootstrap (both scored on each resample),
    which is much narrower than the two separate intervals suggest.
    """
    across_users = genuine_across_users(split_mode)
    embedded = {name: _embed_users(path, records) for name, path in model_dirs.items()}
    users, labels, _ = next(iter(embedded.values()))
    for name, (other_users, other_labels, _) in embedded.items():
        if not (np.array_equal(other_labels, labels) and np.array_equal(other_users, users)):
            raise ValueError(f"model {name!r} read {records} in another order")
    pair_users = users if across_users else None
    samples = metrics.bootstrap_recall_at_far(
        {name: e for name, (_, _, e) in embedded.items()},
        labels,
        metrics.DEFAULT_FARS,
        num_resamples,
        seed,
        users=pair_users,
    )
    keys = [format(far, "g") for far in metrics.DEFAULT_FARS]
    results = {}
    for name, (_, _, embeddings) in embedded.items():
        results[name] = _verification(model_dirs[name], records, labels, embeddings, pair_users)
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

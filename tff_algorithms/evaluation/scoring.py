"""Held-out evaluation: reading canonical records and scoring backbones and SavedModels.

Record reading (`record_files`, `encoded_images` for ingested records, `held_out_images`
for any evaluation data, checked as ingest checks it) and exact recall@FAR of backbone
weights during training (`HeldOutEvaluator`) or of an exported serving SavedModel
(`evaluate_saved_model`, `compare_saved_models` with bootstrap intervals; bad images
are skipped and counted, and fail the evaluation over a maximum share, as in ingest). The
pipeline's evaluation component and `dp-fedemb evaluate` import this module without
importing the training job (`train_job`).

`split_mode` (beam_jobs.split_protocols.MODES) is the protocol the records were split by: in mode
held_out_images a genuine pair joins images of two different users (`metrics`, genuine
pairs across users); in the other modes every same-identity pair is genuine.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import stat
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import image_files, schema, split_protocols
from tff_algorithms.config import model_config
from tff_algorithms.evaluation import metrics
from tff_algorithms.modeling import export, models

_EMBED_BATCH = 256
# As ingest's default (`data.max_bad_fraction`).
DEFAULT_MAX_BAD_FRACTION = 0.01
_BAD_EXAMPLES = 10


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


def user_encoded_images(records: str) -> tf.data.Dataset:
    """(user, identity, encoded image) of canonical TFRecords (`record_files`), unchecked:
    for records ingest wrote. Other data goes through `held_out_images`."""
    files = record_files(records)
    compression = "GZIP" if files[0].endswith(".gz") else ""
    parsed = tf.data.TFRecordDataset(files, compression_type=compression).map(
        lambda s: tf.io.parse_single_example(s, schema.FEATURE_SPEC)
    )
    return parsed.map(
        lambda f: (f[schema.USER_ID_KEY], f[schema.IDENTITY_KEY], f[schema.IMAGE_KEY])
    )


def encoded_images(records: str) -> tf.data.Dataset:
    """(identity, encoded image) pairs of canonical TFRecords (`user_encoded_images`)."""
    return user_encoded_images(records).map(lambda _, identity, image: (identity, image))


def genuine_across_users(split_mode: str) -> bool:
    """Whether genuine pairs must join two users under `split_mode` (module docstring)."""
    if split_mode not in split_protocols.MODES:
        raise ValueError(f"split mode must be one of {split_protocols.MODES}, got {split_mode!r}")
    return split_mode == split_protocols.HELD_OUT_IMAGES


def _is_image_folder(records: str) -> bool:
    return tf.io.gfile.isdir(records) and not tf.io.gfile.glob(os.path.join(records, "*tfrecord*"))


def _record_file_images(
    records: str, max_pixels: int
) -> Iterator[image_files.CheckedImage | image_files.BadInput]:
    for path in record_files(records):
        if "://" not in path and not stat.S_ISREG(os.stat(path).st_mode):
            # A FIFO would block the read for ever, a device never end it.
            raise ValueError(f"{path} is not a regular file")
        compression = "GZIP" if path.endswith(".gz") else ""
        serialized_records = tf.data.TFRecordDataset(path, compression_type=compression)
        try:
            for index, serialized in enumerate(serialized_records.as_numpy_iterator()):
                source = f"{path}#{index}"
                try:
                    record = schema.parse(serialized)
                except schema.RecordError as e:
                    yield image_files.bad_input(e.reason, source, str(e))
                    continue
                yield image_files.check_record(record, source, max_pixels)
        except tf.errors.OpError as e:
            message = e.message.split("}}", 1)[-1].strip().splitlines()[0]
            raise ValueError(f"{path} is not a readable TFRecord file: {message}") from None


def held_out_images(
    records: str, max_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS
) -> Iterator[image_files.CheckedImage | image_files.BadInput]:
    """Each image of canonical TFRecords or of an image folder ROOT/<user>/<identity>/<image>
    as a checked record or a counted BadInput, as ingest checks them: folders are read by
    `beam_jobs.image_files`, records checked by `schema.validate`."""
    if _is_image_folder(records):
        return image_files.read_image_folder(records, max_pixels)
    return _record_file_images(records, max_pixels)


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
    """Exact recall@FAR of backbone weights on held-out records, in batches: decoded once
    and kept in memory when they fit in `export.DECODED_IN_MEMORY_BYTES`, else streamed
    at every call.

    The Keras backbone is built per call: building TFF computations creates Keras
    models in graph mode, which invalidates eager Keras models made before them.
    """

    def __init__(
        self,
        backbone_config: model_config.BackboneConfig,
        records: str,
        split_mode: str = split_protocols.IDENTITY_AND_USER,
    ) -> None:
        self.records = records
        users, self.labels = _users_and_identities(records)
        # Each image's user where genuine pairs must join two users (mode held_out_images,
        # module docstring), else None: `metrics.recall_at_far`'s `users`.
        self.pair_users = users if genuine_across_users(split_mode) else None
        self._backbone_config = backbone_config
        images = (
            encoded_images(records)
            .map(lambda _, encoded: export.decode_image(encoded, backbone_config.image_shape))
            .batch(_EMBED_BATCH)
        )
        self._batches = (
            [batch.numpy() for batch in images]
            if export.decoded_fit_in_memory(len(self.labels), backbone_config.image_shape)
            else images
        )

    def embeddings(self, weights: tff.learning.models.ModelWeights) -> np.ndarray:
        backbone = models.build_backbone(self._backbone_config)
        models.assign_backbone_weights(backbone, weights)
        return np.concatenate([models.embed(backbone, batch).numpy() for batch in self._batches])

    def __call__(self, weights: tff.learning.models.ModelWeights) -> dict[str, Any]:
        result = metrics.recall_at_far(self.embeddings(weights), self.labels, users=self.pair_users)
        return {"recall_at_far": result.as_json_dict()}


@dataclasses.dataclass(frozen=True)
class HeldOutEmbeddings:
    """Every good image's user, identity label and embedding by each model, in reading
    order, and the bad inputs skipped (counted by reason, the first few as examples)."""

    users: np.ndarray
    labels: np.ndarray
    embeddings: dict[str, np.ndarray]
    bad_by_reason: dict[str, int]
    bad_examples: list[image_files.BadInput]


def _serving_function(model_dir: str) -> Callable[..., dict[str, tf.Tensor]]:
    if not tf.io.gfile.exists(os.path.join(model_dir, "saved_model.pb")):
        raise ValueError(f"{model_dir} is not a SavedModel (no saved_model.pb)")
    return tf.saved_model.load(model_dir).signatures[export.SIGNATURE]


def _unservable(
    name: str,
    model_dir: str,
    serve: Callable[..., dict[str, tf.Tensor]],
    records: list[schema.CanonicalRecord],
    error: tf.errors.InvalidArgumentError,
) -> str:
    """One line: which image (of those that passed the input checks) the model refused."""
    for record in records:
        try:
            serve(**{export.INPUT_KEY: tf.constant([record.image])})
        except tf.errors.InvalidArgumentError:
            where = f"user {record.user_id!r}, identity {record.identity!r}"
            break
    else:
        where = "a batch"
    # TF's message: a header, where the op was defined, the reason, the node.
    lines = [line.strip() for line in (error.message or str(error)).splitlines()]
    noise = ("Graph execution error", "Detected at node", "<stack traces", "[[")
    reason = next((line for line in lines if line and not line.startswith(noise)), "")[:200]
    return (
        f"{name} {model_dir} cannot embed an image that passed the input checks "
        f"({where}: {reason}); a model exported by an older version may not decode CMYK "
        "JPEGs: re-export it with this version, or remove the image"
    )


def embed_held_out(
    model_dirs: dict[str, str],
    records: str,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    limit_name: str = "max_bad_fraction",
    max_pixels: int = schema.DEFAULT_MAX_IMAGE_PIXELS,
) -> HeldOutEmbeddings:
    """Embeds the images of `records` (`held_out_images`) with each serving SavedModel,
    reading them once. Images go through the model's own preprocessing (encoded bytes in).

    Bad inputs are skipped and counted; raises ValueError (one line, naming `limit_name`)
    when their share of all inputs is over `max_bad_fraction`, as ingest does.
    """
    serving = {name: _serving_function(path) for name, path in model_dirs.items()}
    users: list[bytes] = []
    labels: list[bytes] = []
    embeddings: dict[str, list[np.ndarray]] = {name: [] for name in serving}
    bad_by_reason: collections.Counter[str] = collections.Counter()
    bad_examples: list[image_files.BadInput] = []
    batch: list[bytes] = []
    batch_records: list[schema.CanonicalRecord] = []

    def embed_batch() -> None:
        for name, serve in serving.items():
            try:
                served = serve(**{export.INPUT_KEY: tf.constant(batch)})[export.OUTPUT_KEY]
            except tf.errors.InvalidArgumentError as e:
                message = _unservable(name, model_dirs[name], serve, batch_records, e)
                raise ValueError(message) from None
            embeddings[name].append(served.numpy())
        batch.clear()
        batch_records.clear()

    for image in held_out_images(records, max_pixels):
        if isinstance(image, image_files.BadInput):
            bad_by_reason[image.reason] += 1
            if len(bad_examples) < _BAD_EXAMPLES:
                bad_examples.append(image)
            continue
        users.append(image.record.user_id.encode("utf-8"))
        labels.append(image.record.identity.encode("utf-8"))
        batch.append(image.record.image)
        batch_records.append(image.record)
        if len(batch) == _EMBED_BATCH:
            embed_batch()
    if batch:
        embed_batch()
    error = image_files.bad_share_error(
        records, len(labels), dict(bad_by_reason), max_bad_fraction, limit_name
    )
    if error:
        raise ValueError(error)
    if not labels:
        raise ValueError(
            f"no images in {records}: it holds neither canonical TFRecords nor "
            "ROOT/user/identity/image files"
        )
    return HeldOutEmbeddings(
        np.array(users, dtype=object),
        np.array(labels, dtype=object),
        {name: np.concatenate(parts) for name, parts in embeddings.items()},
        dict(sorted(bad_by_reason.items())),
        bad_examples,
    )


def embed_saved_model(
    model_dir: str, records: str, max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """(identity labels, embeddings) of every good image in `records`, in reading order
    (`embed_held_out` with one model)."""
    embedded = embed_held_out({"model": model_dir}, records, max_bad_fraction)
    return embedded.labels, embedded.embeddings["model"]


def _verification(
    model_dir: str,
    records: str,
    embedded: HeldOutEmbeddings,
    embeddings: np.ndarray,
    users: np.ndarray | None,
) -> dict[str, Any]:
    labels = embedded.labels
    if len(np.unique(labels)) < 2:
        raise ValueError(
            f"evaluation needs at least two identities with images, {records} has fewer"
        )
    result = metrics.recall_at_far(embeddings, labels, users=users)
    far_grid, recall_grid = metrics.roc_curve(embeddings, labels, users=users)
    return {
        "model": model_dir,
        "records": records,
        "bad": sum(embedded.bad_by_reason.values()),
        "bad_by_reason": embedded.bad_by_reason,
        "bad_examples": [dataclasses.asdict(b) for b in embedded.bad_examples],
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
    model_dir: str,
    records: str,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    split_mode: str = split_protocols.IDENTITY_AND_USER,
) -> dict[str, Any]:
    """Exact all-pairs recall@FAR and ROC points of a serving SavedModel on `records`,
    with the bad inputs skipped ("bad", "bad_by_reason", "bad_examples")."""
    across_users = genuine_across_users(split_mode)
    embedded = embed_held_out({"model": model_dir}, records, max_bad_fraction)
    users = embedded.users if across_users else None
    return _verification(model_dir, records, embedded, embedded.embeddings["model"], users)


def compare_saved_models(
    model_dirs: dict[str, str],
    records: str,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    limit_name: str = "max_bad_fraction",
    split_mode: str = split_protocols.IDENTITY_AND_USER,
) -> dict[str, dict[str, Any]]:
    """`evaluate_saved_model` of each model, with bootstrap intervals, on the same images.

    Each result gains "recall_at_far_interval" {far: [low, high]}: the percentile
    interval over identity resamples (metrics.bootstrap_recall_at_far). The first model
    also gains "versus" {other model: {far: {"difference", "interval"}}}: its recall minus
    the other's, with the interval of the PAIRED bootstrap (both scored on each resample),
    which is much narrower than the two separate intervals suggest. The images are read
    once for all models (`embed_held_out`: bad ones skipped and counted, at most
    `max_bad_fraction` of them, the limit called `limit_name` in the error).
    """
    across_users = genuine_across_users(split_mode)
    embedded = embed_held_out(model_dirs, records, max_bad_fraction, limit_name)
    pair_users = embedded.users if across_users else None
    samples = metrics.bootstrap_recall_at_far(
        embedded.embeddings,
        embedded.labels,
        metrics.DEFAULT_FARS,
        num_resamples,
        seed,
        users=pair_users,
    )
    keys = [format(far, "g") for far in metrics.DEFAULT_FARS]
    results = {}
    for name, embeddings in embedded.embeddings.items():
        results[name] = _verification(model_dirs[name], records, embedded, embeddings, pair_users)
        results[name]["recall_at_far_interval"] = {
            key: list(metrics.percentile_interval(samples[name][:, f], confidence))
            for f, key in enumerate(keys)
        }
    first, *others = list(embedded.embeddings)
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

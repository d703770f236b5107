"""Cached features of a frozen backbone prefix (issue 21).

When training updates only a suffix of the backbone, every local step of every round
re-runs the frozen prefix on the same images and gets the same outputs. This module
finds where the frozen prefix ends, runs it once per training image, and stores its
outputs as a partition of their own, so private training runs the suffix alone.

The cut (`cut_for`) is read from the model, not assumed: it is the input of the first
top-level layer of the backbone that holds a trainable variable, and it applies only
when
- some layer before it holds variables (else there is nothing worth caching: the
  default recipe trains the first convolution, so it never caches);
- Keras can build the suffix as a model of that one tensor (no skip connection
  crosses the cut), and the suffix's trainable variables are the backbone's, the
  same objects in the same order (so process weights, clipping and noise are
  exactly those of the uncached job);
- the first trainable layer is a top-level layer: a backbone whose trainable layers
  start inside a nested trunk (MobileNetV2, ResNet-50 blocks) is not cut inside it.
Training applies no data augmentation; a random augmentation would make cached
features stale, so one added later must refuse the cache.

The cache (`ensure_cache`) is a partition (`beam_jobs.partition`) of the same users,
with the same shard hash, shard count and per-user record order as its source, and its
own byte-range index; each record is a `tf.train.Example` holding `user_id`,
`identity` and `features/raw` (the prefix output, float32 little-endian, shape in
`feature_cache.json`). Virtual-client ids built from it (`client_data`) read features
where they would read images. Its directory name is a key over the prefix's layers and
variable values, the image shape and the source partition's manifest, indexes and part
file bytes, so another pretrained start, another cut or a rebuilt partition never
reuses it. It is built shard by shard into `<key>.partial` (a killed build resumes
from its finished shards) and renamed when complete. The features are derived from private users' images
and are as private as the partition: they live beside the job's outputs, and nothing of
them is exported or released.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import shutil

import numpy as np
import tensorflow as tf
from absl import logging

from beam_jobs import partition, schema
from tff_algorithms.config import model_config
from tff_algorithms.federated import client_data
from tff_algorithms.modeling import export, models

FEATURES_KEY = "features/raw"
CACHE_FILE = "feature_cache.json"
# Bump when the record layout or the key's inputs change.
CACHE_FORMAT = 2
_FEATURE_SPEC = {
    schema.USER_ID_KEY: tf.io.FixedLenFeature([], tf.string),
    schema.IDENTITY_KEY: tf.io.FixedLenFeature([], tf.string),
    FEATURES_KEY: tf.io.FixedLenFeature([], tf.string),
}
_PREFIX_BATCH = 256


@dataclasses.dataclass(frozen=True)
class FeatureCut:
    """Where a backbone is cut: before top-level layer `layer`, whose input has
    `feature_shape` (per example)."""

    layer: str
    feature_shape: tuple[int, ...]

    def split(self, model: tf.keras.Model) -> tuple[tf.keras.Model, tf.keras.Model]:
        """(prefix, suffix) Keras models sharing `model`'s layers and variables:
        images -> features, and features -> embedding.

        The suffix's top-level layers are re-applied in order on a fresh input (Keras
        builds a model from an intermediate tensor only eagerly, and TFF traces the
        suffix in graph mode). The prefix runs only eagerly (the cache is built before
        training): a prefix with branches (residual blocks, as in a keras.applications
        trunk) is the backbone's own graph up to the cut, a plain chain is re-applied.
        `cut_for` checks that either reproduces the backbone.
        """
        layers = model.layers
        first = [layer.name for layer in layers].index(self.layer)
        features = tf.keras.Input(self.feature_shape)
        suffix = _chain(features, layers[first:])
        if tf.executing_eagerly() and _branches(layers[1:first]):
            return tf.keras.Model(model.inputs, layers[first].input), suffix
        return _chain(tf.keras.Input(model.input_shape[1:]), layers[1:first]), suffix

    def suffix(self, model: tf.keras.Model) -> tf.keras.Model:
        return self.split(model)[1]


def _branches(layers: list[tf.keras.layers.Layer]) -> bool:
    """Whether any layer takes more than one input (a merge of branches)."""
    return any(
        isinstance(node.input_tensors, (list, tuple)) and len(node.input_tensors) > 1
        for layer in layers
        for node in layer.inbound_nodes
    )


def _chain(inputs: tf.Tensor, layers: list[tf.keras.layers.Layer]) -> tf.keras.Model:
    outputs = inputs
    for layer in layers:
        outputs = layer(outputs)
    return tf.keras.Model(inputs, outputs)


@dataclasses.dataclass(frozen=True)
class CutDecision:
    """`cut` when the backbone's trained layers are a cacheable suffix, else None and why."""

    cut: FeatureCut | None
    reason: str


def _has_trainable(layer: tf.keras.layers.Layer) -> bool:
    return bool(layer.trainable_weights)


def _decide(model: tf.keras.Model) -> CutDecision:
    layers = model.layers
    first = next((i for i, layer in enumerate(layers) if _has_trainable(layer)), None)
    if first is None:
        return CutDecision(None, "no layer of the backbone trains")
    layer = layers[first]
    if not any(earlier.weights for earlier in layers[:first]):
        if isinstance(layer, tf.keras.Model):
            trained = next(leaf.name for leaf in models.all_layers(layer) if _has_trainable(leaf))
            return CutDecision(
                None,
                f"the first trained layer {trained!r} is inside the nested trunk "
                f"{layer.name!r}; the cache cuts only between the backbone's top-level layers",
            )
        return CutDecision(
            None, f"the first trained layer {layer.name!r} has no frozen layer before it"
        )
    if not isinstance(layers[0], tf.keras.layers.InputLayer):
        return CutDecision(None, f"the backbone {model.name!r} does not start with its input")
    cut = FeatureCut(layer.name, tuple(int(d) for d in layer.input_shape[1:]))
    not_a_chain = CutDecision(
        None, f"the backbone's layers do not run one after another through {layer.name!r}"
    )
    try:
        prefix, suffix = cut.split(model)
    except (ValueError, TypeError):  # a layer that takes more than its predecessor's output
        return not_a_chain
    images = tf.random.stateless_uniform([2, *model.input_shape[1:]], seed=[0, 1])
    if not np.allclose(suffix(prefix(images)), model(images), atol=1e-5):
        return not_a_chain  # a connection around the cut, e.g. a skip
    same = len(suffix.trainable_weights) == len(model.trainable_weights) and all(
        a is b for a, b in zip(suffix.trainable_weights, model.trainable_weights)
    )
    if not same:
        return CutDecision(
            None, f"layers before {layer.name!r} train too: the trained layers are not a suffix"
        )
    return CutDecision(
        cut, f"cached before {layer.name!r}: features of shape {list(cut.feature_shape)}"
    )


@functools.lru_cache(maxsize=32)
def cut_for(config: model_config.BackboneConfig) -> CutDecision:
    """Whether (and where) `config`'s trained layers make a cacheable suffix (module
    docstring). Checked on a throwaway backbone, once per config."""
    return _decide(models.build_backbone(config))


def cache_facts(
    decision: CutDecision, cached: CachedFeatures | None, seconds: float
) -> dict[str, object]:
    """What metrics.json says of a job's cache: used or not and why, the cut, the
    features' shape, the cache key, and the seconds it took to find or build."""
    facts: dict[str, object] = {"used": cached is not None, "reason": decision.reason}
    if cached is not None and decision.cut is not None:
        facts.update(
            cut_before=decision.cut.layer,
            feature_shape=list(cached.feature_shape),
            key=cached.key,
            ready_seconds=round(seconds, 3),
        )
    return facts


def parse_cached_example(
    serialized: tf.Tensor, feature_shape: tuple[int, ...]
) -> collections.OrderedDict:
    """A cache record -> {"image": float32 features [feature_shape], "identity"}: the
    per-example element the client work takes (its "image" is the model's input)."""
    parsed = tf.io.parse_single_example(serialized, _FEATURE_SPEC)
    features = tf.io.decode_raw(parsed[FEATURES_KEY], tf.float32, little_endian=True)
    return collections.OrderedDict(
        image=tf.reshape(features, feature_shape), identity=parsed[schema.IDENTITY_KEY]
    )


def _cache_record(user_id: bytes, identity: bytes, features: np.ndarray) -> bytes:
    def single(value: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                schema.USER_ID_KEY: single(user_id),
                schema.IDENTITY_KEY: single(identity),
                FEATURES_KEY: single(features.astype("<f4").tobytes()),
            }
        )
    )
    return example.SerializeToString()


@dataclasses.dataclass(frozen=True)
class CachedFeatures:
    """A built cache: a partition of features (`partition_dir`) and their shape."""

    partition_dir: str
    feature_shape: tuple[int, ...]
    key: str

    def load_examples(self, virtual_client_id: tf.Tensor) -> tf.data.Dataset:
        """Per-example {"image": features, "identity"} of a virtual client (client_data ids
        built from this cache's partition). Traceable."""
        shape = self.feature_shape
        return client_data.read_virtual_client_records(virtual_client_id).map(
            lambda serialized: parse_cached_example(serialized, shape)
        )


def _source_fingerprint(partition_dir: str) -> bytes:
    """Hash of the source partition's manifest, indexes and part files: which records
    sit where, and their bytes (a partition rewritten in place with other images of the
    same sizes must not reuse features; hashing costs far less than the prefix)."""
    digest = hashlib.sha256()
    manifest = partition.read_manifest(partition_dir)
    digest.update(json.dumps(manifest, sort_keys=True).encode())
    for shard in range(manifest["num_shards"]):
        path = os.path.join(partition_dir, partition.INDEX_DIR, f"shard-{shard:05d}.jsonl")
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path, "rb") as f:
                digest.update(f.read())
        for part in _shard_parts(partition_dir, shard):
            with tf.io.gfile.GFile(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    return digest.digest()


def _layer_description(layer: tf.keras.layers.Layer) -> dict:
    """A layer's class and configuration without its (process-dependent) name."""
    config = {k: v for k, v in layer.get_config().items() if k != "name"}
    return {"class": type(layer).__name__, "config": config}


def cache_key(
    partition_dir: str,
    config: model_config.BackboneConfig,
    cut: FeatureCut,
    prefix: tf.keras.Model,
) -> str:
    """The cache's name: what its features depend on (module docstring)."""
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            {
                "format": CACHE_FORMAT,
                "architecture": config.architecture,
                "image_shape": list(config.image_shape),
                "cut": cut.layer,
                "feature_shape": list(cut.feature_shape),
                # Layers by what they compute, never by name: Keras numbers unnamed layers
                # afresh in every backbone a process builds (re_lu_2, then re_lu_4), so
                # names would make each job of one process miss the cache.
                "prefix_layers": [
                    _layer_description(layer)
                    for layer in models.all_layers(prefix)
                    if not isinstance(layer, tf.keras.layers.InputLayer)
                ],
            },
            sort_keys=True,
            default=repr,
        ).encode()
    )
    for variable in models.ordered_variables(prefix):
        value = np.ascontiguousarray(variable.numpy())
        digest.update(str(value.dtype).encode() + str(value.shape).encode() + value.tobytes())
    digest.update(_source_fingerprint(partition_dir))
    return digest.hexdigest()[:32]


def _shard_parts(partition_dir: str, shard: int) -> list[str]:
    path = os.path.join(partition_dir, partition.INDEX_DIR, f"shard-{shard:05d}.jsonl")
    if not tf.io.gfile.exists(path):
        return []
    with tf.io.gfile.GFile(path) as f:
        entries = [json.loads(line) for line in f.read().splitlines() if line]
    # The index lists users in file order; a shard's part files follow one another.
    return list(dict.fromkeys(os.path.join(partition_dir, entry[1]) for entry in entries))


def _write_shard_features(
    source_dir: str,
    target_dir: str,
    reader: partition.PartitionReader,
    shard: int,
    prefix_fn: tf.types.experimental.GenericFunction,
    image_shape: tuple[int, int, int],
) -> dict:
    files = _shard_parts(source_dir, shard)
    records: list[tuple[str, bytes]] = []
    if files:
        examples = (
            tf.data.TFRecordDataset(files)
            .map(
                lambda s: tf.io.parse_single_example(s, schema.FEATURE_SPEC),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .map(
                lambda e: (
                    e[schema.USER_ID_KEY],
                    e[schema.IDENTITY_KEY],
                    export.decode_image(e[schema.IMAGE_KEY], image_shape),
                ),
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
            .batch(_PREFIX_BATCH)
            .prefetch(1)
        )
        for users, identities, images in examples:
            features = prefix_fn(images).numpy()
            for user, identity, row in zip(users.numpy(), identities.numpy(), features):
                records.append((user.decode("utf-8"), _cache_record(user, identity, row)))
    if not records:
        return {"shard": shard, "users": 0, "records": 0, "parts": 0}
    max_part_bytes = reader.manifest["max_part_bytes"]
    return partition.write_shard(target_dir, shard, records, max_part_bytes, keep_order=True)


def _written_counts(directory: str, shard: int) -> dict | None:
    """A finished shard's counts (its index is renamed into place last), or None."""
    path = os.path.join(directory, partition.INDEX_DIR, f"shard-{shard:05d}.jsonl")
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        entries = [json.loads(line) for line in f.read().splitlines() if line]
    return {
        "shard": shard,
        "users": len(entries),
        "records": sum(entry[4] for entry in entries),
        "parts": len({entry[1] for entry in entries}),
    }


def ensure_cache(
    partition_dir: str,
    cache_root: str,
    config: model_config.BackboneConfig,
    backbone: tf.keras.Model,
    cut: FeatureCut,
) -> CachedFeatures:
    """The cache of `backbone`'s frozen prefix over `partition_dir` under `cache_root`:
    reused when its key matches, else built (resuming a partial build)."""
    prefix, _ = cut.split(backbone)
    key = cache_key(partition_dir, config, cut, prefix)
    final = os.path.join(cache_root, key)
    cached = CachedFeatures(final, cut.feature_shape, key)
    if tf.io.gfile.exists(os.path.join(final, CACHE_FILE)):
        return cached
    partial = final + ".partial"
    tf.io.gfile.makedirs(os.path.join(partial, partition.INDEX_DIR))
    reader = partition.PartitionReader(partition_dir)
    num_shards = reader.manifest["num_shards"]
    # One trace for every batch size (a shard's last batch is smaller).
    prefix_fn = tf.function(
        lambda images: prefix(images, training=False),
        input_signature=[tf.TensorSpec([None, *config.image_shape], tf.float32)],
    )
    counts = []
    for shard in range(num_shards):
        written = _written_counts(partial, shard)
        if written is not None:
            counts.append(written)
            continue
        counts.append(
            _write_shard_features(
                partition_dir, partial, reader, shard, prefix_fn, config.image_shape
            )
        )
        logging.info("feature cache %s: shard %d of %d written", key, shard + 1, num_shards)
    manifest = partition.build_manifest(counts, num_shards, reader.manifest["max_part_bytes"])
    if (manifest["users"], manifest["records"]) != (reader.num_users, reader.manifest["records"]):
        raise ValueError(
            f"feature cache {partial} holds {manifest['users']} users and "
            f"{manifest['records']} records, its partition {reader.num_users} and "
            f"{reader.manifest['records']}; delete {partial} and run again"
        )
    with tf.io.gfile.GFile(os.path.join(partial, partition.MANIFEST_FILE), "w") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with tf.io.gfile.GFile(os.path.join(partial, CACHE_FILE), "w") as f:
        f.write(
            json.dumps(
                {
                    "key": key,
                    "source_partition": os.path.abspath(partition_dir),
                    "cut": cut.layer,
                    "feature_shape": list(cut.feature_shape),
                    "format": CACHE_FORMAT,
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )
    if tf.io.gfile.exists(final):  # a concurrent build of the same key finished first
        shutil.rmtree(partial, ignore_errors=True)
    else:
        tf.io.gfile.rename(partial, final)
    return cached

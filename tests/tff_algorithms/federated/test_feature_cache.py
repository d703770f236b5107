"""Cached frozen-prefix features (issue 21): where the backbone is cut, the cache partition,
and a cached job training what the uncached one trains."""

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import partition, schema
from tests import support
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config, model_config
from tff_algorithms.federated import client_data, feature_cache
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import models

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

SMALL = model_config.BackboneConfig(embedding_size=16)


def _config(
    *layers: str, architecture: str = model_config.SMALL_CNN, **kw
) -> model_config.BackboneConfig:
    return dataclasses.replace(SMALL, architecture=architecture, trainable_layers=layers, **kw)


@pytest.mark.parametrize(
    "layers, cut_layer, shape",
    [
        (("embedding",), "embedding", (7 * 7 * 64,)),
        (("conv1", "gn1", "embedding"), "conv1", (14, 14, 32)),
        # gn1 frozen inside the suffix: still a suffix, gn1 is carried as non-trainable.
        (("conv1", "embedding"), "conv1", (14, 14, 32)),
        # Frozen layers between trained ones stay in the suffix; only the prefix is cached.
        (("gn0", "embedding"), "gn0", (28, 28, 32)),
    ],
)
def test_a_trained_suffix_is_cut_before_its_first_trained_layer(layers, cut_layer, shape):
    decision = feature_cache.cut_for(_config(*layers))
    assert decision.cut == feature_cache.FeatureCut(cut_layer, shape)
    # The split reproduces the backbone and shares its trainable variables in order.
    model = models.build_backbone(_config(*layers), seed=4)
    prefix, suffix = decision.cut.split(model)
    images = tf.random.stateless_uniform([3, *SMALL.image_shape], seed=[1, 2])
    np.testing.assert_allclose(suffix(prefix(images)), model(images), atol=1e-6)
    assert [v.ref() for v in suffix.trainable_weights] == [v.ref() for v in model.trainable_weights]
    assert not prefix.trainable_weights


@pytest.mark.parametrize(
    "config, reason",
    [
        # The default recipe trains the first convolution: nothing frozen before it.
        (_config("conv*", "gn*"), "'conv0' has no frozen layer before it"),
        (_config("*"), "'conv0' has no frozen layer before it"),
    ],
)
def test_layers_that_are_no_suffix_are_not_cached(config, reason):
    decision = feature_cache.cut_for(config)
    assert decision.cut is None and reason in decision.reason


def test_an_application_trunk_frozen_whole_is_cached_before_the_embedding():
    # (A trunk trained from one of its blocks on is not cut inside it: the cut is only
    # between top-level layers. Not tested here: another MobileNetV2 build is 20 s.)
    config = _config("embedding", architecture=model_config.MOBILENET_V2, image_shape=(32, 32, 3))
    assert feature_cache.cut_for(config).cut == feature_cache.FeatureCut("embedding", (1280,))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), support.TRAIN_CLI_DATA, support.SMALL_JOB_TRAIN_IDENTITIES
    )


def _images(partition_dir: str, user: str) -> tuple[np.ndarray, list[bytes]]:
    records = partition.PartitionReader(partition_dir).user_records(user)
    images = np.stack(
        [
            client_data.parse_example(schema.serialize(r), SMALL.image_shape)["image"]
            for r in records
        ]
    )
    return images, [r.identity.encode() for r in records]


def test_the_cache_is_a_partition_of_the_same_users_and_order_and_is_reused(data, tmp_path):
    partition_dir, _ = data
    config = _config("conv1", "gn1", "embedding")
    cut = feature_cache.cut_for(config).cut
    model = models.build_backbone(config, seed=2)
    cached = feature_cache.ensure_cache(partition_dir, str(tmp_path), config, model, cut)
    source, cache = (
        partition.PartitionReader(partition_dir),
        partition.PartitionReader(cached.partition_dir),
    )
    assert cache.user_ids() == source.user_ids()
    assert cache.manifest["num_shards"] == source.manifest["num_shards"]
    assert cache.manifest["records"] == source.manifest["records"]
    prefix, _ = cut.split(model)
    for user in source.user_ids()[:3]:
        images, identities = _images(partition_dir, user)
        got = [
            feature_cache.parse_cached_example(s, cut.feature_shape)
            for s in cache.user_examples(user)
        ]
        assert [g["identity"].numpy() for g in got] == identities
        np.testing.assert_allclose(np.stack([g["image"] for g in got]), prefix(images), atol=1e-5)
    # The same prefix over the same partition: the same cache, not rebuilt.
    stamp = os.stat(os.path.join(cached.partition_dir, feature_cache.CACHE_FILE)).st_mtime_ns
    again = feature_cache.ensure_cache(partition_dir, str(tmp_path), config, model, cut)
    assert again == cached
    assert (
        os.stat(os.path.join(cached.partition_dir, feature_cache.CACHE_FILE)).st_mtime_ns == stamp
    )
    # Other prefix weights: another key.
    other = feature_cache.ensure_cache(
        partition_dir, str(tmp_path), config, models.build_backbone(config, seed=3), cut
    )
    assert other.key != cached.key and os.path.isdir(other.partition_dir)


def test_the_same_start_built_again_in_one_process_has_the_same_key(data):
    """Keras numbers unnamed layers afresh in each model a process builds; the key must
    not see that, or every job after the first in a process rebuilds its cache."""
    partition_dir, _ = data
    config = _config("embedding")
    cut = feature_cache.cut_for(config).cut
    first, second = (cut.split(models.build_backbone(config, seed=2))[0] for _ in range(2))
    names = [[layer.name for layer in models.all_layers(p)] for p in (first, second)]
    assert names[0] != names[1]  # what the key must not depend on
    keys = [feature_cache.cache_key(partition_dir, config, cut, p) for p in (first, second)]
    assert keys[0] == keys[1]


def test_an_interrupted_cache_build_resumes_from_its_finished_shards(data, tmp_path):
    partition_dir, _ = data
    config = _config("embedding")
    cut = feature_cache.cut_for(config).cut
    model = models.build_backbone(config, seed=2)
    whole = feature_cache.ensure_cache(partition_dir, str(tmp_path / "whole"), config, model, cut)
    # A build killed after its first shard: shard 0 done, no manifest, not renamed.
    partial = str(tmp_path / "resumed" / whole.key) + ".partial"
    os.makedirs(os.path.join(partial, partition.INDEX_DIR))
    for name in os.listdir(whole.partition_dir):
        if name.startswith("shard-00000-"):
            os.link(os.path.join(whole.partition_dir, name), os.path.join(partial, name))
    index = os.path.join(partition.INDEX_DIR, "shard-00000.jsonl")
    os.link(os.path.join(whole.partition_dir, index), os.path.join(partial, index))
    resumed = feature_cache.ensure_cache(
        partition_dir, str(tmp_path / "resumed"), config, model, cut
    )
    assert not os.path.exists(partial)
    for name in ("manifest.json", "index/shard-00001.jsonl"):
        with (
            open(os.path.join(whole.partition_dir, name)) as f,
            open(os.path.join(resumed.partition_dir, name)) as g,
        ):
            assert f.read() == g.read()


SUFFIX_JOB = dataclasses.replace(
    support.SMALL_JOB,
    rounds=2,
    evaluate_every=0,
    schedule_seed=7,
    testing_fixed_schedule=True,
    trainable_layers=("conv1", "gn1", "embedding"),
)


@pytest.mark.parametrize("algorithm", [job_config.DP_FEDEMB, job_config.DP_FEDAVG])
def test_a_cached_job_trains_what_the_uncached_job_trains(tff_runtime, data, tmp_path, algorithm):
    base = dataclasses.replace(SUFFIX_JOB, algorithm=algorithm)
    uncached = train_job.run_train_job(
        dataclasses.replace(base, cache_features=False), *data, str(tmp_path / "uncached")
    )
    cached = train_job.run_train_job(
        dataclasses.replace(base, cache_features=True), *data, str(tmp_path / "cached")
    )
    assert not os.path.exists(tmp_path / "uncached" / job_files.FEATURE_CACHE_DIR)
    assert os.listdir(tmp_path / "cached" / job_files.FEATURE_CACHE_DIR)
    # The same updates, noise and server steps: equal to float tolerance (the prefix ran
    # in other batch shapes), and the frozen prefix exactly as it started.
    for a, b in zip(
        support.saved_backbone(uncached.saved_model_dir),
        support.saved_backbone(cached.saved_model_dir),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    start = models.ordered_variables(models.build_backbone(base.backbone_config, base.seed))
    np.testing.assert_array_equal(
        support.saved_backbone(cached.saved_model_dir)[0], start[0].numpy()
    )
    assert uncached.epsilon == cached.epsilon
    facts = json.loads(open(cached.metrics_path).read())["feature_cache"]
    assert (
        facts["used"] and facts["cut_before"] == "conv1" and facts["feature_shape"] == [14, 14, 32]
    )
    assert json.loads(open(uncached.metrics_path).read())["feature_cache"] == {
        "used": False,
        "reason": "cache_features is false",
    }


def test_cache_features_true_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="cache_features.*no frozen layer before it"):
        dataclasses.replace(support.SMALL_JOB, cache_features=True)
    with pytest.raises(ValueError, match="cache_features.*logit-dp"):
        job_config.TrainJobConfig(
            algorithm=job_config.LOGIT_DP,
            users_per_virtual_client=1,
            trainable_layers=("embedding",),
            cache_features=True,
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainable-layers=embedding"], "--trainable-layers embedding would keep"),
        (["--cache-features=yes"], "--cache-features must be one of auto, true, false"),
    ],
)
def test_the_train_command_refuses_bad_suffix_flags_in_one_line(tmp_path, flags, message):
    line, _ = support.run_refused(
        "train", f"--data={tmp_path}", f"--output={tmp_path / 'out'}", *flags
    )
    assert message in line

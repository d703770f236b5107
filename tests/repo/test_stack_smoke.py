"""Fails loudly when the validated stack (docs/design.md section 1) drifts or breaks."""

import os
import re
import sysconfig
from importlib import metadata

import apache_beam as beam
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from tests import paths

REPO = str(paths.REPO)
LOCK = os.path.join(REPO, "requirements", "lock.txt")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked_versions() -> dict[str, str]:
    pins = {}
    with open(LOCK) as f:
        for line in f:
            match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;\\]+)", line)
            if match:
                pins[_normalise(match.group(1))] = match.group(3)
    return pins


def test_installed_versions_equal_the_lock():
    pins = _locked_versions()
    assert len(pins) > 100, "lock file looks truncated"
    # Only the venv's own site-packages: setuptools puts its vendored copies of
    # packaging, wheel, ... on sys.path, which are not installs.
    site_packages = [sysconfig.get_paths()["purelib"]]
    installed = {
        _normalise(d.metadata["Name"]): d.version
        for d in metadata.distributions(path=site_packages)
    }
    drift = {
        name: (version, installed.get(name))
        for name, version in pins.items()
        if installed.get(name) != version
    }
    assert drift == {}, f"installed versions differ from requirements/lock.txt: {drift}"
    unlocked = set(installed) - set(pins) - {"dp-fedemb"}
    assert unlocked == set(), f"installed but not in the lock: {sorted(unlocked)}"


def test_pinned_core_stack():
    assert tf.__version__ == "2.14.1"
    assert tff.__version__ == "0.87.0"
    assert metadata.version("tfx") == "1.15.1"
    assert metadata.version("apache-beam") == "2.59.0"
    assert metadata.version("dp-accounting") == "0.4.3"
    assert metadata.version("tensorflow-privacy") == "0.9.0"


def _one_round(factory, client_values: list[np.ndarray]) -> np.ndarray:
    value_type = tff.TensorType(np.float32, [3])
    process = factory.create(value_type)
    state = process.initialize()
    output = process.next(state, client_values)
    return np.asarray(output.result)


def test_gaussian_dp_aggregator_runs_a_round(tff_runtime):
    values = [np.array([1.0, 2.0, 2.0], np.float32), np.array([0.0, 0.0, 4.0], np.float32)]
    # No noise and a clip above every norm: exactly the mean over the planned clients.
    exact = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=0.0, clients_per_round=2.0, clip=10.0
    )
    np.testing.assert_allclose(_one_round(exact, values), [0.5, 1.0, 3.0], rtol=1e-6)
    # Clip 1.0: each client is scaled to norm 1 before the sum.
    clipped = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=0.0, clients_per_round=2.0, clip=1.0
    )
    expected = (values[0] / 3.0 + values[1] / 4.0) / 2.0
    np.testing.assert_allclose(_one_round(clipped, values), expected, rtol=1e-6)
    noisy = tff.aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=1.0, clients_per_round=2.0, clip=1.0
    )
    result = _one_round(noisy, values)
    assert np.all(np.isfinite(result)) and not np.allclose(result, expected)


def test_tree_dp_aggregator_runs_a_round(tff_runtime):
    values = [np.array([1.0, 2.0, 2.0], np.float32), np.array([0.0, 0.0, 4.0], np.float32)]
    specs = tf.TensorSpec([3], tf.float32)
    exact = tff.aggregators.DifferentiallyPrivateFactory.tree_aggregation(
        noise_multiplier=0.0,
        clients_per_round=2.0,
        l2_norm_clip=10.0,
        record_specs=specs,
        noise_seed=1,
    )
    np.testing.assert_allclose(_one_round(exact, values), [0.5, 1.0, 3.0], rtol=1e-6)
    noisy = tff.aggregators.DifferentiallyPrivateFactory.tree_aggregation(
        noise_multiplier=1.0,
        clients_per_round=2.0,
        l2_norm_clip=10.0,
        record_specs=specs,
        noise_seed=1,
    )
    result = _one_round(noisy, values)
    assert np.all(np.isfinite(result)) and not np.allclose(result, [0.5, 1.0, 3.0])


def test_beam_test_pipeline_with_assert_that():
    with TestPipeline(runner="DirectRunner") as p:
        counts = p | beam.Create(["u1", "u2", "u1", "u3", "u1"]) | beam.combiners.Count.PerElement()
        assert_that(counts, equal_to([("u1", 3), ("u2", 1), ("u3", 1)]))


def test_beam_assert_that_fails_on_a_wrong_result():
    with pytest.raises(Exception, match="unexpected elements|missing elements"):
        with TestPipeline(runner="DirectRunner") as p:
            assert_that(p | beam.Create([1, 2]), equal_to([1, 3]))


def test_saved_model_saves_and_reloads(tmp_path):
    class Scale(tf.Module):
        def __init__(self):
            self.w = tf.Variable([[2.0], [3.0]])

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
        def __call__(self, x):
            return {"y": tf.matmul(x, self.w)}

    module = Scale()
    path = str(tmp_path / "model")
    tf.saved_model.save(module, path, signatures={"serving_default": module.__call__})
    loaded = tf.saved_model.load(path)
    x = tf.constant([[1.0, 1.0], [0.5, -1.0]])
    np.testing.assert_allclose(loaded.signatures["serving_default"](x)["y"], [[5.0], [-2.0]])

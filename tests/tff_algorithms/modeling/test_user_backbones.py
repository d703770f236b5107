"""Backbones a user brings (keras:, file:, python:): built DP-safe, started from the file,
refused in one line when they cannot train privately."""

import os
import textwrap
import types

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.config import job_config, model_config
from tff_algorithms.federated import feature_cache
from tff_algorithms.jobs import job_outputs
from tff_algorithms.modeling import dp_layers, export, models


def _user_net(batch_norm_layer=tf.keras.layers.BatchNormalization) -> tf.keras.Model:
    """A small face network of a user's: RGB 32×32 in, 48-d out, BatchNorm and Dropout."""
    inputs = tf.keras.Input((32, 32, 3))
    x = tf.keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = batch_norm_layer(name="bn1")(x)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.MaxPool2D()(x)
    x = tf.keras.layers.SeparableConv2D(16, 3, padding="same", name="c2")(x)
    x = batch_norm_layer(name="bn2")(x)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    x = tf.keras.layers.Dropout(0.25, name="drop")(x)
    outputs = tf.keras.layers.Dense(48, name="emb")(x)
    return tf.keras.Model(inputs, outputs)


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    """The user's network saved as .keras, with BatchNorm statistics of its own."""
    model = _user_net()
    bn = model.get_layer("bn1")
    bn.moving_mean.assign(np.linspace(-0.5, 0.5, 8).astype(np.float32))
    bn.moving_variance.assign(np.linspace(0.5, 2.0, 8).astype(np.float32))
    path = str(tmp_path_factory.mktemp("user") / "face.keras")
    model.save(path)
    return path, model


def _per_example_gradient_moves(model: tf.keras.Model, seed: int = 0) -> float:
    """How much example 0's loss gradient (training mode) moves when the other examples of
    its batch change: 0 for a model that is DP-safe."""
    shape = [int(d) for d in model.input_shape[1:]]
    first = tf.random.stateless_uniform([1, *shape], seed=[seed, 0])
    gradients = []
    for companions in (1, 2):
        batch = tf.concat(
            [first, tf.random.stateless_uniform([2, *shape], seed=[seed, companions])], axis=0
        )
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(batch, training=True)[0]))
        gradients.append(tape.gradient(loss, model.trainable_variables))
    moved = [float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(*gradients)]
    largest = max(float(tf.reduce_max(tf.abs(g))) for g in gradients[0])
    return max(moved) / max(largest, 1e-12)


FAST_FAMILIES = [
    (model_config.SMALL_CNN, (28, 28, 1)),
    ("keras:MobileNetV3Small", (32, 32, 3)),
]
# Built-in and keras.applications families, each DP-safe once built (slow: seconds each).
SLOW_FAMILIES = [
    (model_config.MOBILENET_V2, (32, 32, 3)),
    (model_config.RESNET50, (32, 32, 3)),
    ("keras:MobileNetV3Large", (32, 32, 3)),
    ("keras:MobileNetV2", (32, 32, 1)),
    ("keras:EfficientNetB0", (32, 32, 3)),
    ("keras:ResNet50V2", (32, 32, 3)),
]


@pytest.mark.parametrize(
    "architecture, shape",
    FAST_FAMILIES + [pytest.param(*family, marks=pytest.mark.slow) for family in SLOW_FAMILIES],
)
def test_one_examples_gradient_does_not_depend_on_the_rest_of_its_batch(architecture, shape):
    config = model_config.BackboneConfig(architecture, shape, 16)
    model = models.build_backbone(config, seed=1)
    assert not any(
        type(layer) is tf.keras.layers.BatchNormalization for layer in models.all_layers(model)
    )
    assert _per_example_gradient_moves(model) < 1e-5


@pytest.mark.parametrize("batch_norm", ["freeze", "group_norm"])
def test_a_user_file_with_batch_norm_trains_per_example_in_both_modes(user_file, batch_norm):
    path, _ = user_file
    config = model_config.BackboneConfig(f"file:{path}", (32, 32, 3), 48, batch_norm=batch_norm)
    model = models.build_backbone(config)
    kinds = {type(layer).__name__ for layer in models.all_layers(model)}
    expected = "FrozenBatchNormalization" if batch_norm == "freeze" else "GroupNormalization"
    assert expected in kinds and "BatchNormalization" not in kinds
    assert "SeededDropout" in kinds and "Dropout" not in kinds
    assert _per_example_gradient_moves(model) < 1e-5


def test_batch_norm_in_training_mode_is_caught_by_the_gradient_test(user_file):
    # The fault the freeze prevents: the user's network as saved, BatchNorm in training mode.
    path, _ = user_file
    assert _per_example_gradient_moves(tf.keras.models.load_model(path, compile=False)) > 1e-2


def test_a_file_backbone_starts_from_the_files_weights_and_statistics(user_file):
    path, _ = user_file
    original = tf.keras.models.load_model(path, compile=False)
    config = model_config.BackboneConfig(f"file:{path}", (32, 32, 3), 48)
    assert config.resolved_batch_norm == model_config.BATCH_NORM_FREEZE
    images = tf.random.stateless_uniform([4, 32, 32, 3], seed=[3, 4])
    for seed in (0, 5):  # the file's weights, whatever the job's seed
        model = models.build_backbone(config, seed)
        np.testing.assert_array_equal(model(images).numpy(), original(images).numpy())
    with tf.Graph().as_default():  # the same start where TFF builds it (a graph)
        in_graph = models.build_backbone(config)
        assert [v.shape for v in in_graph.weights] == [v.shape for v in model.weights]


def test_frozen_batch_norm_keeps_its_statistics_through_a_training_step(user_file):
    path, _ = user_file
    model = models.build_backbone(model_config.BackboneConfig(f"file:{path}", (32, 32, 3), 48))
    bn = model.get_layer("bn1")
    before = bn.moving_mean.numpy().copy()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.random.uniform([4, 32, 32, 3]), training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    tf.keras.optimizers.SGD(0.1).apply_gradients(zip(grads, model.trainable_variables))
    np.testing.assert_array_equal(bn.moving_mean.numpy(), before)
    assert any(v is bn.gamma for v in model.trainable_variables)  # scale and offset train


def test_seeded_dropout_is_a_function_of_the_seed_and_the_example():
    layer = dp_layers.SeededDropout(0.5, seed=11)
    x = tf.random.stateless_uniform([3, 64], seed=[1, 2]) + 1.0
    once, again = layer(x, training=True), layer(x, training=True)
    np.testing.assert_array_equal(once.numpy(), again.numpy())
    other_seed = dp_layers.SeededDropout(0.5, seed=12)(x, training=True)
    assert not np.array_equal(once.numpy(), other_seed.numpy())
    dropped = float(np.mean(once.numpy() == 0))
    assert 0.3 < dropped < 0.7
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x.numpy())


def test_a_served_user_backbone_gives_unit_embeddings_of_its_own_size(user_file, tmp_path):
    path, _ = user_file
    config = model_config.BackboneConfig(f"file:{path}", (32, 32, 3), 48)
    exported = export.export_serving_model(
        config, models.backbone_weights(models.build_backbone(config)), str(tmp_path / "m")
    )
    serve = tf.saved_model.load(exported).signatures[export.SIGNATURE]
    png = tf.io.encode_png(tf.cast(tf.random.uniform([40, 50, 3]) * 255, tf.uint8))
    embeddings = serve(images=tf.stack([png, png]))[export.OUTPUT_KEY].numpy()
    assert embeddings.shape == (2, 48)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    # A pretrained start from the export loads back into the same architecture.
    reloaded = models.load_pretrained_backbone(config, exported)
    assert len(reloaded.weights) == len(models.build_backbone(config).weights)


def test_trainable_layers_and_the_feature_cache_see_a_keras_trunks_own_layers():
    config = model_config.BackboneConfig(
        "keras:MobileNetV3Small", (32, 32, 3), 16, trainable_layers=("embedding",)
    )
    model = models.build_backbone(config)
    assert not any(isinstance(layer, tf.keras.Model) for layer in model.layers)
    assert [v.name for v in model.trainable_variables] == ["embedding/kernel:0", "embedding/bias:0"]
    decision = feature_cache.cut_for(config)
    assert decision.cut is not None and decision.cut.layer == "embedding", decision.reason


def _factory_module(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("import tensorflow as tf\n\n" + textwrap.dedent(body))
    return str(path)


def test_a_python_factory_builds_the_users_layers_and_its_source_is_the_jobs(tmp_path):
    module = _factory_module(
        tmp_path,
        "my_nets",
        """
        class Scale(tf.keras.layers.Layer):
            dp_fedemb_per_example = True

            def build(self, shape):
                self.scale = self.add_weight("scale", shape[-1:], initializer="ones")

            def call(self, x):
                return x * self.scale


        def build(image_shape, embedding_size):
            inputs = tf.keras.Input(image_shape)
            x = tf.keras.layers.Conv2D(4, 3, padding="same")(inputs)
            x = Scale()(x)
            x = tf.keras.layers.Flatten()(x)
            return tf.keras.Model(inputs, tf.keras.layers.Dense(embedding_size)(x))
        """,
    )
    config = model_config.BackboneConfig(f"python:{module}:build", (16, 16, 1), 8)
    model = models.build_backbone(config, seed=2)
    assert model.output_shape == (None, 8)
    assert _per_example_gradient_moves(model) < 1e-5
    before = config.source_digest
    with open(module, "a") as file:
        file.write("\n# edited\n")
    assert model_config.source_digest(config.architecture) != before


def _refusal(architecture: str, shape=(32, 32, 3), embedding_size: int = 48, **kwargs) -> str:
    with pytest.raises(ValueError) as raised:
        model_config.BackboneConfig(architecture, shape, embedding_size, **kwargs)
    text = str(raised.value)
    assert "\n" not in text
    return text


def test_bad_user_models_are_refused_in_one_line_each(user_file, tmp_path):
    path, _ = user_file
    not_a_model = tmp_path / "notes.keras"
    not_a_model.write_text("not a model")
    assert "is not a Keras model" in _refusal(f"file:{not_a_model}")
    assert "no such file" in _refusal(f"file:{tmp_path / 'missing.keras'}")
    assert "set train.image_size and train.channels" in _refusal(f"file:{path}", (28, 28, 1))
    assert "set it to 48" in _refusal(f"file:{path}", embedding_size=16)
    assert "has no constructor" in _refusal("keras:MobileNetV9")
    assert "cannot take images" in _refusal("keras:MobileNetV3Small", (16, 16, 3))
    assert "architecture must be one of" in _refusal("mobilenet_v3")

    feature_map = tf.keras.Sequential([tf.keras.Input((32, 32, 3)), tf.keras.layers.Conv2D(4, 3)])
    feature_map.save(str(tmp_path / "map.keras"))
    assert "rank 2" in _refusal(f"file:{tmp_path / 'map.keras'}")

    module = _factory_module(
        tmp_path,
        "user_factories",
        """
        class Custom(tf.keras.layers.Layer):
            def call(self, x):
                return x


        def downloads(image_shape, embedding_size):
            return tf.keras.applications.MobileNetV3Small(input_shape=image_shape,
                                                          weights="imagenet")


        def raises(image_shape, embedding_size):
            raise RuntimeError("no GPU here")


        def mixes(image_shape, embedding_size):
            inputs = tf.keras.Input(image_shape)
            x = tf.keras.layers.Flatten()(inputs)
            x = tf.keras.layers.Lambda(lambda t: t - tf.reduce_mean(t, axis=0))(x)
            return tf.keras.Model(inputs, tf.keras.layers.Dense(embedding_size)(x))


        def unclassified(image_shape, embedding_size):
            inputs = tf.keras.Input(image_shape)
            x = Custom()(tf.keras.layers.Flatten()(inputs))
            return tf.keras.Model(inputs, tf.keras.layers.Dense(embedding_size)(x))


        def saved_with_custom(path):
            unclassified((32, 32, 3), 48).save(path)
        """,
    )
    assert "would download" in _refusal(f"python:{module}:downloads")
    assert "the factory raised RuntimeError: no GPU here" in _refusal(f"python:{module}:raises")
    assert "(Lambda) cannot be shown" in _refusal(f"python:{module}:mixes")
    assert "(Custom) cannot be shown" in _refusal(f"python:{module}:unclassified")
    assert "has no function nothing" in _refusal(f"python:{module}:nothing")
    assert "is not found" in _refusal("python:no_such_module_here:build")

    namespace = {}
    exec(open(module).read(), namespace)  # noqa: S102 - the test's own module
    namespace["saved_with_custom"](str(tmp_path / "custom.keras"))
    assert "custom layer" in _refusal(f"file:{tmp_path / 'custom.keras'}")


def test_a_changed_model_file_is_a_new_job_never_a_resume(user_file, tmp_path):
    path, original = user_file
    copy = str(tmp_path / "face.keras")
    original.save(copy)
    config = job_config.TrainJobConfig(
        architecture=f"file:{copy}", image_size=32, channels=3, embedding_size=48
    )
    reader = types.SimpleNamespace(manifest={"users": 10, "records": 40})
    output = str(tmp_path / "job")
    job_outputs.claim_output_dir(output, job_outputs.job_record(config, reader), config)
    # The same file: the same job, resumed.
    job_outputs.claim_output_dir(output, job_outputs.job_record(config, reader), config)
    edited = _user_net()
    edited.save(copy)
    os.utime(copy, ns=(1, 1))  # a different size or time makes the digest read it again
    with pytest.raises(ValueError, match="different backbone"):
        job_outputs.claim_output_dir(output, job_outputs.job_record(config, reader), config)


def test_built_in_jobs_record_no_model_source_and_keep_their_records():
    config = job_config.TrainJobConfig()
    reader = types.SimpleNamespace(manifest={"users": 10, "records": 40})
    record = job_outputs.job_record(config, reader)
    assert job_outputs.MODEL_SOURCE_KEY not in record
    assert "batch_norm" not in record["config"]

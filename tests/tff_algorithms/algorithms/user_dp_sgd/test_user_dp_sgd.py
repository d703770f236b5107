"""User-level DP-SGD baselines as jobs (issue 21 item 2): dp-sgd-centralized and
dp-last-layer. Epsilon against dp_accounting, serving, the step against plain
SGD and Adam computed here, full batch (issue 42), refusals."""

import dataclasses
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tests import support
from tff_algorithms.algorithms.user_dp_sgd import DpSgdSettings
from tff_algorithms.algorithms.user_dp_sgd import training as user_dp_sgd
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.config.client_config import HeadLossConfig
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting, accounting_spec

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

TRAIN_IDENTITIES = support.SMALL_JOB_TRAIN_IDENTITIES
USERS_PER_STEP = 8
CONFIG = job_config.TrainJobConfig(
    algorithm=job_config.DP_SGD_CENTRALIZED,
    rounds=4,
    noise_multiplier=1.0,
    clip_norm=1.0,
    users_per_virtual_client=1,
    virtual_clients_per_round=USERS_PER_STEP,
    server_learning_rate=0.5,
    server_momentum=0.9,
    head_loss="softmax",
    embedding_size=16,
    evaluate_every=2,
    seed=1,
    noise_seed=7,
    testing_fixed_noise=True,
)
LAST_LAYER = dataclasses.replace(
    CONFIG,
    algorithm=job_config.DP_LAST_LAYER,
    rounds=2,
    evaluate_every=0,
    trainable_layers=("embedding",),
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.small_job_inputs(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def straight_run(data, tmp_path_factory):
    return train_job.run_train_job(CONFIG, *data, str(tmp_path_factory.mktemp("straight")))


def _independent_epsilon(steps: int, noise_multiplier: float, delta: float) -> float:
    # dp_accounting's own events, not the product's spec: substitute-one moves the sum of
    # clipped gradients by up to 2·clip, so the Gaussian's multiplier is z / 2.
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            TRAIN_IDENTITIES, USERS_PER_STEP, dp_accounting.GaussianDpEvent(noise_multiplier / 2)
        ),
        steps,
    )
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    return accountant.compose(event).get_epsilon(delta)


def test_epsilon_equals_dp_accounting_and_the_privacy_command(straight_run, capsys):
    from absl import flags

    from pipeline.commands import privacy

    summary = straight_run.metrics
    delta = TRAIN_IDENTITIES**-1.1
    assert summary["private"] is True and summary["rounds"] == 4
    # The RDP cross-check is dp_accounting's own RDP; the (default) tight PLD is below it.
    independent = _independent_epsilon(4, 1.0, delta)
    assert summary["epsilon_rdp"] == pytest.approx(independent, rel=1e-9)
    assert summary["epsilon"] < independent
    # `dp-fedemb privacy`, in process (its flags and run).
    flag_values = flags.FlagValues()
    privacy.define_flags(flag_values)
    flag_values(
        [
            "dp-fedemb privacy",
            "--mechanism=dpsgd",
            f"--users={TRAIN_IDENTITIES}",
            f"--users-per-round={USERS_PER_STEP}",
            "--users-per-virtual-client=1",
            "--rounds=4",
            "--noise-multiplier=1.0",
            f"--delta={delta!r}",
            "--json",
        ]
    )
    capsys.readouterr()
    assert privacy.run(flag_values, []) == 0
    out = json.loads(capsys.readouterr().out)
    assert summary["epsilon"] == pytest.approx(out["epsilon"], rel=1e-12)
    ledger = json.loads(open(straight_run.ledger_path).read())
    assert [e["round"] for e in ledger["history"]] == [1, 2, 3, 4]
    assert ledger["spec"]["users_per_virtual_client"] == 1
    assert ledger["spec"]["convention"] == "strict"


def test_history_releases_nothing_but_epsilon_time_and_held_out_evaluation(straight_run):
    history = straight_run.metrics["history"]
    assert [r["round"] for r in history if "eval" in r] == [2, 4]
    for record in history:
        assert set(record) <= {"round", "epsilon", "round_seconds", "eval"}


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def test_serving_model_maps_image_bytes_to_unit_embeddings(straight_run):
    serve = tf.saved_model.load(straight_run.saved_model_dir).signatures["serving_default"]
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (28, 28), dtype=np.uint8) for _ in range(3)]
    embeddings = serve(images=tf.constant([_png(i) for i in images]))["embedding"].numpy()
    assert embeddings.shape == (3, CONFIG.embedding_size)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)


def _reference_step(model, head, x, identity, real, vocabulary, clip, learning_rate):
    """Plain SGD on the mean over users of each user's clipped gradient, computed here."""
    variables = [*model.trainable_variables, head]
    keys = tf.strings.to_hash_bucket_fast(identity, 2**62).numpy()
    labels = np.searchsorted(vocabulary, keys)
    total = [np.zeros(v.shape, np.float32) for v in variables]
    for k in range(x.shape[0]):
        rows = np.flatnonzero(real[k].numpy())
        with tf.GradientTape() as tape:
            logits = tf.matmul(model(tf.gather(x[k], rows)), head)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels[k][rows], logits)
            )
        gradient = [g.numpy() for g in tape.gradient(loss, variables)]
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in gradient))
        scale = min(1.0, clip / norm)
        total = [t + scale * g for t, g in zip(total, gradient, strict=True)]
    n = x.shape[0]
    return [v.numpy() - learning_rate * t / n for v, t in zip(variables, total, strict=True)]


@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_noiseless_step_is_sgd_on_the_mean_of_clipped_user_gradients(data, clip):
    from beam_jobs import partition

    reader = partition.PartitionReader(data[0])
    users = reader.user_ids()
    config = dataclasses.replace(CONFIG, max_examples_per_client=4, embedding_size=8)
    source = user_dp_sgd.StepSource(
        config, user_dp_sgd.image_examples(data[0], config.image_shape), users, 5
    )
    x, identity, real = source.batch(0)
    assert x.shape[:2] == (USERS_PER_STEP, 4)  # users hold 6 images: 4 drawn
    assert len(set(source.users(0))) == USERS_PER_STEP
    vocabulary = np.unique(tf.strings.to_hash_bucket_fast(identity, 2**62).numpy().ravel())

    def fresh():
        model = models.build_backbone(config.backbone_config, seed=2)
        head = tf.Variable(
            models.initial_head_kernel(tf.constant([2, -1], tf.int64), 8, len(vocabulary))
        )
        return model, head

    model, head = fresh()
    expected = _reference_step(model, head, x, identity, real, vocabulary, clip, 0.1)
    model, head = fresh()
    trainer = user_dp_sgd.UserDpSgd(
        model,
        head,
        vocabulary,
        HeadLossConfig("softmax"),
        clip_norm=clip,
        noise_multiplier=0.0,
        users_per_step=USERS_PER_STEP,
        learning_rate=0.1,
        momentum=0.9,  # the first step of momentum SGD is plain SGD
    )
    trainer.step(x, identity, real, tf.constant([1, 0], tf.int64))
    for want, got in zip(expected, trainer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


def test_a_user_with_fewer_examples_is_padded_and_masked():
    subsets = user_dp_sgd._example_subsets([2, 9, 9], limit=4, schedule_seed=3, step=0)
    assert list(subsets[0]) == [0, 1]
    assert all(len(s) == 4 and len(set(s)) == 4 and max(s) < 9 for s in subsets[1:])
    again = user_dp_sgd._example_subsets([2, 9, 9], limit=4, schedule_seed=3, step=0)
    assert all(np.array_equal(a, b) for a, b in zip(subsets, again, strict=True))


def test_dp_last_layer_trains_the_zero_initialised_embedding_on_cached_features(data, tmp_path):
    # The seed's form (issue 42): every user in each of 2 steps, DP-Adam. (The sampled
    # schedule's accounting is `straight_run`'s.)
    config = dataclasses.replace(
        LAST_LAYER,
        virtual_clients_per_round="auto",
        server_momentum=0.0,
        server_learning_rate=1e-3,
        settings={"optimizer": "adam", "full_batch": True},
    )
    result = train_job.run_train_job(config, *data, str(tmp_path / "last"))
    delta = TRAIN_IDENTITIES**-1.1
    # No amplification: 2 Gaussians of sensitivity 2·clip composed, the full-batch spec
    # (tests/tff_algorithms/privacy/test_accounting.py checks it against the closed form).
    full = accounting_spec.AccountingSpec(
        TRAIN_IDENTITIES, TRAIN_IDENTITIES, 2, 1.0, delta, sampling="full"
    )
    assert result.metrics["epsilon"] == pytest.approx(accounting.compute_privacy(full).epsilon)
    ledger = json.loads(open(result.ledger_path).read())
    assert ledger["spec"]["sampling"] == "full"
    assert ledger["spec"]["users_per_round"] == ledger["spec"]["population"] == TRAIN_IDENTITIES
    trained = models.load_pretrained_backbone(LAST_LAYER.backbone_config, result.saved_model_dir)
    initial = models.build_backbone(LAST_LAYER.backbone_config, seed=LAST_LAYER.seed)
    for layer in (layer for layer in models.all_layers(trained) if layer.weights):
        for got, start in zip(layer.weights, initial.get_layer(layer.name).weights, strict=True):
            if layer.name == "embedding":
                assert np.max(np.abs(got.numpy())) > 0  # moved from zero
            else:
                np.testing.assert_array_equal(got.numpy(), start.numpy())  # frozen prefix
    facts = result.metrics["feature_cache"]
    assert facts["used"] is True and facts["cut_before"] == "embedding"
    cache = os.path.join(result.output_dir, job_files.FEATURE_CACHE_DIR)
    assert os.listdir(cache) == [facts["key"]]


@pytest.mark.parametrize(
    "config, changes, message",
    [
        (CONFIG, {"users_per_virtual_client": 2}, "set users_per_virtual_client to 1"),
        (CONFIG, {"over_selection": 0.5}, "over_selection applies to federated rounds"),
        (LAST_LAYER, {"trainable_layers": ("conv*", "embedding")}, "trains the embedding layer"),
        (LAST_LAYER, {"head_loss": "cosface"}, "set head_loss to softmax"),
        (LAST_LAYER, {"cache_features": False}, "set cache_features to null or true"),
        (
            CONFIG,
            {"settings": {"optimizer": "adagrad"}},
            "dp_sgd.optimizer must be one of sgd, adam, lamb",
        ),
        (
            CONFIG,
            {"settings": {"adam_beta1": 0.5}},
            "dp_sgd.adam_beta1 applies to the adam and lamb",
        ),
        (
            CONFIG,
            {"settings": {"optimizer": "lamb"}},
            "server_momentum applies to the sgd optimizer",
        ),
        (
            CONFIG,
            {"settings": {"optimizer": "adam", "adam_beta2": 1.0}, "server_momentum": 0.0},
            "dp_sgd.adam_beta2 must be finite and in .0, 1., got 1.0",
        ),
        (CONFIG, {"settings": {"full_batch": 1}}, "dp_sgd.full_batch must be a boolean"),
        (CONFIG, {"settings": {"head_bias": -5.0}}, "dp_sgd.head_bias applies to the sigmoid head"),
        (
            CONFIG,
            {"settings": {"sigmoid_head": True}, "head_loss": "cosface"},
            "dp_sgd.sigmoid_head scores the softmax head's logits: set head_loss to softmax",
        ),
    ],
)
def test_config_refusals_are_one_line(config, changes, message):
    with pytest.raises(ValueError, match=message) as e:
        dataclasses.replace(config, **changes)
    assert "\n" not in str(e.value)


def test_full_batch_takes_every_user_each_step_and_is_accounted_without_sampling(data):
    full = dataclasses.replace(
        CONFIG, virtual_clients_per_round="auto", settings={"full_batch": True}
    )
    with pytest.raises(ValueError, match="set dp_sgd.users_per_step to auto") as e:
        dataclasses.replace(full, virtual_clients_per_round=8).calibrated_for(TRAIN_IDENTITIES)
    assert "\n" not in str(e.value)
    planned, _ = full.calibrated_for(TRAIN_IDENTITIES)
    assert planned.virtual_clients_per_round == TRAIN_IDENTITIES
    spec = job_plan.accounting_spec_for(planned, TRAIN_IDENTITIES)
    # Not the sampled schedule at q = 1: the explicit no-sampling analysis.
    assert spec.sampling.value == "full" and spec.population == spec.users_per_round == 32
    from beam_jobs import partition

    users = partition.PartitionReader(data[0]).user_ids()
    source = user_dp_sgd.StepSource(
        planned,
        user_dp_sgd.image_examples(data[0], planned.image_shape),
        users,
        5,
        full_batch=True,
    )
    assert source.users(0) == source.users(3) == list(users)


def _dense_trainer(
    settings, clip, users, rows=7, width=20, size=5, learning_rate=0.1, noise_multiplier=0.0
):
    inputs = tf.keras.Input([width])
    dense = tf.keras.layers.Dense(
        size, kernel_initializer=tf.keras.initializers.GlorotUniform(1), bias_initializer="ones"
    )
    model = tf.keras.Model(inputs, dense(inputs))
    names = [f"id{i}" for i in range(rows)]
    vocabulary = np.unique(tf.strings.to_hash_bucket_fast(names, 2**62).numpy())
    head = tf.Variable(models.initial_head_kernel(tf.constant([0, -1], tf.int64), size, rows))
    trainer = user_dp_sgd.UserDpSgd(
        model,
        head,
        vocabulary,
        HeadLossConfig("softmax"),
        clip_norm=clip,
        noise_multiplier=noise_multiplier,
        users_per_step=users,
        learning_rate=learning_rate,
        momentum=0.0,
        settings=settings,
    )
    return trainer, names, vocabulary


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_noiseless_adam_and_lamb_steps_take_the_mean_clipped_gradient(optimizer):
    """One step of DP-Adam / DP-LAMB (the paper's Algorithm 1): lr·ḡ/(|ḡ|+ε) from zero
    moments, ḡ the mean of the users' clipped gradients computed here; LAMB scales each
    non-zero variable's step by ‖w‖/‖r‖."""
    users, clip, lr, eps = 5, 0.1, 1e-3, 1e-8
    settings = DpSgdSettings(optimizer=optimizer, adam_epsilon=eps)
    trainer, names, vocabulary = _dense_trainer(settings, clip, users, learning_rate=lr)
    rng = np.random.default_rng(2)
    x = tf.constant(rng.normal(size=(users, 3, 20)).astype(np.float32))
    identity = tf.constant(rng.choice(names, (users, 3)))
    real = tf.constant(np.ones((users, 3), bool))
    before = [v.numpy() for v in trainer.variables]
    sgd = _reference_step(trainer.model, trainer.head, x, identity, real, vocabulary, clip, 1.0)
    mean = [b - a for b, a in zip(before, sgd, strict=True)]
    trainer.step(x, identity, real, tf.constant([1, 0], tf.int64))
    for w, g, got in zip(before, mean, trainer.variables, strict=True):
        r = g / (np.abs(g) + eps)
        ratio = 1.0
        if optimizer == "lamb" and np.linalg.norm(w) > 0:
            ratio = np.linalg.norm(w) / np.linalg.norm(r)
        np.testing.assert_allclose(got.numpy(), w - lr * ratio * r, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("shortcut", [True, False])
def test_sigmoid_head_step_is_sgd_on_the_papers_loss_from_bias_minus_ten(shortcut):
    """The seed paper's loss: logits eᵀω + c, c starting at -10, each identity's sigmoid
    cross-entropy -y log σ(z) - (1-y) log(1-σ(z)) summed, written out here; one
    noiseless SGD step on the mean of the users' clipped gradients."""
    users, clip, lr = 4, 0.5, 0.1
    settings = DpSgdSettings(sigmoid_head=True)
    trainer, names, vocabulary = _dense_trainer(settings, clip, users, learning_rate=lr)
    assert trainer.variables[-1] is trainer.head_bias
    np.testing.assert_array_equal(trainer.head_bias.numpy(), np.full(7, -10.0))
    if not shortcut:
        trainer._dense = None  # one tape per user
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(users, 3, 20)).astype(np.float32))
    identity = tf.constant(rng.choice(names, (users, 3)))
    labels = np.searchsorted(vocabulary, tf.strings.to_hash_bucket_fast(identity, 2**62).numpy())
    variables = trainer.variables
    before = [v.numpy() for v in variables]
    total = [np.zeros(v.shape) for v in before]
    for k in range(users):
        with tf.GradientTape() as tape:
            z = tf.matmul(trainer.model(x[k]), trainer.head) + trainer.head_bias
            y = tf.constant(np.eye(7)[labels[k]], tf.float32)
            p = 1 / (1 + tf.exp(-z))
            loss = tf.reduce_mean(
                tf.reduce_sum(-y * tf.math.log(p) - (1 - y) * tf.math.log(1 - p), 1)
            )
        gradient = [g.numpy().astype(np.float64) for g in tape.gradient(loss, variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in gradient))
        total = [t + min(1.0, clip / norm) * g for t, g in zip(total, gradient, strict=True)]
    trainer.step(x, identity, tf.constant(np.ones((users, 3), bool)), tf.constant([1, 0], tf.int64))
    for w, t, got in zip(before, total, variables, strict=True):
        np.testing.assert_allclose(got.numpy(), w - lr * t / users, rtol=1e-4, atol=1e-6)


def test_dense_layer_shortcut_equals_one_tape_per_user(clip=0.1):
    users, examples, width = 6, 3, 20
    rng = np.random.default_rng(0)
    trainer, names, _ = _dense_trainer(None, clip, users, width=width)
    x = tf.constant(rng.normal(size=(users, examples, width)).astype(np.float32))
    identity = tf.constant(rng.choice(names, (users, examples)))
    real = np.ones((users, examples), bool)
    real[0, 2] = real[1, 1] = False  # padding
    real[2] = False  # a user with no example adds nothing
    assert trainer._dense is trainer.model.layers[-1]
    shortcut = tf.function(trainer.dense_clipped_sum)(x, identity, tf.constant(real))
    trainer._dense = None
    loop = tf.function(trainer.clipped_sum)(x, identity, tf.constant(real))
    for got, want in zip(shortcut, loop, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_step_noise_std_is_z_times_clip_over_users():
    """The noise the accountant's multiplier assumes: N(0, (z C)^2) on every coordinate of
    the clipped sum, divided by n; the clipped signal (norm <= C) is negligible beside it."""
    users, width, size, z, clip = 4, 100, 40, 1e4, 1e-5
    trainer, names, _ = _dense_trainer(
        None, clip, users, width=width, size=size, learning_rate=1.0, noise_multiplier=z
    )
    before = np.concatenate([v.numpy().ravel() for v in trainer.variables])
    rng = np.random.default_rng(1)
    x = tf.constant(rng.normal(size=(users, 2, width)).astype(np.float32))
    identity = tf.constant(rng.choice(names, (users, 2)))
    trainer.step(x, identity, tf.constant(np.ones((users, 2), bool)), tf.constant([3, 0], tf.int64))
    step = np.concatenate([v.numpy().ravel() for v in trainer.variables]) - before
    # 99.99% bounds of a sample std over ~4,300 coordinates: within 4.2%.
    assert step.std() / (z * clip / users) == pytest.approx(1.0, abs=0.042)


def test_the_cli_and_the_pipeline_take_each_baseline_recipe():
    from absl import flags

    from pipeline import config as config_lib
    from pipeline.commands import train, train_config

    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(["dp-fedemb train", "--algorithm=dp-last-layer", "--rounds=7"])
    cli = train_config.job_config({name: flag_values[name].value for name in flag_values})
    pipeline = config_lib.load_config(
        None, ["train.algorithm=dp-last-layer", "train.rounds=7"]
    ).train_job_dict()
    for job in (cli.to_dict(), pipeline):
        assert job["algorithm"] == "dp-last-layer" and job["rounds"] == 7
        assert job["trainable_layers"] == ("embedding",) or job["trainable_layers"] == ["embedding"]
        defaults = dataclasses.asdict(DpSgdSettings())
        assert (job["dp_sgd"], job["head_loss"]) == (
            {"users_per_step": 1024, **defaults},
            "softmax",
        )
    job = config_lib.load_config(
        None,
        [
            "train.algorithm=dp-sgd-centralized",
            "train.dp_sgd.users_per_step=64",
            "train.dp_sgd.optimizer=adam",
            "train.server_momentum=0",
        ],
    ).train_job_dict()
    assert job["dp_sgd"] == {**defaults, "users_per_step": 64, "optimizer": "adam"}
    assert job_config.TrainJobConfig.from_dict(job).users_per_virtual_client == 1

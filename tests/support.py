"""Helpers that several test modules share: small training data on disk, the small job
configs of the training-job tests, a toy learning process for the training-program tests,
the weights a training job exported, and the `dp-fedemb train` flags of the command-line
tests.

Plain functions and constants, not fixtures: each module keeps its own module-scoped
fixture around them, so its synthetic config and the fixture's scope stay visible
where they are used.
"""

import json
import os
import shutil
import subprocess
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition_job, synthetic
from tff_algorithms.config import job_config
from tff_algorithms.federated import rounds
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.checkpoints import StructureState
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.privacy import accounting_spec

# The console script of the environment running the tests (setup.py installs it).
CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "dp-fedemb")

# The image folder the `dp-fedemb train` tests write: 40 identities, one user each.
TRAIN_CLI_DATA = synthetic.SyntheticConfig(identities=40, images_per_identity=6, seed=5)

# The small DP-FedEmb job of the training-job tests (test_train_job, test_evaluation,
# test_golden_run) on TRAIN_CLI_DATA: identities (= users) 0..31 train, 32..39 are held out.
SMALL_JOB_TRAIN_IDENTITIES = 32
SMALL_JOB = job_config.TrainJobConfig(
    algorithm=job_config.DP_FEDEMB,
    rounds=3,
    noise_multiplier=0.5,
    clip_norm=1.0,
    users_per_virtual_client=2,
    virtual_clients_per_round=3,
    client_learning_rate=0.05,
    server_learning_rate=1.0,
    head_lr_scale=10.0,
    batch_size=8,
    head_capacity=7,
    embedding_size=16,
    evaluate_every=2,
    seed=1,
    noise_seed=11,
    testing_fixed_noise=True,
)

# The small job the multi-worker tests (test_multi_worker, test_tls_workers) train with
# every seed fixed, so runs on one worker and on several can be compared.
MULTI_WORKER_JOB = job_config.TrainJobConfig(
    algorithm=job_config.DP_FEDEMB,
    rounds=3,
    noise_multiplier=1.0,
    clip_norm=1.0,
    users_per_virtual_client=2,
    virtual_clients_per_round=4,
    client_learning_rate=0.01,
    client_momentum=0.0,
    server_learning_rate=1.0,
    head_lr_scale=10.0,
    batch_size=8,
    embedding_size=16,
    evaluate_every=0,
    seed=3,
    schedule_seed=3,
    testing_fixed_schedule=True,
    noise_seed=5,
    testing_fixed_noise=True,
)


def train_cli_flags(rounds: int) -> list[str]:
    """`dp-fedemb train` flags for a small DP-FedEmb run on TRAIN_CLI_DATA.

    The paper recipe (TrainJobConfig's defaults) under the flags. Every seed is fixed (the schedule and noise seeds behind their testing flags), so
    two runs with these flags train the same model bit for bit; evaluation every 2
    rounds, and 20% of the identities each for validation and test.
    """
    return [
        "--recipe=paper",
        f"--rounds={rounds}",
        "--users-per-virtual-client=2",
        "--virtual-clients-per-round=3",
        "--noise-multiplier=0.5",
        "--client-learning-rate=0.05",
        "--server-learning-rate=1.0",
        "--head-lr-scale=10",
        "--batch-size=8",
        "--embedding-size=16",
        "--evaluate-every=2",
        "--schedule-seed=0",
        "--testing-fixed-schedule",
        "--noise-seed=3",
        "--testing-fixed-noise",
        "--validation-fraction=0.2",
        "--test-fraction=0.2",
    ]


def write_partition_and_held_out(
    root: str | os.PathLike[str],
    config: synthetic.SyntheticConfig,
    train_identities: int,
    num_shards: int = 2,
) -> tuple[str, str]:
    """Writes `config`'s synthetic records as a training job's two inputs under ROOT.

    Identities [0, train_identities) (one user each) are partitioned by user into
    ROOT/partition with a real Beam pipeline; the remaining identities, held out, go
    to one TFRecord file in ROOT/eval. Returns (partition_dir, eval_dir), the order
    `train_job.run_train_job` takes them in.
    """
    return partition_job.write_training_inputs(
        os.fspath(root),
        synthetic.records_for_identities(config, 0, train_identities),
        synthetic.records_for_identities(config, train_identities, config.identities),
        num_shards,
    )


def small_job_inputs(root: str | os.PathLike[str]) -> tuple[str, str]:
    """The small jobs' inputs under ROOT (`write_partition_and_held_out`):
    `TRAIN_CLI_DATA`'s first `SMALL_JOB_TRAIN_IDENTITIES` identities train (one user
    each, six images), the rest are held out."""
    return write_partition_and_held_out(root, TRAIN_CLI_DATA, SMALL_JOB_TRAIN_IDENTITIES)


def saved_backbone(saved_model_dir: str) -> list[np.ndarray]:
    """The backbone weights of a SavedModel that a training job exported."""
    return [v.numpy() for v in tf.saved_model.load(saved_model_dir).backbone_variables]


def assert_same_trained_outputs(expected: Any, got: Any) -> None:
    """Two training jobs' results (`job_outputs.TrainJobResult`) hold the same exported
    backbone bit for bit, the same ledger and the same history up to wall times: what a
    resumed job must end with."""
    for a, b in zip(
        saved_backbone(expected.saved_model_dir), saved_backbone(got.saved_model_dir), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    with open(expected.ledger_path) as f, open(got.ledger_path) as g:
        assert f.read() == g.read()
    assert without_round_seconds(got.metrics["history"]) == without_round_seconds(
        expected.metrics["history"]
    )


def without_round_seconds(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Training history records without their wall-clock times, the one field that
    differs between a resumed run and an uninterrupted one."""
    return [{k: v for k, v in record.items() if k != "round_seconds"} for record in history]


# A toy learning process for the training-program tests (test_training_program,
# test_crash_safety): unweighted FedAvg of a 3->2 dense model on synthetic clients.
TOY_ROUNDS = 4


def _toy_model_fn() -> tff.learning.models.VariableModel:
    keras_model = tf.keras.Sequential(
        [tf.keras.layers.Dense(2, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))]
    )
    keras_model.build((None, 3))
    return tff.learning.models.from_keras_model(
        keras_model,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=(tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([None], tf.int32)),
    )


def toy_process() -> tff.learning.templates.LearningProcess:
    """The toy process, loading each client's data inside TFF from its id."""

    @tff.tensorflow.computation(np.str_)
    def client_data(client_id):  # noqa: ANN001, ANN202
        # Deterministic synthetic examples derived from the id, built inside TFF.
        seed = tf.strings.to_hash_bucket_fast(client_id, 2**31 - 1)
        x = tf.random.stateless_normal([8, 3], seed=tf.stack([seed, 0]))
        y = tf.cast(x[:, 0] > 0, tf.int32)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)

    fed_avg = tff.learning.algorithms.build_unweighted_fed_avg(
        _toy_model_fn,
        client_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=0.5),
        server_optimizer_fn=tff.learning.optimizers.build_sgdm(learning_rate=1.0, momentum=0.9),
    )
    return tff.simulation.compose_dataset_computation_with_learning_process(client_data, fed_avg)


def _toy_clients_for_round(round_num: int) -> list[str]:
    return [f"r{round_num}-c{i}" for i in range(3)]


TOY_SPEC = accounting_spec.AccountingSpec(
    population=100, users_per_round=3, rounds=TOY_ROUNDS, noise_multiplier=1.0, delta=1e-5
)


def train_toy_rounds(
    process: tff.learning.templates.LearningProcess,
    directory: str,
    rounds_to_train: int,
    evaluate: Callable[[tff.learning.models.ModelWeights], Mapping[str, Any]] | None = None,
    evaluate_every: int = 0,
    initial_state: Any = None,
) -> JobOutcome:
    """Trains (or resumes, from DIRECTORY's checkpoints) the toy process on its clients
    through the training loop (`jobs/loop.py`), as the federated trainer does, until
    `rounds_to_train` rounds are done; the outcome's `backbone` is the model weights.
    With `evaluate`, a fresh run evaluates its start (round 0) too."""
    server = StructureState(process.initialize() if initial_state is None else initial_state)

    def step(t: int, _: Any) -> None:
        applied = rounds.run_round(process, server.get(), t, _toy_clients_for_round, None)
        server.set(applied.output.state)

    inputs = types.SimpleNamespace(
        config=types.SimpleNamespace(
            rounds=rounds_to_train, evaluate_every=evaluate_every, noise_seed=None
        ),
        spec=TOY_SPEC,
        releases=None,
        evaluator=evaluate or (lambda weights: {}),
        checkpoint_dir=directory,
        progress=None,
    )
    return loop.run(
        inputs,  # type: ignore[arg-type]  # what the loop reads of JobInputs
        loop.Round(
            step,
            {"server_state": server.leaves},
            lambda: process.get_model_weights(server.get()),
            noisy=False,
            evaluate_start=evaluate is not None,
            checkpoint_every=1,
        ),
    )


def remove_checkpoint(checkpoint_dir: str, step: int) -> None:
    """Removes step `step`'s checkpoint files: what a kill before that step's save
    leaves (the loop's checkpoint-state file is rewritten on resume)."""
    names = tf.io.gfile.glob(os.path.join(checkpoint_dir, f"ckpt-{step}.*"))
    assert names, os.listdir(checkpoint_dir)
    for name in names:
        os.remove(name)


def toy_weights(outcome: JobOutcome) -> list[np.ndarray]:
    """The toy model's trainable weights a `train_toy_rounds` run ended with."""
    return [np.asarray(w) for w in outcome.backbone.trainable]


def run_refused(*args: str, timeout: int = 900, cwd: str | None = None) -> tuple[str, Any]:
    """Runs `dp-fedemb ARGS` as a user does and checks it was refused as a user should
    see it: a non-zero exit, one `dp-fedemb COMMAND: error` line and no traceback on
    stderr. Returns that line and the completed process."""
    import subprocess

    process = subprocess.run(
        [CONSOLE_SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert process.returncode != 0, process.stdout[-2000:]
    errors = [line for line in process.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith("dp-fedemb "), process.stderr[-3000:]
    assert "Traceback" not in process.stderr
    return errors[0], process


def chromium() -> str | None:
    """The Chromium binary for the report's browser tests (.ci/run installs Debian's)."""

    for candidate in ("chromium", "chromium-browser", "/usr/bin/chromium"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


def headless_chromium(browser: str, profile: str, *args: str) -> Any:
    """Runs headless Chromium with a throwaway profile, nothing fetched from the network."""
    import subprocess

    return subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
        ],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )


# The whole pipeline on tiny data (test_pipeline_e2e, the shared first run in conftest,
# crash safety, Airflow): every component runs in a few seconds.
TINY_PIPELINE = {
    "data": {
        "synthetic": {"identities": 30, "images_per_identity": 6},
        "synthetic_public": {
            "identities": 10,
            "images_per_identity": 6,
            "seed": 1,
            "style": "sketch",
        },
    },
    "partition": {"num_shards": 2},
    "pretrain": {"job": {"rounds": 1, "evaluate_every": 1}},
    "train": {
        "algorithm": "dp-fedemb",
        "rounds": 2,
        "noise_multiplier": 0.5,
        "users_per_virtual_client": 2,
        "virtual_clients_per_round": 2,
        "batch_size": 16,
        "max_examples_per_client": 32,
        "embedding_size": 32,
        "evaluate_every": 1,
        "delta": 1e-3,
        "noise_seed": 0,
        "testing_fixed_noise": True,
    },
    "evaluate": {"privacy_budget_epsilon": 100.0},
    "budget": {"dataset_epsilon": 100.0},
}


def tiny_pipeline(output_dir: str, **section_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """TINY_PIPELINE's config values with `output_dir` and some sections' keys replaced."""
    values = json.loads(json.dumps(TINY_PIPELINE))
    for section, overrides in section_overrides.items():
        values.setdefault(section, {}).update(overrides)
    values.setdefault("pipeline", {})["output_dir"] = output_dir
    return values


def run_pipeline(values: Mapping[str, Any], root: str | os.PathLike[str]) -> Any:
    """Runs the pipeline of config `values` through the command line as a user does
    (`dp-fedemb run --config ROOT/config.json`); asserts it succeeded and returns
    (config, ML Metadata store, the command's CompletedProcess)."""
    from ml_metadata.metadata_store import metadata_store

    from pipeline import config as config_lib
    from pipeline import definition

    config = config_lib.config_from_dict(dict(values))
    path = os.path.join(os.fspath(root), "config.json")
    with open(path, "w") as f:
        f.write(json.dumps(config.to_dict()))
    process = subprocess.run(
        [CONSOLE_SCRIPT, "run", "--config", path],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert process.returncode == 0, process.stderr[-5000:]
    store = metadata_store.MetadataStore(definition.local_metadata_config(config))
    return config, store, process


def executions_by_node(store: Any) -> dict[str, list]:
    """An ML Metadata store's executions by pipeline node id, oldest first (node ids are
    the node contexts' name suffix)."""
    by_node: dict[str, list] = {}
    for context in store.get_contexts_by_type("node"):
        node_id = context.name.split(".")[-1]
        by_node[node_id] = sorted(store.get_executions_by_context(context.id), key=lambda e: e.id)
    return by_node


def screenshot_shades(browser: str, profile: str, page: str, size: str) -> int | None:
    """Grey shades in a headless Chromium screenshot of the file `page` at window `size`
    ("W,H"): a blank page has one, a rendered one with text and plots many (None: more
    than 65,536)."""
    from PIL import Image

    screenshot = f"{profile}-shot.png"
    headless_chromium(
        browser, profile, f"--window-size={size}", f"--screenshot={screenshot}", f"file://{page}"
    )
    with Image.open(screenshot) as image:
        colours = image.convert("L").getcolors(maxcolors=1 << 16)
    return None if colours is None else len(colours)


def zero_update_noise_prefix_sums(
    factory: tff.aggregators.UnweightedAggregationFactory, num_coordinates: int, rounds: int
) -> list[np.ndarray]:
    """Running sums of an aggregator's releases of one zero update of `num_coordinates`
    float32s per round: the noise a model accumulates over `rounds` rounds."""
    record_type = tff.types.tensorflow_to_type([tf.TensorSpec([num_coordinates], tf.float32)])
    process = factory.create(record_type)
    state = process.initialize()
    zero = [np.zeros(num_coordinates, np.float32)]
    total = np.zeros(num_coordinates)
    prefix_sums = []
    for _ in range(rounds):
        output = process.next(state, [zero])
        state = output.state
        total = total + output.result[0]
        prefix_sums.append(total.copy())
    return prefix_sums


def files_with_times(root: str) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `root`: (size, modification time, content), to show that a run
    changed no file."""
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = (
                    os.path.getsize(path),
                    os.stat(path).st_mtime_ns,
                    f.read(),
                )
    return found

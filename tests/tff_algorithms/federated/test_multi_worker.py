"""Training on several TFF workers: same weights as one worker, DP noise added once.

Two `worker_binary` processes on 127.0.0.1 stand in for workers a cluster scheduler
would start (docs/scaling.md); the runtime connects to them by address, exactly as it
would to remote ones, and splits each round's virtual clients across them.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.core.impl.execution_contexts import (
    mergeable_comp_execution_context,
)

from beam_jobs import synthetic
from pipeline import cli
from tests import support
from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
from tff_algorithms.config import model_config
from tff_algorithms.config.client_config import ClientConfig
from tff_algorithms.federated import local_workers, runtime
from tff_algorithms.jobs import train_job

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

SYNTH = synthetic.SyntheticConfig(identities=36, images_per_identity=5, seed=7)
TRAIN_IDENTITIES = 28  # identities (= users) 0..27 train, 28..35 held out
CONFIG = support.MULTI_WORKER_JOB
# Float32 summation-order tolerance on trained weights (justified in the test).
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """Two workers on 127.0.0.1 that the tests connect to by address (never stopped by
    a runtime: only by this fixture, as a cluster scheduler would)."""
    log_dir = str(tmp_path_factory.mktemp("worker_logs"))
    first = local_workers.LocalWorker(log_dir, -1)
    second = local_workers.LocalWorker(log_dir, -1, taken_ports=[first.port])
    yield first, second
    for worker in (first, second):
        worker.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


def _trained_backbone(data, output_dir: str, addresses: tuple[str, ...]) -> list[np.ndarray]:
    result = train_job.run_train_job(
        CONFIG,
        *data,
        output_dir,
        runtime_config=runtime.RuntimeConfig(worker_addresses=addresses),
    )
    assert result.metrics["rounds"] == CONFIG.rounds
    return support.saved_backbone(result.saved_model_dir)


def test_two_workers_train_the_one_worker_weights(two_workers, data, tmp_path):
    """Several DP-FedEmb rounds (z = 1) on 2 workers end at the 1-worker weights.

    Same seeds, so the same virtual clients, local heads and noise. The only change is
    where the clipped updates are summed: each worker sums its half of the round's M
    virtual clients and the two halves are added (one merge of two partial sums:
    commutative, so the result does not depend on which worker finishes first),
    instead of one running sum. Tolerance, per coordinate:
    - reordering a float32 sum of M terms of norm <= clip moves it by at most about
      (M - 1) * u * clip, u = 2^-24 the unit roundoff: 1.8e-7 for M = 4, clip = 1;
      dividing by M and adding the identical noise keep that scale;
    - adding the update to weights of magnitude up to ~4 rounds to their spacing
      (ulp 4.8e-7), so one round may leave the runs a few ulps apart, ~1e-6;
    - later rounds start local training from weights that differ by that, and a few
      SGD steps at learning rate 0.01 without momentum amplify it modestly (with 0.05
      and momentum 0.9 local training is chaotic enough to grow it to 2e-3 by round 3).
    So 3 rounds get 1e-5 (measured: 4.8e-7, one ulp). That is still 2.5e4 times
    below the per-coordinate noise std z*clip/M = 0.25: a second noise draw or a lost
    half of the clients would exceed it by orders of magnitude.
    """
    first, second = two_workers
    one = _trained_backbone(data, str(tmp_path / "one"), (first.address,))
    two = _trained_backbone(data, str(tmp_path / "two"), (first.address, second.address))
    assert [a.shape for a in one] == [b.shape for b in two]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(one, two))
    assert worst <= WEIGHT_TOLERANCE, f"1 and 2 workers differ by {worst}"
    assert WEIGHT_TOLERANCE < 1e-3 * CONFIG.noise_multiplier * CONFIG.clip_norm / (
        CONFIG.virtual_clients_per_round
    )


def _client_dataset(seed: int, identities: list[str], config: ClientConfig):
    images = np.random.default_rng(seed).random((len(identities), 28, 28, 1), dtype=np.float32)
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": images, "identity": np.array(identities)}
    )
    return client_work.make_client_dataset(examples, f"vc{seed}", config)


def test_noise_is_added_once_after_the_merge(two_workers):
    """The 2-worker update has noise std z*clip/M, not sqrt(2) times it.

    Four clients, two per worker. Noise added by each worker before the merge would
    give independent draws summing to sqrt(2) z clip / M, or, with the same seed on
    both, 2 z clip / M; the test allows 3%.
    """
    backbone = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
    client_config = ClientConfig(client_learning_rate=0.05, head_capacity=3, batch_size=4)
    z, clip, planned = 2.0, 0.5, 4
    addresses = tuple(w.address for w in two_workers)
    with runtime.TffRuntime(runtime.RuntimeConfig(worker_addresses=addresses)):
        context = tff.framework.get_context_stack().current
        assert isinstance(context, mergeable_comp_execution_context.MergeableCompExecutionContext)
        process = processes.build_fedemb_process(
            backbone,
            client_config,
            aggregators.gaussian_fixed(
                noise_multiplier=z, clip_norm=clip, virtual_clients_per_round=planned, noise_seed=9
            ),
            processes.server_sgdm(1.0, 0.0),
        )
        state = process.initialize()
        clients = [_client_dataset(s, ["a", "b", "c", "a"], client_config) for s in range(planned)]
        output = process.next(state, clients)
        assert output.metrics["client_work"]["num_examples"] == 4 * planned
        before = processes.backbone_model_weights(process.get_model_weights(state)).trainable
        after = processes.backbone_model_weights(process.get_model_weights(output.state)).trainable
    step = np.concatenate([(a - b).ravel() for a, b in zip(after, before)])
    # The clients' mean clipped signal has norm <= clip over ~15k coordinates: negligible.
    assert step.std() / (z * clip / planned) == pytest.approx(1.0, abs=0.03)


def test_local_workers_split_clients_and_all_stop():
    with runtime.TffRuntime(runtime.RuntimeConfig(local_workers=2)) as rt:
        assert len(rt.local_workers) == 2 and len(set(rt.addresses)) == 2
        assert all(a.startswith("127.0.0.1:") for a in rt.addresses)
        context = tff.framework.get_context_stack().current
        assert isinstance(context, mergeable_comp_execution_context.MergeableCompExecutionContext)
        assert _federated_sum([float(v) for v in range(1, 8)]) == 28.0
        workers = list(rt.local_workers)
    assert all(w.process.poll() is not None for w in workers)


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _federated_sum(values):
    return tff.federated_sum(values)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"local_workers": 0}, "local_workers must be >= 1"),
        ({"local_workers": 2, "worker_addresses": ("h:1",)}, "exclude each other"),
        ({"worker_addresses": ("h:1", "h:1")}, "repeat"),
        ({"worker_intra_op_threads": -1}, "worker_intra_op_threads must be >= 0"),
        ({"worker_intra_op_threads": 1.5}, "worker_intra_op_threads must be an integer"),
        ({"worker_intra_op_threads": True}, "worker_intra_op_threads must be an integer"),
    ],
)
def test_runtime_config_rejects_impossible_worker_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        runtime.RuntimeConfig(**fields)


def _train_command_errors(tmp_path, capsys, *flags: str) -> tuple[int, list[str]]:
    """`dp-fedemb train` on an empty data folder with `flags`: (exit code, stderr lines)."""
    (tmp_path / "data").mkdir()
    code = cli.main(
        ["dp-fedemb", "train", "--data", str(tmp_path / "data")]
        + ["--output", str(tmp_path / "out"), *flags]
    )
    return code, capsys.readouterr().err.strip().splitlines()


def test_train_command_rejects_workers_and_local_workers_together(tmp_path, capsys):
    code, err = _train_command_errors(
        tmp_path, capsys, "--workers", "127.0.0.1:1", "--local-workers", "2"
    )
    assert code != 0 and len(err) == 1 and "exclude each other" in err[0]


def test_train_command_rejects_negative_worker_threads(tmp_path, capsys):
    code, err = _train_command_errors(tmp_path, capsys, "--worker-intra-op-threads", "-1")
    assert code != 0 and err == [
        "dp-fedemb train: error: --worker-intra-op-threads must be >= 0, got -1"
    ]
    assert not (tmp_path / "out").exists()

"""The in_process executor (`runtime.executor`): TFF's MapReduceForm of a round run by
the training process's TensorFlow gives the worker's result.

The fast tests use the toy process (`support.toy_process`) and small federated
computations; the slow ones train each federated algorithm family's small job on both
executors, and kill and resume an in-process job (TFF lowers each job's `next` once,
15-50 s on 2 shared cores).
"""

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import synthetic
from pipeline import cli
from tests import crash_child, paths, support
from tff_algorithms.config import job_config
from tff_algorithms.federated import in_process_executor, runtime
from tff_algorithms.jobs import train_job

IN_PROCESS = runtime.RuntimeConfig(executor="in_process")
UNIT_ROUNDOFF = 2.0**-24  # float32


def _toy_weights(directory: str, rounds: int) -> list[np.ndarray]:
    outcome = support.train_toy_rounds(support.toy_process(), directory, rounds)
    return [np.asarray(w) for w in outcome.backbone.trainable]


def test_toy_rounds_equal_the_workers(tff_runtime, tmp_path):
    """Two rounds of the toy FedAvg (3 clients, no clipping) on both executors.

    The client graphs are the same TensorFlow with the same seeds and one intra-op
    thread each, so client updates agree bit for bit; only the order in which the three
    updates are summed may differ. Reordering a float32 sum of n terms moves it by at
    most (n - 1) u sum|x_i| per coordinate (u = 2^-24); the toy's updates are below 1
    in magnitude after a step of learning rate 0.5 on unit-scale data, so 2 u (n - 1) n
    per round bounds the weights' difference, doubled for the second round's clients
    starting from weights that differ by that much (2 rounds, 3 clients: 5e-6).
    """
    del tff_runtime  # the worker runs first, on the session's runtime
    worker = _toy_weights(str(tmp_path / "worker"), 2)
    with runtime.session(IN_PROCESS):
        in_process = _toy_weights(str(tmp_path / "in_process"), 2)
    n, rounds = 3, 2
    tolerance = 2 * rounds * 2 * UNIT_ROUNDOFF * (n - 1) * n
    for a, b in zip(worker, in_process, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance)
    assert any(np.any(a != 0) for a in in_process)


def test_client_work_is_spread_over_the_client_devices():
    """With two client devices (two virtual CPUs of one session, standing in for two
    GPUs), each device's graph of the client work is placed on it, virtual clients
    alternate between them, and the round is the one-device round (bit for bit: the
    same kernels, and the updates are summed in client order on the host)."""
    process = support.toy_process()
    clients = ["r0-c0", "r0-c1", "r0-c2"]
    results = []
    for devices in (["/device:CPU:0"], ["/device:CPU:0", "/device:CPU:1"]):
        context = in_process_executor.InProcessContext(devices=devices, concurrent_clients=1)
        with tff.framework.get_context_stack().install(context):
            output = process.next(process.initialize(), clients)
            compiled = context.compiled_round(process.next)
            results.append(process.get_model_weights(output.state))
        context.close()
        assert [graph.device for graph in compiled.work] == devices
        for graph, device in zip(compiled.work, devices, strict=True):
            # Every op but the few TFF pins to the host itself (its session token: a
            # placeholder and identities) runs where the graph was put.
            elsewhere = {
                (op.type, op.device) for op in graph.graph.get_operations() if op.device != device
            }
            assert elsewhere <= {
                ("Placeholder", in_process_executor.HOST_DEVICE),
                ("Identity", in_process_executor.HOST_DEVICE),
            }, elsewhere
    one, two = results
    for a, b in zip(one.trainable, two.trainable, strict=True):
        np.testing.assert_array_equal(a, b)


def test_client_devices_are_the_gpus_or_the_host():
    gpus = tf.config.list_logical_devices("GPU")
    expected = [d.name for d in gpus] or [in_process_executor.HOST_DEVICE]
    assert in_process_executor.client_devices() == expected


@tff.federated_computation(
    tff.FederatedType(np.float32, tff.SERVER), tff.FederatedType(np.float32, tff.CLIENTS)
)
def _two_aggregations(state, values):
    # A threshold aggregated, broadcast, then a second aggregation that depends on it:
    # what over-selection's first-M reports do; one MapReduceForm round cannot.
    first = tff.federated_sum(values)
    above = tff.federated_map(
        tff.tensorflow.computation(lambda v, t: tf.cast(v > t, tf.float32)),
        (values, tff.federated_broadcast(first)),
    )
    return state, tff.federated_sum(above)


@tff.federated_computation(
    tff.FederatedType(np.int32, tff.SERVER), tff.FederatedType(np.int32, tff.CLIENTS)
)
def _secure_sum(state, values):
    return state, tff.federated_secure_sum_bitwidth(values, 8)


@pytest.mark.parametrize(
    "computation, reason",
    [(_two_aggregations, "MapReduceForm cannot express"), (_secure_sum, "secure_sum_bitwidth")],
)
def test_what_a_form_cannot_express_is_one_line_naming_the_setting(computation, reason):
    context = in_process_executor.InProcessContext()
    try:
        with tff.framework.get_context_stack().install(context):
            with pytest.raises(in_process_executor.UnsupportedComputation) as refused:
                computation(1, [1, 2, 3])
    finally:
        context.close()
    message = str(refused.value)
    assert "\n" not in message and reason in message
    assert message.startswith("runtime.executor in_process cannot run")
    assert "runtime.executor to worker" in message


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"executor": "gpu"}, "executor must be one of worker, in_process, got 'gpu'"),
        ({"executor": "in_process", "local_workers": 2}, "drop worker_addresses"),
        ({"executor": "in_process", "worker_addresses": ("127.0.0.1:1",)}, "drop worker"),
    ],
)
def test_runtime_config_checks_the_executor(fields, message):
    with pytest.raises(ValueError, match=message):
        runtime.RuntimeConfig(**fields)


def _train_command_errors(tmp_path, capsys, *flags: str) -> list[str]:
    """`dp-fedemb train` on an empty data folder with `flags`: its stderr lines, after
    checking that it failed."""
    (tmp_path / "data").mkdir()
    code = cli.main(
        ["dp-fedemb", "train", "--data", str(tmp_path / "data")]
        + ["--output", str(tmp_path / "out"), *flags]
    )
    assert code != 0
    return capsys.readouterr().err.strip().splitlines()


def test_train_command_rejects_an_unknown_executor(tmp_path, capsys):
    err = _train_command_errors(tmp_path, capsys, "--executor", "in-process")
    assert len(err) == 1
    assert "--executor must be one of worker, in_process" in err[0]
    assert "did you mean in_process" in err[0]
    assert not (tmp_path / "out").exists()  # refused before TensorFlow loads


def test_train_command_passes_the_executor_to_the_runtime(tmp_path, capsys):
    # The runtime's own check answers: --executor reached RuntimeConfig.
    err = _train_command_errors(
        tmp_path, capsys, "--executor", "in_process", "--workers", "127.0.0.1:1"
    )
    assert len(err) == 1 and "executor in_process runs each round in the training" in err[0]


# Each federated family's small job on both executors (slow: TFF lowers each `next` in
# about 15-30 s on 2 cores, and each job trains a few rounds on each executor).

SYNTH = synthetic.SyntheticConfig(identities=36, images_per_identity=5, seed=7)
TRAIN_IDENTITIES = 28
# MULTI_WORKER_JOB: every seed fixed, local SGD at 0.01 without momentum (tame enough
# that a last-bit difference in one round stays small in the next ones).
FAMILY_JOBS = {
    job_config.DP_FEDEMB: dataclasses.replace(support.MULTI_WORKER_JOB, rounds=3),
    # 28 users in virtual clients of 2, 4 a round: an epoch is 4 rounds, so round 5
    # runs after the tree's restart.
    job_config.DP_FTRL_FEDEMB: dataclasses.replace(
        support.MULTI_WORKER_JOB, algorithm=job_config.DP_FTRL_FEDEMB, rounds=5
    ),
    job_config.DP_FEDAVG: dataclasses.replace(
        support.MULTI_WORKER_JOB, algorithm=job_config.DP_FEDAVG, head_capacity=None, rounds=3
    ),
}
# Per coordinate, as test_multi_worker derives for a reordered sum of the same clipped
# updates (M = 4, clip 1): (M - 1) u clip per round, a few ulps of weights near 4, and
# modest growth through later rounds' local SGD: 1e-5, far below the noise's
# z clip / M = 0.25 (a second or missing noise draw would show by orders of magnitude).
WEIGHT_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def family_data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("algorithm", sorted(FAMILY_JOBS))
def test_each_family_trains_the_same_job_on_both_executors(
    algorithm, family_data, tff_runtime, tmp_path
):
    """Same weights within float32 summation tolerance; identical ledger (so epsilon)
    and history (client counts, held-out evaluation) on both executors."""
    del tff_runtime
    config = FAMILY_JOBS[algorithm]
    worker = train_job.run_train_job(config, *family_data, str(tmp_path / "worker"))
    in_process = train_job.run_train_job(
        config, *family_data, str(tmp_path / "in_process"), runtime_config=IN_PROCESS
    )
    for a, b in zip(
        support.saved_backbone(worker.saved_model_dir),
        support.saved_backbone(in_process.saved_model_dir),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_TOLERANCE)
    with open(worker.ledger_path) as f, open(in_process.ledger_path) as g:
        assert f.read() == g.read()
    assert support.without_round_seconds(
        in_process.metrics["history"]
    ) == support.without_round_seconds(worker.metrics["history"])
    assert in_process.metrics["epsilon"] == worker.metrics["epsilon"] > 0
    assert WEIGHT_TOLERANCE < 1e-3 * config.noise_multiplier * config.clip_norm / (
        config.virtual_clients_per_round
    )


@pytest.fixture(scope="module")
def crash_data(tmp_path_factory):
    return support.small_job_inputs(tmp_path_factory.mktemp("crash_data"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_in_process_job_resumes_to_the_uninterrupted_result(crash_data, tmp_path):
    """dp-fedemb's crash job on the in_process executor, SIGKILLed when round 3 is
    reported (before its checkpoint), resumes from round 2 to exactly the uninterrupted
    run's weights, ledger and history."""
    algorithm, kill_step = job_config.DP_FEDEMB, 3
    config = crash_child.CRASH_JOBS[algorithm]
    killed_dir, log_path = str(tmp_path / "killed"), str(tmp_path / "killed.log")
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_child", algorithm, *crash_data, killed_dir]
            + [str(kill_step), "in_process"],
            stdout=log,
            stderr=log,
            cwd=str(paths.REPO),
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    try:
        reference = train_job.run_train_job(
            config, *crash_data, str(tmp_path / "reference"), runtime_config=IN_PROCESS
        )
        child.wait(600)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGKILL, open(log_path).read()[-3000:]

    resumed = train_job.run_train_job(config, *crash_data, killed_dir, runtime_config=IN_PROCESS)

    assert resumed.metrics["resumed_from_round"] == kill_step - 1
    support.assert_same_trained_outputs(reference, resumed)

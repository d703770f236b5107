"""Remote TFF workers over mutual TLS, and no plaintext to a worker that is not loopback.

Two real `worker_binary` processes (on 127.0.0.1, as the runtime starts them) each sit
behind a small TLS-terminating proxy (`mtls.TlsProxy`), the test's stand-in for the
sidecar of docs/scaling.md.
"""

import dataclasses
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from beam_jobs import synthetic
from pipeline import cli
from pipeline import config as config_lib
from tests import support
from tests.tff_algorithms.federated import mtls
from tff_algorithms.federated import local_workers, runtime
from tff_algorithms.jobs import train_job

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=11)
TRAIN_IDENTITIES = 20
# Smaller than the multi-worker tests' job: what is tested is the connection.
CONFIG = dataclasses.replace(
    support.MULTI_WORKER_JOB, rounds=2, head_lr_scale=None, embedding_size=8
)
# Long enough for a TLS handshake on a loaded machine, short for one that never ends.
REJECT_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return mtls.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory, pki):
    """Two worker_binary processes, each behind its own TLS proxy: (workers, proxies)."""
    log_dir = str(tmp_path_factory.mktemp("worker_logs"))
    started: list[local_workers.LocalWorker] = []
    proxies: list[mtls.TlsProxy] = []
    try:
        for _ in range(2):
            started.append(
                local_workers.LocalWorker(log_dir, -1, taken_ports=[w.port for w in started])
            )
            proxies.append(mtls.TlsProxy(pki, started[-1].port))
        yield started, proxies
    finally:
        for proxy in proxies:
            proxy.close()
        for worker in started:
            worker.stop()


def _tls_config(
    pki: dict[str, str], addresses: tuple[str, ...], client: str = "trainer"
) -> runtime.RuntimeConfig:
    return runtime.RuntimeConfig(
        worker_addresses=addresses,
        worker_ca=pki["ca"],
        worker_cert=pki[f"{client}_cert"],
        worker_key=pki[f"{client}_key"],
    )


# --- a training round over TLS, and clients the proxy refuses ---------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


def _train(data, output_dir: str, runtime_config: runtime.RuntimeConfig) -> list[np.ndarray]:
    result = train_job.run_train_job(CONFIG, *data, output_dir, runtime_config=runtime_config)
    assert result.metrics["rounds"] == CONFIG.rounds
    return support.saved_backbone(result.saved_model_dir)


def test_two_workers_over_mutual_tls_train_the_plaintext_weights(workers, pki, data, tmp_path):
    """The same two workers, reached through their TLS proxies, train bit for bit what
    they train over plaintext loopback: TLS changes the transport, not a computation
    (and with two workers the one merge of two partial sums is order-free)."""
    local, proxies = workers
    plain = _train(
        data,
        str(tmp_path / "plain"),
        runtime.RuntimeConfig(worker_addresses=tuple(w.address for w in local)),
    )
    assert all(p.connections == 0 for p in proxies)
    tls = _train(data, str(tmp_path / "tls"), _tls_config(pki, tuple(p.address for p in proxies)))
    # Both workers served the TLS run, each through its proxy.
    assert all(p.connections >= 1 for p in proxies)
    assert len(plain) == len(tls)
    for a, b in zip(plain, tls):
        np.testing.assert_array_equal(a, b)


def _ready(channel: grpc.Channel) -> bool:
    try:
        grpc.channel_ready_future(channel).result(timeout=REJECT_TIMEOUT_S)
    except grpc.FutureTimeoutError:
        return False
    return True


def test_client_without_a_certificate_is_rejected(workers, pki):
    """TLS with the right CA but no client certificate never gets a channel, and no byte
    reaches the worker; the same channel with the trainer's certificate does."""
    proxy = workers[1][0]
    ca = Path(pki["ca"]).read_bytes()
    before = proxy.connections
    with grpc.secure_channel(
        proxy.address, grpc.ssl_channel_credentials(root_certificates=ca)
    ) as channel:
        assert not _ready(channel)
    assert proxy.connections == before
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=Path(pki["trainer_key"]).read_bytes(),
        certificate_chain=Path(pki["trainer_cert"]).read_bytes(),
    )
    with grpc.secure_channel(proxy.address, credentials) as channel:
        assert _ready(channel)


def test_runtime_with_a_certificate_from_another_ca_is_rejected(workers, pki):
    proxy = workers[1][0]
    before = proxy.connections
    config = dataclasses.replace(
        _tls_config(pki, (proxy.address,), client="rogue"), ready_timeout_s=REJECT_TIMEOUT_S
    )
    with pytest.raises(local_workers.WorkerStartError, match="not ready"):
        runtime.TffRuntime(config).start()
    assert proxy.connections == before


# --- which addresses may go without TLS, and the TLS settings' checks -------------


@pytest.mark.parametrize(
    "address",
    ["10.0.0.5:8000", "tff-worker-0.tff-worker:8000", "[2001:db8::1]:8000", "128.0.0.1:1"],
)
def test_plaintext_to_a_non_loopback_worker_is_refused_in_one_line(address):
    with pytest.raises(ValueError) as refused:
        runtime.RuntimeConfig(worker_addresses=(address,))
    message = str(refused.value)
    assert "\n" not in message and address in message
    for why_and_how in ("read the private data", "worker_ca", "allow_insecure_workers"):
        assert why_and_how in message
    runtime.RuntimeConfig(worker_addresses=(address,), allow_insecure_workers=True)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "127.3.4.5:1", "localhost:1", "[::1]:1"])
def test_plaintext_to_a_loopback_worker_is_allowed(address):
    runtime.RuntimeConfig(worker_addresses=(address,))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"worker_addresses": ("10.0.0.5:1",), "worker_ca": "ca.pem"}, "missing worker_cert"),
        ({"worker_ca": "a", "worker_cert": "b", "worker_key": "c"}, "worker_addresses"),
    ],
)
def test_tls_settings_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        runtime.RuntimeConfig(**fields)


@pytest.mark.parametrize("setting", ["worker_ca", "worker_cert", "worker_key"])
@pytest.mark.parametrize("problem", ["missing", "not PEM"])
def test_unusable_tls_file_is_one_line_naming_its_setting(pki, tmp_path, setting, problem):
    bad = tmp_path / "bad.pem"
    if problem == "not PEM":
        bad.write_bytes(b"not a certificate")
    config = dataclasses.replace(_tls_config(pki, ("10.0.0.5:1",)), **{setting: str(bad)})
    rt = runtime.TffRuntime(config)
    with pytest.raises(ValueError, match=f"^{setting} ") as refused:
        rt.start()
    assert "\n" not in str(refused.value)
    assert rt.addresses == () and not rt.local_workers


def test_pipeline_config_and_train_command_refuse_plaintext_to_a_remote_worker(tmp_path, capsys):
    with pytest.raises(ValueError, match="^config runtime: refusing plaintext"):
        config_lib.load_config(overrides=["runtime.worker_addresses=[10.0.0.5:8000]"])
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    os.mkdir(data)
    flags = ["dp-fedemb", "train", "--data", data, "--output", out]
    code = cli.main([*flags, "--workers", "10.0.0.5:8000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--allow-insecure-workers" in err[0], err
    missing = str(tmp_path / "missing.pem")
    tls_flags = ["--worker-ca", missing, "--worker-cert", missing, "--worker-key", missing]
    code = cli.main([*flags, "--workers", "10.0.0.5:8000", *tls_flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--worker-ca" in err[0], err

"""Remote TFF workers over mutual TLS, and no plaintext to a worker that is not loopback.

Two real `worker_binary` processes (on 127.0.0.1, as the runtime starts them) each sit
behind a small TLS-terminating proxy, the test's stand-in for the sidecar of
docs/scaling.md: it requires a client certificate signed by the test's CA and forwards
the decrypted bytes (gRPC's HTTP/2) to the worker's plaintext port. The certificates
are generated here with the `cryptography` package.
"""

import asyncio
import dataclasses
import datetime
import ipaddress
import os
import ssl
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from beam_jobs import synthetic
from pipeline import cli
from pipeline import config as config_lib
from tests import support
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


# --- certificates ---------------------------------------------------------------


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    extensions: list[x509.ExtensionType],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def _ca(directory: Path, stem: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = _certificate(
        stem, key, None, key, [x509.BasicConstraints(ca=True, path_length=0), usage]
    )
    return cert, key, _write(directory, stem, cert, key)[0]


def _leaf(
    directory: Path,
    stem: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str],
    purpose: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    extensions = [
        x509.BasicConstraints(ca=False, path_length=None),
        x509.ExtendedKeyUsage([purpose]),
    ]
    if names:
        extensions.append(x509.SubjectAlternativeName(names))
    return _write(directory, stem, _certificate(stem, key, ca[0], ca[1], extensions), key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """The workers' CA, the proxies' server certificate (127.0.0.1, localhost), the
    trainer's client certificate, and a client certificate from another CA."""
    directory = tmp_path_factory.mktemp("pki")
    ca = _ca(directory, "worker-ca")
    server = _leaf(
        directory,
        "worker",
        ca,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    trainer = _leaf(directory, "trainer", ca, ExtendedKeyUsageOID.CLIENT_AUTH, [])
    rogue = _leaf(
        directory, "rogue", _ca(directory, "other-ca"), ExtendedKeyUsageOID.CLIENT_AUTH, []
    )
    return {
        "ca": ca[2],
        "server_cert": server[0],
        "server_key": server[1],
        "trainer_cert": trainer[0],
        "trainer_key": trainer[1],
        "rogue_cert": rogue[0],
        "rogue_key": rogue[1],
    }


# --- the TLS-terminating proxy --------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass  # the other side went away; closing ours ends the pair
    finally:
        writer.close()


class TlsProxy:
    """Terminates mutual TLS on 127.0.0.1 and forwards the plaintext to a worker's port.

    `connections` counts clients that completed the handshake: only those reach the
    worker, so a rejected client leaves it unchanged.
    """

    def __init__(self, pki: dict[str, str], worker_port: int) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki["server_cert"], pki["server_key"])
        context.load_verify_locations(pki["ca"])
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(["h2"])  # gRPC's client insists on HTTP/2 by ALPN
        self.connections = 0
        self._worker_port = worker_port
        self._loop = asyncio.new_event_loop()
        # Failed handshakes are the expected outcome of the rejection tests; keep the log quiet.
        self._loop.set_exception_handler(lambda loop, context: None)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            worker_reader, worker_writer = await asyncio.open_connection(
                "127.0.0.1", self._worker_port
            )
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, worker_writer), _pipe(worker_reader, writer))

    async def _shutdown(self) -> None:
        self._server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory, pki):
    """Two worker_binary processes, each behind its own TLS proxy: (workers, proxies)."""
    log_dir = str(tmp_path_factory.mktemp("worker_logs"))
    started: list[local_workers.LocalWorker] = []
    proxies: list[TlsProxy] = []
    try:
        for _ in range(2):
            started.append(local_workers.LocalWorker(log_dir, -1, taken_ports=[w.port for w in started]))
            proxies.append(TlsProxy(pki, started[-1].port))
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

"""Mutual TLS for the worker tests: certificates, and the TLS-terminating proxy.

The proxy is the tests' stand-in for the sidecar of docs/scaling.md (deploy/envoy.yaml):
it requires a client certificate signed by the test's CA and forwards the decrypted
bytes (gRPC's HTTP/2) to a worker's plaintext port. It runs as a thread of the test
(`TlsProxy`), or as a process of its own in another network namespace
(`python -m tests.tff_algorithms.federated.mtls LISTEN_HOST LISTEN_PORT WORKER_PORT PKI_DIR`).
Certificates are generated with the `cryptography` package.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import signal
import ssl
import sys
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


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


def make_pki(directory: Path, server_ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, str]:
    """The workers' CA, the proxies' server certificate (`server_ips`, localhost), the
    trainer's client certificate, and a client certificate from another CA."""
    ca = _ca(directory, "worker-ca")
    names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    server = _leaf(
        directory,
        "worker",
        ca,
        ExtendedKeyUsageOID.SERVER_AUTH,
        [*names, x509.DNSName("localhost")],
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

    def __init__(
        self, pki: dict[str, str], worker_port: int, host: str = "127.0.0.1", port: int = 0
    ) -> None:
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
            asyncio.start_server(self._serve, host, port, ssl=context)
        )
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

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


def main(argv: list[str]) -> None:
    """A proxy process: LISTEN_HOST LISTEN_PORT WORKER_PORT PKI_DIR; runs until SIGTERM."""
    host, port, worker_port, directory = argv
    pki = {
        "ca": f"{directory}/worker-ca.pem",
        "server_cert": f"{directory}/worker.pem",
        "server_key": f"{directory}/worker.key",
    }
    proxy = TlsProxy(pki, int(worker_port), host, int(port))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"listening on {proxy.address}", flush=True)
    stop.wait()
    proxy.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""While `dp-fedemb train` runs a round, no other host can reach a port it listens on.

The oracle reads the kernel's own tables, independently of the runtime: every
listening TCP socket (/proc/net/tcp and tcp6, state 0A) whose inode one of the
training process tree's file descriptors holds must be bound to a loopback address,
and connecting to its port through this machine's non-loopback address is refused (on a
machine without one, the bound-address check still runs).
"""

import ipaddress
import os
import socket
import subprocess
import time
import warnings

import pytest

from beam_jobs import synthetic
from tests import support

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

_TCP_LISTEN = "0A"


def _descendants_and_self(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
        parents.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} print addresses as 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _listeners(inodes: set[str]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every listening TCP socket among `inodes`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _TCP_LISTEN and inode in inodes:
                hex_address, hex_port = local.split(":")
                found.append((_address(hex_address), int(hex_port, 16)))
    return found


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return (mapped or address).is_loopback


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine's own interfaces that is not loopback: the
    kernel's local routing table lists each as a "/32 host LOCAL" leaf."""
    with open("/proc/net/fib_trie") as f:
        lines = f.read().splitlines()
    for previous, line in zip(lines, lines[1:]):
        if line.strip() == "/32 host LOCAL":
            address = ipaddress.ip_address(previous.split()[-1])
            if not address.is_loopback:
                return str(address)
    return None


def _connect_refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def test_the_oracle_sees_a_wildcard_listener_as_open():
    """The bound-address check below can fail: a socket bound to every interface is
    found as a non-loopback listener (no external address needed)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind(("::", 0))
        server.listen()
        port = server.getsockname()[1]
        listeners = _listeners(_socket_inodes(_descendants_and_self(os.getpid())))
        assert (ipaddress.ip_address("::"), port) in listeners
        assert not all(_is_loopback(address) for address, _ in listeners)


def test_the_oracle_connects_to_a_wildcard_listener_through_the_interface_address():
    """The connection check below can fail: a wildcard listener accepts a connection on
    this machine's non-loopback address."""
    host = _non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        server.bind(("::", 0))
        server.listen()
        assert not _connect_refused(host, server.getsockname()[1])


@pytest.mark.timeout(900)
def test_training_listens_on_loopback_only(tmp_path):
    # Without a non-loopback address only the connection check is left out (said in a
    # warning): the bound addresses are read from the kernel's tables either way.
    host = _non_loopback_ipv4()
    if host is None:
        warnings.warn(
            "no non-loopback IPv4 address: connections through one not tried", stacklevel=1
        )
    data, output = str(tmp_path / "raw"), str(tmp_path / "out")
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    log_path = tmp_path / "train.log"
    command = [support.CONSOLE_SCRIPT, "train", "--data", data, "--output", output]
    with open(log_path, "wb") as log:
        training = subprocess.Popen(
            [*command, *support.train_cli_flags(rounds=4)], stdout=log, stderr=log
        )
    try:
        # Sample from the first round's report until training ends: the worker is up
        # and rounds run on it throughout.
        deadline = time.monotonic() + 600
        while b"round 1/4" not in log_path.read_bytes():
            assert training.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no round reported in time"
            time.sleep(0.1)
        samples = []
        while training.poll() is None:
            listeners = _listeners(_socket_inodes(_descendants_and_self(training.pid)))
            open_ = [(str(a), port) for a, port in listeners if not _is_loopback(a)]
            assert not open_, f"training listens on non-loopback addresses: {open_}"
            for _, port in listeners:
                if host is not None:
                    assert _connect_refused(host, port), f"{host}:{port} accepted a connection"
            samples.append(listeners)
            time.sleep(0.2)
        assert training.returncode == 0, log_path.read_text()[-3000:]
        # The tree was sampled while it ran, and it did listen (on loopback) then.
        assert any(samples), "no listener seen while training ran"
    finally:
        training.kill()
        training.wait(60)

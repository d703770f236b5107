"""TFF workers on other hosts: network namespaces, mutual TLS, a worker killed or cut off.

Each "host" is a network namespace of its own (`ip netns`), joined to the test's by a
veth pair with its own addresses (10.62.N.1 here, 10.62.N.2 there). In it run, as
docs/scaling.md and deploy/ describe a worker pod: `worker_binary --port=8001` bound to
the namespace's loopback by the runtime's loopback shim, and a TLS-terminating proxy
(`mtls`, a process of its own) on 10.62.N.2:8000 that requires the trainer's client
certificate. The trainer is this process, reaching the workers only by their addresses,
as remote workers it did not start (it cannot restart them: a lost one is dropped).

Checked: two such workers train the one-local-worker weights; a worker SIGKILLed
mid-round, or cut off mid-round (`ip link set ... down`: the connection stays open and
silent), is dropped at once or at the round's deadline and the round runs again on the
other, ending at the same weights and ledger; with `max_worker_losses` 0 a cut stops
training in one line naming the worker and the setting, and the same job re-run resumes
to the same weights and ledger. Plaintext to the workers stays refused, and their
plaintext port is unreachable from outside their namespace.

Needs root and `ip netns` (iproute2; .ci/run installs it); skipped, saying why, only
where namespaces cannot be made.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from beam_jobs import synthetic
from tests import paths, support
from tests.tff_algorithms.federated import faults, mtls
from tff_algorithms.federated import liveness, local_workers, loopback_shim, runtime
from tff_algorithms.jobs import train_job

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
# On one xdist worker: the namespaces, the data and the one-local-worker run are made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("netns_workers")]

SYNTH = synthetic.SyntheticConfig(identities=36, images_per_identity=5, seed=7)
TRAIN_IDENTITIES = 28
CONFIG = support.MULTI_WORKER_JOB
# test_multi_worker.py's tolerance: 1 and 2 workers differ by float32 summation order.
WEIGHT_TOLERANCE = 1e-5
LIVENESS = {"round_deadline_factor": 3.0, "min_round_deadline_s": 10.0}
WORKER_PORT, PROXY_PORT = 8001, 8000
# Bounds of the waits on the namespace's processes (each failure names what it waited for).
READY_BOUND_S = 120.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"dpf-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "no `ip` command (install iproute2)"
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    _ip("netns", "delete", probe)
    return None


class Host:
    """A network namespace with a veth link to this one, a worker and its TLS proxy."""

    def __init__(self, index: int, subnet: int) -> None:
        self.netns = f"dpf-{os.getpid()}-{index}"
        self.link = f"v62h{os.getpid() % 100000}{index}"  # the test's end; <= 15 chars
        peer = f"v62n{os.getpid() % 100000}{index}"
        self.ip = f"10.62.{subnet}.2"
        self.processes: list[subprocess.Popen] = []
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.netns)
        _ip("addr", "add", f"10.62.{subnet}.1/24", "dev", self.link)
        _ip("link", "set", self.link, "up")
        for args in (
            ("addr", "add", f"{self.ip}/24", "dev", peer),
            ("link", "set", peer, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("netns", "exec", self.netns, "ip", *args)

    @property
    def address(self) -> str:
        return f"{self.ip}:{PROXY_PORT}"

    def _start(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                # `ip netns exec` execs the command: this pid is the worker's, and it
                # dies with the test process.
                preexec_fn=local_workers.die_with_parent,
            )
        self.processes.append(process)
        return process

    def start(self, pki_dir: str, log_dir: Path) -> None:
        """The pod of deploy/: worker_binary on the namespace's loopback, the proxy outside."""
        self.worker = self._start(
            [local_workers.WORKER_BINARY, *local_workers.worker_flags(WORKER_PORT, -1)],
            log_dir / f"{self.netns}-worker.log",
            {"LD_PRELOAD": loopback_shim.library_path(), "TF_NUM_INTRAOP_THREADS": "1"},
        )
        self.proxy = self._start(
            [sys.executable, "-m", "tests.tff_algorithms.federated.mtls"]
            + [self.ip, str(PROXY_PORT), str(WORKER_PORT), pki_dir],
            log_dir / f"{self.netns}-proxy.log",
            {"PYTHONPATH": str(paths.REPO)},
        )
        deadline = time.monotonic() + READY_BOUND_S
        while not _accepts(self.ip, PROXY_PORT):
            for process in (self.worker, self.proxy):
                assert process.poll() is None, f"{process.args} exited: see {log_dir}"
            assert time.monotonic() < deadline, (
                f"{self.address} not listening after {READY_BOUND_S:.0f} s; logs in {log_dir}"
            )
            time.sleep(0.1)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(30)
        self.processes = []

    def delete(self) -> None:
        self.stop()
        # Deleting the namespace deletes its end of the veth pair, and with it ours.
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, timeout=30)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = _namespaces_unavailable()
    if why is not None:
        pytest.skip(f"workers on other hosts need network namespaces: {why}")
    subnet = (os.getpid() % 120) * 2
    made: list[Host] = []
    try:
        for index in range(2):
            made.append(Host(index, subnet + index))
        pki_dir = tmp_path_factory.mktemp("pki")
        mtls.make_pki(pki_dir, tuple(h.ip for h in made))
        yield made, str(pki_dir), tmp_path_factory.mktemp("host_logs")
    finally:
        for host in made:
            host.delete()


@pytest.fixture
def workers(hosts):
    """The two hosts with a fresh worker and proxy each, their links up."""
    made, pki_dir, log_dir = hosts
    for host in made:
        _ip("link", "set", host.link, "up")
        host.start(pki_dir, log_dir)
    yield made, pki_dir
    for host in made:
        host.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return support.write_partition_and_held_out(
        tmp_path_factory.mktemp("data"), SYNTH, TRAIN_IDENTITIES
    )


def _outputs(result) -> tuple[list[np.ndarray], dict]:
    with open(result.ledger_path) as f:
        return support.saved_backbone(result.saved_model_dir), json.load(f)


@pytest.fixture(scope="module")
def one_local_worker(data, tmp_path_factory):
    result = train_job.run_train_job(
        CONFIG,
        *data,
        str(tmp_path_factory.mktemp("one_local")),
        runtime_config=runtime.RuntimeConfig(local_workers=1),
    )
    return _outputs(result)


def _assert_same_outputs(expected, got) -> None:
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(expected[0], got[0]))
    assert worst <= WEIGHT_TOLERANCE, f"weights differ from one local worker's by {worst}"
    assert got[1] == expected[1]  # the same rounds charged, the same ε
    assert len(got[1]["history"]) == CONFIG.rounds


def _tls(pki_dir: str, hosts: list[Host], **settings) -> runtime.RuntimeConfig:
    return runtime.RuntimeConfig(
        worker_addresses=tuple(h.address for h in hosts),
        worker_ca=f"{pki_dir}/worker-ca.pem",
        worker_cert=f"{pki_dir}/trainer.pem",
        worker_key=f"{pki_dir}/trainer.key",
        **{**LIVENESS, **settings},
    )


class _FaultInRound2:
    """The job's progress callback: after round 1, `action` once worker 0 computes."""

    def __init__(self, host: Host, action) -> None:
        self.host = host
        self.runtime: runtime.TffRuntime | None = None
        self.fault = faults.MidRound(action)

    def __call__(self, record) -> None:
        if record["round"] == 1:
            self.runtime = runtime.current()
            self.fault.arm(self.host.worker.pid)


def test_workers_in_other_namespaces_over_tls_train_the_one_worker_weights(
    workers, data, one_local_worker, tmp_path
):
    hosts, pki_dir = workers
    for host in hosts:
        # The worker's own port is on its namespace's loopback only: only the proxy
        # reaches it; and the runtime refuses plaintext to the proxy's address.
        assert not _accepts(host.ip, WORKER_PORT)
        with pytest.raises(ValueError, match=f"refusing plaintext gRPC to worker {host.address}"):
            runtime.RuntimeConfig(worker_addresses=(host.address,))
    result = train_job.run_train_job(
        CONFIG, *data, str(tmp_path / "run"), runtime_config=_tls(pki_dir, hosts)
    )
    _assert_same_outputs(one_local_worker, _outputs(result))


def _cut(host: Host):
    return lambda: _ip("link", "set", host.link, "down")


@pytest.mark.parametrize("fault", ["killed", "cut off"])
def test_a_worker_lost_mid_round_is_dropped_and_the_round_runs_on_the_other(
    workers, data, one_local_worker, tmp_path, fault
):
    """SIGKILL closes the connection (the proxy's worker side ends); a cut link leaves
    it open and silent until the round's deadline. Either way worker 0 is dropped and
    the round runs again from the same state on worker 1: one worker's weights."""
    hosts, pki_dir = workers
    victim = hosts[0]
    action = (
        faults.signal_pid(victim.worker.pid, signal.SIGKILL) if fault == "killed" else _cut(victim)
    )
    watch = _FaultInRound2(victim, action)
    result = train_job.run_train_job(
        CONFIG,
        *data,
        str(tmp_path / "run"),
        runtime_config=_tls(pki_dir, hosts),
        progress=watch,
    )
    watch.fault.join()
    assert len(watch.runtime.worker_losses) == 1, watch.runtime.worker_losses
    assert victim.address in watch.runtime.worker_losses[0]
    assert watch.runtime.addresses == (hosts[1].address,)
    _assert_same_outputs(one_local_worker, _outputs(result))


def test_a_cut_past_max_worker_losses_stops_in_one_line_and_the_same_job_resumes(
    workers, data, one_local_worker, tmp_path
):
    hosts, pki_dir = workers
    output_dir = str(tmp_path / "run")
    watch = _FaultInRound2(hosts[0], _cut(hosts[0]))
    with pytest.raises(liveness.WorkerLostError) as stopped:
        train_job.run_train_job(
            CONFIG,
            *data,
            output_dir,
            runtime_config=_tls(pki_dir, hosts, max_worker_losses=0),
            progress=watch,
        )
    watch.fault.join()
    message = str(stopped.value)
    assert "\n" not in message
    for named in (hosts[0].address, "max_worker_losses", "DEADLINE_EXCEEDED", "resumes"):
        assert named in message, message
    _ip("link", "set", hosts[0].link, "up")
    resumed = train_job.run_train_job(
        CONFIG, *data, output_dir, runtime_config=_tls(pki_dir, hosts, max_worker_losses=0)
    )
    _assert_same_outputs(one_local_worker, _outputs(resumed))

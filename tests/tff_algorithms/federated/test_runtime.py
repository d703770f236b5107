"""The runtime owns its TFF workers: they stop on every way the parent can end."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow_federated as tff

from tests import paths, processes
from tff_algorithms.federated import local_workers, runtime

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

REPO = str(paths.REPO)
# Run as a module from the repository root: run by path, its folder (tests/) would come first
# on sys.path, where tests/tff_algorithms would hide the product package.
CHILD = "tests.runtime_child"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_child(mode: str, ignore_sigint: bool = False) -> tuple[subprocess.Popen, int, str]:
    child = subprocess.Popen(
        [sys.executable, "-m", CHILD, mode],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        # As for a background job started without job control (`cmd &` in a script).
        preexec_fn=_ignore_sigint if ignore_sigint else None,
    )
    line = child.stdout.readline()
    assert line.startswith("pid="), f"child did not report its worker: {line!r}"
    fields = dict(part.split("=", 1) for part in line.split())
    assert float(fields["sum"]) == 6.0
    return child, int(fields["pid"]), fields["log"]


@pytest.mark.parametrize(
    "mode, expected_code, ignore_sigint",
    [("normal", 0, False), ("exception", 1, False), ("normal", 0, True)],
)
def test_worker_stops_when_python_exits(mode, expected_code, ignore_sigint):
    child, worker_pid, log_path = _start_child(mode, ignore_sigint)
    # communicate() only returns when every holder of the pipe closed it: a
    # worker that kept our stdout would make this time out.
    child.communicate(timeout=120)
    assert child.returncode == expected_code
    assert _wait_gone(worker_pid), "worker_binary outlived its parent"
    assert not os.path.exists(os.path.dirname(log_path)), "temporary log dir left behind"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_worker_stops_on_termination_signal(signum):
    child, worker_pid, _ = _start_child("wait")
    child.send_signal(signum)
    child.communicate(timeout=120)
    assert child.returncode == 128 + signum
    assert _wait_gone(worker_pid)


def test_worker_dies_with_a_killed_parent():
    child, worker_pid, log_path = _start_child("wait")
    child.kill()
    child.communicate(timeout=120)
    assert _wait_gone(worker_pid), "worker_binary survived SIGKILL of its parent"
    # A killed parent cannot remove its temporary log directory; the test does.
    shutil.rmtree(os.path.dirname(log_path))


def test_worker_logs_go_to_the_configured_directory(tmp_path):
    with runtime.TffRuntime(runtime.RuntimeConfig(log_dir=str(tmp_path))) as rt:
        log_path = rt.local_workers[0].log_path
        assert _federated_sum([1.0, 2.0]) == 3.0
    assert os.path.dirname(log_path) == str(tmp_path)
    with open(log_path) as log:
        assert "worker_binary --port=" in log.readline()


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry]
    return {key.decode(): value.decode() for key, value in pairs}


@pytest.mark.parametrize("threads, expected", [(None, "1"), (3, "3"), (0, None)])
def test_local_worker_runs_ops_on_the_configured_threads(threads, expected, monkeypatch):
    """TensorFlow in the worker reads its intra-op pool size from TF_NUM_INTRAOP_THREADS;
    0 leaves the worker's environment as the parent's (TensorFlow's default)."""
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    config = (
        runtime.RuntimeConfig()
        if threads is None
        else runtime.RuntimeConfig(worker_intra_op_threads=threads)
    )
    with runtime.TffRuntime(config) as rt:
        environment = _environment(rt.local_workers[0].process.pid)
        assert _federated_sum([1.0, 2.0]) == 3.0
    assert environment.get("TF_NUM_INTRAOP_THREADS") == expected


def test_worker_logs_of_killed_runs_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """A run killed by SIGKILL cannot remove its worker-log folder; the next run does,
    keeping folders of live runs, folders a failed worker's warning named, and
    anything that holds more than worker logs."""
    monkeypatch.setattr(runtime.tempfile, "tempdir", str(tmp_path))
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(finished.stdout)
    folders = {
        "killed": f"dp_fedemb_tff_{dead}_a1b2",
        "live": f"dp_fedemb_tff_{os.getpid()}_c3d4",
        "kept": f"dp_fedemb_tff_kept_{dead}_e5f6",
        "other": f"dp_fedemb_tff_{dead}_g7h8",
    }
    for name in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "worker_1234.log").write_text("log")
    (tmp_path / folders["other"] / "notes.txt").write_text("mine")
    with runtime.TffRuntime():
        assert _federated_sum([1.0, 2.0]) == 3.0
    left = set(os.listdir(tmp_path))
    assert folders["killed"] not in left
    assert {folders["live"], folders["kept"], folders["other"]} <= left
    # This run stopped cleanly: its own folder is gone too.
    assert not [
        n for n in left if n.startswith(f"dp_fedemb_tff_{os.getpid()}_") and n != folders["live"]
    ]


def test_leak_detector_finds_an_orphaned_worker(tmp_path):
    """The session-end check must be able to fail: an unowned worker is found."""
    marker = "leak-detector-self-test"
    env = dict(os.environ, **{processes.MARKER_ENV: marker})
    orphan = subprocess.Popen(
        [local_workers.WORKER_BINARY, "--port=0"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while orphan.pid not in processes.worker_binaries_with_marker(marker):
            assert time.monotonic() < deadline, "detector did not see the worker"
            time.sleep(0.1)
    finally:
        orphan.kill()
        orphan.wait()
    assert processes.worker_binaries_with_marker(marker) == []


@tff.federated_computation(tff.FederatedType(np.float32, tff.CLIENTS))
def _federated_sum(values):
    return tff.federated_sum(values)


def test_two_remote_workers_give_the_one_worker_result(tmp_path):
    values = [float(v) for v in range(1, 11)]
    workers = [local_workers.LocalWorker(str(tmp_path), -1) for _ in range(2)]
    try:
        with runtime.TffRuntime(runtime.RuntimeConfig(worker_addresses=(workers[0].address,))):
            one = _federated_sum(values)
        addresses = tuple(w.address for w in workers)
        with runtime.TffRuntime(runtime.RuntimeConfig(worker_addresses=addresses)) as rt:
            assert rt.addresses == addresses
            two = _federated_sum(values)
        # Connecting never stops workers that someone else started.
        assert all(w.process.poll() is None for w in workers)
    finally:
        for w in workers:
            w.stop()
    assert one == two == sum(values)


def test_stopping_a_runtime_reinstates_the_one_started_before():
    with runtime.TffRuntime() as outer:
        with runtime.TffRuntime() as inner:
            assert tff.framework.get_context_stack().current is inner._context
            assert _federated_sum([1.0]) == 1.0
        assert tff.framework.get_context_stack().current is outer._context
        assert _federated_sum([2.0]) == 2.0


def test_computations_fail_loudly_once_no_runtime_runs():
    child, _, _ = _start_child("stopped")
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 3
    assert "refused: the TFF runtime was stopped" in out


@pytest.mark.parametrize("address", ["localhost", ":80", "host:port"])
def test_bad_worker_address_is_rejected(address):
    with pytest.raises(ValueError, match="host:port"):
        runtime.RuntimeConfig(worker_addresses=(address,))


@pytest.mark.parametrize("mode, expected_code", [("session", 0), ("session-exception", 1)])
def test_session_starts_and_stops_a_runtime_when_none_is_active(mode, expected_code):
    child, worker_pid, log_path = _start_child(mode)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == expected_code
    # Stopped when the block ended (exit code of SIGINT), before the interpreter exits.
    assert "after active=None exit=-2" in out, out
    assert _wait_gone(worker_pid)
    assert not os.path.exists(os.path.dirname(log_path)), "temporary log dir left behind"


def test_session_reuses_the_active_runtime_and_leaves_it_running(tff_runtime):
    for config in (None, runtime.RuntimeConfig()):
        with runtime.session(config, handle_signals=False) as rt:
            assert rt is tff_runtime
            assert _federated_sum([2.0]) == 2.0
    assert runtime.active() is tff_runtime
    assert tff_runtime.local_workers[0].process.poll() is None


def test_session_nests_asked_for_workers_over_the_active_runtime(tff_runtime):
    with runtime.session(runtime.RuntimeConfig(local_workers=2)) as nested:
        assert nested is not tff_runtime
        workers = [w.process for w in nested.local_workers]
        assert len(workers) == 2
        assert tff.framework.get_context_stack().current is nested._context
        assert _federated_sum([1.0, 2.0]) == 3.0
    assert all(w.poll() is not None for w in workers), "nested workers outlived the block"
    assert runtime.active() is tff_runtime
    assert tff.framework.get_context_stack().current is tff_runtime._context


def test_session_that_fails_to_start_starts_nothing():
    before = runtime.active()
    bad_tls = runtime.RuntimeConfig(
        worker_addresses=("127.0.0.1:1",),
        worker_ca="/nonexistent/ca.pem",
        worker_cert="/nonexistent/cert.pem",
        worker_key="/nonexistent/key.pem",
    )
    with pytest.raises(ValueError, match="worker_ca /nonexistent/ca.pem"):
        with runtime.session(bad_tls, handle_signals=False):
            pass
    assert runtime.active() is before

"""Runs one benchmark's quick mode through `bench.run_all` in a child process, for the
end-to-end tests of tests/bench."""

import os
import signal
import subprocess
import sys

from tests import paths

# Below the session's pytest-timeout, so the benchmark is stopped here, not orphaned.
TIMEOUT_S = 800


def run_quick(name: str, results_dir: str) -> None:
    """`python -m bench.run_all --quick --only NAME`, results in RESULTS_DIR; fails the
    test with the end of its output if it exits non-zero."""
    # Its own session, so that a timeout ends the benchmark's children (measuring
    # processes, TFF workers) too.
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.run_all",
            "--quick",
            "--only",
            name,
            "--results-dir",
            results_dir,
        ],
        cwd=str(paths.REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, output[-3000:]

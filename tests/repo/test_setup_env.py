"""`make setup` (scripts/setup_env.sh): clear failure without Python 3.10, no-op when current."""

import os
import subprocess

import pytest

from tests import paths

REPO = str(paths.REPO)
SCRIPT = os.path.join(REPO, "scripts", "setup_env.sh")


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_wrong_python_is_one_clear_line():
    result = _run(dict(os.environ, PYTHON="/usr/bin/false"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "setup: PYTHON=/usr/bin/false is not a working Python 3.10"
    ]


def test_missing_python_310_says_what_to_install(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYENV_ROOT": str(tmp_path / "no-pyenv"),
    }
    if any(os.path.exists(p) for p in ("/usr/bin/python3.10", "/usr/local/bin/python3.10")):
        pytest.skip("a system-wide Python 3.10 exists, so setup would find it")
    result = _run(env)
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert "Python 3.10 not found" in line and "PYTHON=" in line


def test_second_setup_reuses_the_environment():
    first = _run(dict(os.environ))
    assert first.returncode == 0, first.stderr
    second = _run(dict(os.environ))
    assert second.returncode == 0
    assert "installing" not in second.stderr, second.stderr

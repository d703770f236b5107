"""scripts/mutation_check.py's mutants still match the source (the check itself, which
runs the tests under each fault, is `make mutation-check`, run by CI), and the check's
parallel runs on a toy repository."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests import paths

REPO = str(paths.REPO)
_SPEC = importlib.util.spec_from_file_location(
    "mutation_check", os.path.join(REPO, "scripts", "mutation_check.py")
)
mutation_check = importlib.util.module_from_spec(_SPEC)
sys.modules["mutation_check"] = mutation_check  # dataclasses look their module up there
_SPEC.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_changes_one_exact_snippet_of_its_file(mutant):
    with open(os.path.join(REPO, mutant.path)) as f:
        source = f.read()
    assert source.count(mutant.original) == 1, f"{mutant.name}: update its snippet"
    assert mutant.replacement != mutant.original
    # The faulty file still compiles: a mutant must be caught by a test, not by a
    # syntax error at import.
    compile(source.replace(mutant.original, mutant.replacement), mutant.path, "exec")
    assert all(
        re.fullmatch(r"tests/(\w+/)*test_\w+\.py::\w+(\[[^\]]+\])?", t) for t in mutant.tests
    )


def test_mutants_have_unique_names_and_cover_every_invariant_family():
    names = [m.name for m in mutation_check.MUTANTS]
    assert len(names) == len(set(names))
    # The list: clip of every mechanism, noise scale, accounting sensitivity,
    # budget refusal, dedup verification and its copy evidence.
    for family in (
        "aggregator-gaussian-clip",
        "aggregator-tree-clip",
        "user-dp-sgd-clip-per-user-tape",
        "logit-dp-pair-clip",
        "fdml-row-clip",
        "fdml-gradient-clip",
        "dplc-centers-clip",
        "aggregator-gaussian-noise-scale",
        "accounting-substitute-one-sensitivity",
        "tree-sensitivity-single-tree",
        "budget-refusal",
        "dedup-verification",
        "dedup-shared-noise",
        "dedup-jpeg-reencode",
    ):
        assert family in names, family


# --- the check itself, on a toy repository (seconds: pytest is its only preload) -------

_TOY_VALUES = "A = 1\nB = 2\nC = 3\nD = 4\nE = 5\n"
_TOY_TESTS = """import os
import time


def _values():
    from toy import values

    return values


def _values_later():
    time.sleep(0.3)  # a mutant started beside this one has written its fault by now
    return _values()


def test_a():
    assert _values_later().A == 1


def test_b():
    assert _values_later().B == 2


def test_c():
    assert _values().C == 3


def test_x():
    from toy import other

    assert other.X == 7


def test_slow():
    values = _values()
    if (values.D, values.E) != (4, 5):  # under a fault: be a run still going at SIGTERM
        with open(os.path.join(os.environ["TOY_PIDS"], str(os.getpid())), "w"):
            pass
        time.sleep(60)
"""
_DRIVER = """import importlib.util, json, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("mutation_check", sys.argv[1])
mutation_check = importlib.util.module_from_spec(spec)
sys.modules["mutation_check"] = mutation_check
spec.loader.exec_module(mutation_check)
signal.signal(signal.SIGTERM, mutation_check._terminated)  # as main() does
mutants = [mutation_check.Mutant(*fields) for fields in json.loads(sys.argv[4])]
sys.exit(mutation_check.check(
    mutants, fork=True, jobs=int(sys.argv[3]), repo=Path(sys.argv[2]), preload=("pytest",)
))
"""
_T = "tests/test_toy.py::"
# a and b fault the same file: each one's first test fails if it sees the other's fault.
_TOY_MUTANTS = (
    ("a", "toy/values.py", "A = 1", "A = 10", (_T + "test_b", _T + "test_a")),
    ("b", "toy/values.py", "B = 2", "B = 20", (_T + "test_a", _T + "test_b")),
    ("c-survives", "toy/values.py", "C = 3", "C = 1 + 2", (_T + "test_c",)),
    ("x", "toy/other.py", "X = 7", "X = 8", (_T + "test_x",)),
)
_SLOW_MUTANTS = (
    ("slow-d", "toy/values.py", "D = 4", "D = 40", (_T + "test_slow",)),
    ("slow-e", "toy/values.py", "E = 5", "E = 50", (_T + "test_slow",)),
)


@pytest.fixture(scope="module")
def toy_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("toy_repo")
    (repo / "toy").mkdir()
    (repo / "tests").mkdir()
    (repo / "toy" / "__init__.py").write_text("")
    (repo / "toy" / "values.py").write_text(_TOY_VALUES)
    (repo / "toy" / "other.py").write_text("X = 7\n")
    (repo / "tests" / "test_toy.py").write_text(_TOY_TESTS)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def _driver(repo, jobs, mutants, env=()):
    # No plugin autoload: hypothesis's alone would take seconds in every toy run.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **dict(env)}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _DRIVER,
            os.path.join(REPO, "scripts", "mutation_check.py"),
            str(repo),
            str(jobs),
            json.dumps(mutants),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture(scope="module")
def toy_runs(toy_repo):
    """{jobs: (exit status, the mutants' lines without their times)} for 1 and 2 jobs."""
    runs = {}
    for jobs in (1, 2):
        out, _ = _driver(toy_repo, jobs, _TOY_MUTANTS).communicate(timeout=120)
        runs[jobs] = (out, [re.sub(r" \(\d+ s\)$", "", x) for x in out.splitlines()])
    return runs


def _mutant_lines(lines):
    return [x for x in lines if x.startswith(("  caught", "  SURVIVED", "  ERROR"))]


def test_two_jobs_give_the_same_verdicts_in_the_same_order_as_one(toy_runs):
    assert "1 at once" in toy_runs[1][0] and "2 at once" in toy_runs[2][0]
    one, two = _mutant_lines(toy_runs[1][1]), _mutant_lines(toy_runs[2][1])
    assert one == two
    assert [x.split()[1].rstrip(":") for x in two] == [m[0] for m in _TOY_MUTANTS]


def test_parallel_mutants_of_one_file_do_not_see_each_others_fault(toy_runs):
    # a and b run at once; in a shared copy each would fail first on the other's fault.
    lines = toy_runs[2][1]
    assert "  caught   a by tests/test_toy.py::test_a" in lines, toy_runs[2][0]
    assert "  caught   b by tests/test_toy.py::test_b" in lines, toy_runs[2][0]


def test_a_survivor_fails_the_check_with_its_name_under_two_jobs(toy_runs):
    out, lines = toy_runs[2]
    assert "  SURVIVED c-survives: toy/values.py" in lines, out
    assert lines[-1].startswith("mutation check FAILED"), out
    assert "no test catches c-survives; runs in error: none" in lines[-1], out


def test_sigterm_kills_the_runs_in_flight(toy_repo, tmp_path):
    driver = _driver(toy_repo, 2, _SLOW_MUTANTS, env={"TOY_PIDS": str(tmp_path)})
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and driver.poll() is None:
        assert time.monotonic() < deadline, "the two slow runs never started"
        time.sleep(0.1)
    pids = [int(name) for name in os.listdir(tmp_path)]
    assert len(pids) == 2, driver.communicate()[0]
    driver.terminate()
    assert driver.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
            os.kill(pid, 0)

"""The algorithm registry (tff_algorithms/algorithms/): one place declares each algorithm.

An algorithm registered from this file alone trains through `dp-fedemb train`; no
product module outside the registry compares against an algorithm's name or tests its
mechanism (privacy/ and pipeline/ never test which algorithm they serve); the
registry is TensorFlow-free and every registered trainer resolves.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from beam_jobs import synthetic
from pipeline import cli
from tests import paths, support
from tff_algorithms import algorithms
from tff_algorithms.algorithms import rules
from tff_algorithms.base import job_files
from tff_algorithms.config import job_config

REPO = paths.REPO
# The product packages, and the one place inside them where names are declared.
PRODUCT_PACKAGES = ("beam_jobs", "tff_algorithms", "pipeline")
REGISTRY_PACKAGE = REPO / "tff_algorithms" / "algorithms"

# Lists of names that a module tests membership in; job_config as modules import it.
NAME_LISTS = ("ALGORITHMS", "ALGORITHM_RECIPES")
JOB_CONFIG = ("job_config", "job_config_lib")

TEST_ALGORITHM = "test-oracle"
# Its own recipe over the private one: one epoch, no noise to configure (not private).
TEST_RECIPE = {
    "algorithm": TEST_ALGORITHM,
    "rounds": 1,
    "target_epsilon": None,
    "server_learning_rate": 0.05,
    "server_momentum": 0.9,
    "evaluate_every": 0,
}


def _test_algorithm() -> algorithms.Algorithm:
    # The centralized oracle's trainer under another name, recipe and summary.
    return algorithms.Algorithm(
        name=TEST_ALGORITHM,
        summary="test-only oracle registered by tests/tff_algorithms/algorithms/test_registry.py",
        private=False,
        trainer="tff_algorithms.algorithms.centralized.training:train_centralized",
        accounting_rule=rules.every_user_accounting,
        mechanism=None,
        recipe=TEST_RECIPE,
        rounds_are="test-only epochs",
    )


@pytest.fixture
def test_algorithm():
    spec = algorithms.register(_test_algorithm())
    yield spec
    algorithms.unregister(TEST_ALGORITHM)


def test_importing_the_registry_and_job_config_imports_no_tensorflow():
    code = (
        "import sys, tff_algorithms.algorithms, tff_algorithms.config.job_config, "
        "tff_algorithms.config.recipes\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'tensorflow_federated', 'keras'))\n"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout[:500]


def test_every_algorithm_is_registered_once_with_a_trainer_that_resolves():
    assert algorithms.names() == (
        "dp-fedemb",
        "dp-fedavg",
        "dp-ftrl-fedemb",
        "centralized",
        "logit-dp",
        "fdml",
        "dp-sgd-centralized",
        "dp-last-layer",
    )
    for name in algorithms.names():
        assert callable(algorithms.get(name).load_trainer()), name


def test_a_duplicate_name_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^algorithm 'fdml' is already registered; choose"):
        algorithms.register(
            algorithms.Algorithm(
                name="fdml",
                summary="a second fdml",
                private=False,
                trainer="tff_algorithms.algorithms.centralized.training:train_centralized",
                accounting_rule=rules.every_user_accounting,
                mechanism=None,
            )
        )
    assert algorithms.get("fdml") is algorithms.fdml.FDML


def test_an_unknown_name_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError) as raised:
        job_config.TrainJobConfig(algorithm="dp-fedem")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("algorithm must be one of (")
    assert "'dp-last-layer'), got 'dp-fedem'; did you mean dp-fedemb?" in message
    with pytest.raises(ValueError, match="algorithm must be one of"):
        job_config.TrainJobConfig(algorithm=["dp-fedemb"])


def test_a_trainer_must_name_module_and_function():
    with pytest.raises(ValueError, match="trainer must be 'module:function'"):
        algorithms.Algorithm(
            name="broken",
            summary="",
            private=False,
            trainer="tff_algorithms.jobs.train_job",
            accounting_rule=rules.every_user_accounting,
            mechanism=None,
        )


def _names_compared(tree: ast.AST, known: set[str], constants: set[str]) -> list[int]:
    """Lines where an algorithm's name (literal, or a constant holding it) is compared,
    matched or used as a dict key: a branch on the algorithm."""

    def names_one(node: ast.AST | None) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in known
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_one(element) for element in node.elts)
        if isinstance(node, ast.Name):
            return node.id in constants or node.id.endswith(NAME_LISTS)
        if isinstance(node, ast.Attribute):
            # job_config.FDML is a name; accounting_spec.Mechanism.FDML is a mechanism.
            of_job_config = isinstance(node.value, ast.Name) and node.value.id in JOB_CONFIG
            return (of_job_config and node.attr in constants) or node.attr.endswith(NAME_LISTS)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        elif isinstance(node, ast.Dict):
            operands = list(node.keys)
        else:
            continue
        if any(names_one(operand) for operand in operands):
            lines.append(node.lineno)
    return lines


def _modules_outside_the_algorithms():
    """(path, parsed module) of every product module outside tff_algorithms/algorithms/."""
    for package in PRODUCT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if REGISTRY_PACKAGE not in path.parents:
                yield path, ast.parse(path.read_text(), str(path))


def test_no_module_outside_the_registry_branches_on_an_algorithm_name():
    known = set(algorithms.names())
    # The name constants other code configures jobs with (job_config.DP_FEDEMB, ...).
    constants = {
        attribute
        for attribute, value in vars(job_config).items()
        if isinstance(value, str) and value in known
    }
    assert {"DP_FEDEMB", "CENTRALIZED", "FDML"} <= constants
    branches = [
        f"{path.relative_to(REPO)}:{line}"
        for path, tree in _modules_outside_the_algorithms()
        for line in _names_compared(tree, known, constants)
    ]
    assert not branches, f"algorithm-name branches outside the registry: {branches}"


def test_the_scan_finds_a_branch_on_a_name():
    # The scan above would pass on anything if it matched nothing.
    source = (
        "if config.algorithm == 'fdml': pass\n"
        "if a in (DP_FEDEMB, DP_FEDAVG): pass\n"
        "if b not in job_config.PRIVATE_ALGORITHMS: pass\n"
        "ROUNDS = {job_config_lib.CENTRALIZED: 'epochs'}\n"
        "if config.algorithm == other.algorithm: pass\n"
        "if spec.mechanism is Mechanism.FDML: pass\n"
    )
    constants = {"DP_FEDEMB", "CENTRALIZED", "FDML"}
    lines = _names_compared(ast.parse(source), set(algorithms.names()), constants)
    assert lines == [1, 2, 3, 4]


# Mechanisms named for one algorithm (issue 64): only the algorithm's own package, and the
# one table that declares each release (accounting_spec.RELEASES), may name them.
ALGORITHM_MECHANISMS = {"LOGIT_DP": "logit_dp", "FDML": "fdml"}


def _mechanisms_tested(tree: ast.AST) -> list[int]:
    """Lines where an algorithm's mechanism (`Mechanism.FDML`, or its value) is compared
    or tested for membership: a branch on which algorithm a module serves."""

    def names_one(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in ALGORITHM_MECHANISMS or names_one(node.value)
        if isinstance(node, ast.Constant):
            return node.value in ALGORITHM_MECHANISMS.values()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names_one(element) for element in node.elts)
        return False

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(
            names_one(operand) for operand in [node.left, *node.comparators]
        ):
            lines.append(node.lineno)
    return lines


def test_privacy_and_pipeline_never_test_which_algorithm_they_serve():
    branches = [
        f"{path.relative_to(REPO)}:{line}"
        for path, tree in _modules_outside_the_algorithms()
        for line in _mechanisms_tested(tree)
    ]
    assert not branches, f"tests of an algorithm's mechanism outside its package: {branches}"


def test_the_scan_finds_a_test_of_a_mechanism():
    source = (
        "if spec.mechanism is Mechanism.FDML: pass\n"
        "if spec.mechanism in (Mechanism.DPSGD, accounting_spec.Mechanism.LOGIT_DP): pass\n"
        "if value['mechanism'] == accounting_spec.Mechanism.FDML.value: pass\n"
        "if spec['mechanism'] == 'logit_dp': pass\n"
        "if spec.mechanism is Mechanism.DPFTRL: pass\n"
        "LABELS = {Mechanism.FDML: 'x'}\n"
    )
    assert _mechanisms_tested(ast.parse(source)) == [1, 2, 3, 4]


@pytest.mark.slow
def test_an_algorithm_registered_by_a_test_trains_through_the_train_command(
    test_algorithm, tmp_path, capsys
):
    data, output = str(tmp_path / "raw"), str(tmp_path / "out")
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    code = cli.main(
        [
            "dp-fedemb",
            "train",
            "--data",
            data,
            "--output",
            output,
            f"--algorithm={TEST_ALGORITHM}",
            "--embedding-size=16",
            "--batch-size=16",
            "--validation-fraction=0.2",
            "--test-fraction=0.2",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    metrics = json.loads(Path(output, job_files.METRICS_FILE).read_text())
    assert metrics["algorithm"] == TEST_ALGORITHM
    # Its recipe (one round, its learning rate), its summary, its rounds.
    assert metrics["rounds"] == 1 and metrics["config"]["server_learning_rate"] == 0.05
    assert metrics["private"] is False and metrics["epsilon"] is None
    assert metrics["privacy"] == f"non-private: {test_algorithm.summary}"
    assert metrics["rounds_are"] == "test-only epochs"
    assert set(metrics["recall_at_far"]) == {"0.1", "0.01", "0.001"}
    assert os.path.exists(os.path.join(output, "saved_model", "saved_model.pb"))


def test_the_canary_audit_refuses_an_algorithm_it_cannot_audit(tmp_path):
    from tff_algorithms.jobs import audit

    config = job_config.TrainJobConfig(algorithm=job_config.DP_FEDAVG)
    with pytest.raises(ValueError, match=r"^the canary audit runs dp-fedemb, got dp-fedavg$"):
        audit.run_canary_audit(None, config, str(tmp_path), guesses_per_side=1)


def test_the_train_command_offers_what_is_registered_when_it_checks(test_algorithm, capsys):
    code = cli.main(["dp-fedemb", "train", "--data=x", "--output=y", "--algorithm=test-orcle"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(lines) == 1, lines
    assert "--algorithm must be one of dp-fedemb, " in lines[0]
    assert lines[0].endswith(
        f"dp-last-layer, {TEST_ALGORITHM}, got 'test-orcle'; did you mean {TEST_ALGORITHM}?"
    ), lines[0]

"""scripts/check_bazel_targets.py on small repositories: passes when BUILD files match
the test files and imports, names each kind of drift otherwise."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import paths

REPO = str(paths.REPO)
CHECKER = os.path.join(REPO, "scripts", "check_bazel_targets.py")

TESTS_BUILD = """\
load("//tools/bazel:defs.bzl", "dp_py_test")

MAKE_TEST_ONLY = ["test_local.py"]

py_library(
    name = "test_support",
    srcs = ["__init__.py", "conftest.py", "helpers.py"],
    deps = ["//alpha"],
)

dp_py_test(
    name = "test_alpha",
    deps = ["//alpha"],
)

dp_py_test(
    name = "test_beta",
    data = ["fixture.txt", "//:settings.ini"],
    deps = ["//beta"],
)
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two packages (beta imports alpha), three test files, matching BUILD files."""
    _write(
        tmp_path,
        {
            "settings.ini": "",
            "alpha/__init__.py": "",
            "alpha/core.py": "import os\n",
            "alpha/BUILD": 'py_library(name = "alpha", srcs = glob(["**/*.py"]))\n',
            "beta/__init__.py": "",
            "beta/uses_alpha.py": "from alpha import core\n",
            "beta/BUILD": 'py_library(name = "beta", srcs = glob(["*.py"]), deps = ["//alpha"])\n',
            "tests/__init__.py": "",
            "tests/conftest.py": "def fixture():\n    import alpha.core\n",
            "tests/helpers.py": "",
            "tests/fixture.txt": "",
            "tests/test_alpha.py": "from alpha import core\nfrom tests import helpers\n",
            "tests/test_beta.py": "def test_late_import():\n    import beta.uses_alpha\n",
            "tests/test_local.py": "import subprocess\n",
            "tests/BUILD": TESTS_BUILD,
        },
    )
    return tmp_path


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, CHECKER, str(root)], capture_output=True, text=True, timeout=60
    )


def _problems(root: Path) -> list[str]:
    result = _check(root)
    assert result.returncode == 1, result.stdout
    return result.stderr.strip().splitlines()


def test_matching_build_files_pass(repo):
    result = _check(repo)
    assert result.returncode == 0, result.stderr
    assert "2 test targets match" in result.stdout and "(1 in MAKE_TEST_ONLY)" in result.stdout


def test_test_file_without_target_is_named_with_the_stanza_to_add(repo):
    _write(repo, {"tests/test_gamma.py": "import beta\nimport alpha.core\n"})
    assert _problems(repo) == [
        "check_bazel_targets: tests/test_gamma.py: no target; add to tests/BUILD: "
        'dp_py_test(name = "test_gamma", deps = ["//alpha", "//beta"])'
    ]


def test_a_test_file_in_a_folder_is_a_target_named_by_its_path(repo):
    # Test folders mirror the packages: tests/beta/test_delta.py is target beta/test_delta,
    # and a test module another test imports from a folder must be in :test_support.
    _write(
        repo,
        {
            "tests/beta/__init__.py": "",
            "tests/beta/test_delta.py": "import beta\nfrom tests.beta import test_epsilon\n",
            "tests/beta/test_epsilon.py": "",
        },
    )
    assert _problems(repo) == [
        "check_bazel_targets: tests/beta/test_delta.py: no target; add to tests/BUILD: "
        'dp_py_test(name = "beta/test_delta", deps = ["//beta"])',
        "check_bazel_targets: tests/beta/test_epsilon.py: no target; add to tests/BUILD: "
        'dp_py_test(name = "beta/test_epsilon")',
    ]
    build = repo / "tests" / "BUILD"
    targets = 'dp_py_test(name = "beta/test_delta", deps = ["//beta"])\n'
    build.write_text(build.read_text() + targets + 'dp_py_test(name = "beta/test_epsilon")\n')
    assert _problems(repo) == [
        "check_bazel_targets: tests/BUILD: beta/test_delta imports tests/beta/test_epsilon.py, "
        "not in :test_support srcs"
    ]


def test_target_of_a_deleted_test_file_is_named(repo):
    (repo / "tests" / "test_beta.py").unlink()
    [problem] = _problems(repo)
    assert "target 'test_beta' names missing file tests/test_beta.py" in problem


def test_missing_data_file_is_named(repo):
    (repo / "settings.ini").unlink()
    [problem] = _problems(repo)
    assert "target 'test_beta' has data '//:settings.ini', no such file" in problem


def test_undeclared_package_import_in_a_test_is_named(repo):
    # An import inside a function counts as much as one at the top.
    _write(repo, {"tests/test_beta.py": "def test_x():\n    from alpha import core\n"})
    [problem] = _problems(repo)
    assert problem.endswith("test_beta imports alpha but deps lack //alpha")


def test_module_run_with_python_dash_m_counts_as_an_import(repo):
    _write(
        repo,
        {"tests/test_beta.py": 'ARGS = ["python", "-m", "alpha.core"]\nimport beta\n'},
    )
    [problem] = _problems(repo)
    assert problem.endswith("test_beta imports alpha but deps lack //alpha")


def test_helper_module_outside_test_support_is_named(repo):
    _write(
        repo,
        {"tests/other.py": "", "tests/test_alpha.py": "import alpha\nfrom tests import other\n"},
    )
    [problem] = _problems(repo)
    assert problem.endswith("test_alpha imports tests/other.py, not in :test_support srcs")


def test_test_module_a_conftest_fixture_imports_must_be_in_test_support(repo):
    _write(repo, {"tests/conftest.py": "def fixture():\n    from tests import test_alpha\n"})
    [problem] = _problems(repo)
    assert problem.endswith("conftest.py imports tests/test_alpha.py, not in :test_support srcs")


def test_library_importing_an_undeclared_package_is_named(repo):
    _write(repo, {"alpha/cycle.py": "import beta\n"})
    [problem] = _problems(repo)
    assert problem == "check_bazel_targets: alpha/BUILD: imports beta but deps lack //beta"


def test_package_without_build_file_is_named(repo):
    _write(repo, {"gamma/__init__.py": ""})
    [problem] = _problems(repo)
    assert problem == "check_bazel_targets: gamma/: Python package without a BUILD file"


def test_file_both_excluded_and_targeted_is_named(repo):
    build = repo / "tests" / "BUILD"
    build.write_text(build.read_text().replace('["test_local.py"]', '["test_alpha.py"]'))
    problems = _problems(repo)
    assert any("test_alpha.py is both a target and in MAKE_TEST_ONLY" in p for p in problems)
    assert any(
        p.startswith("check_bazel_targets: tests/test_local.py: no target") for p in problems
    )

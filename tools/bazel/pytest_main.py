"""Entry point of every `dp_py_test`: runs one test file under pytest.

Bazel puts the declared libraries in the test's runfiles tree, first on sys.path.
The .venv also has the project installed in editable mode, and its import hook
would quietly load a package that a target forgot to declare from the source
checkout; dropping that hook makes a missing dep fail the target instead.
"""

import os
import sys

import pytest

# The module that setuptools' editable install generates for this distribution.
EDITABLE_FINDER_PREFIX = "__editable___dp_fedemb_"


def drop_editable_finder() -> None:
    sys.meta_path[:] = [
        finder
        for finder in sys.meta_path
        if not getattr(finder, "__module__", "").startswith(EDITABLE_FINDER_PREFIX)
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: pytest_main.py TEST_FILE", file=sys.stderr)
        return 2
    drop_editable_finder()
    # Each Bazel test gets its own TEST_TMPDIR; keeping pytest's tmp_path and every
    # tempfile (also in subprocesses) there lets test targets run side by side.
    test_tmpdir = os.environ["TEST_TMPDIR"]
    os.environ["TMPDIR"] = test_tmpdir
    pytest_args = [
        argv[0],
        "-p",
        "no:cacheprovider",
        f"--basetemp={os.path.join(test_tmpdir, 'pytest')}",
    ]
    xml_output = os.environ.get("XML_OUTPUT_FILE")
    if xml_output:
        pytest_args.append(f"--junitxml={xml_output}")
    return int(pytest.main(pytest_args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

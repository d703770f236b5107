"""`dp_py_test`: one test file, tests/<folder>/test_<x>.py, run by pytest as a Bazel py_test.

scripts/check_bazel_targets.py reads tests/BUILD without Bazel, so call this
macro there with literal arguments only.
"""

def dp_py_test(name, deps = [], data = [], timeout = "long", tags = []):
    """A py_test named after its file, tests/<name>.py, run under pytest.

    Args:
      name: the test file's path under tests/ without `.py` (`beam_jobs/test_schema`).
      deps: the project libraries the file imports (//tff_algorithms, ...).
      data: files the test reads or runs beside its own.
      timeout: Bazel's limit for the whole file: "long" is 900 s, pytest.ini's
        limit for one test; "eternal" (3600 s) for files of end-to-end runs.
      tags: Bazel tags.
    """
    src = name + ".py"
    native.py_test(
        name = name,
        srcs = [src, "//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = ["$(location %s)" % src],
        deps = deps + [":test_support"],
        data = data + ["//:pytest.ini"],
        python_version = "PY3",
        srcs_version = "PY3",
        size = "medium",
        timeout = timeout,
        tags = tags,
    )

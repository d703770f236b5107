"""Repository rule: the project's .venv interpreter as Bazel's Python 3 toolchain.

The tests import TensorFlow, TFF, Beam and TFX from the locked environment that
`make setup` builds from requirements/lock.txt, so Bazel runs them with that
interpreter, not a hermetic one. The interpreter is named by its path inside
.venv (not the file its symlink points to): Python finds pyvenv.cfg, and with it
the venv's site-packages, next to the path it was started as.
"""

_PYTHON_VERSION = "3.10"

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "python3",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":python3",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
"""

def _venv_python_impl(rctx):
    workspace_root = rctx.path(Label("//:WORKSPACE")).dirname
    interpreter = rctx.path("%s/.venv/bin/python" % workspace_root)
    if not interpreter.exists:
        fail("%s does not exist: run `make setup` first" % interpreter)
    probe = rctx.execute([
        interpreter,
        "-c",
        "import sys; print('%d.%d' % sys.version_info[:2])",
    ])
    version = probe.stdout.strip()
    if probe.return_code != 0 or version != _PYTHON_VERSION:
        fail("%s is not a working Python %s (got %r): run `make setup`" % (
            interpreter,
            _PYTHON_VERSION,
            version or probe.stderr.strip(),
        ))
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)
    rctx.file("BUILD", _BUILD.format(interpreter = interpreter))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    # Re-evaluated on every Bazel server start, so a rebuilt .venv is picked up.
    local = True,
)

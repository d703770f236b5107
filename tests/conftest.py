"""Session-wide test fixtures and the worker_binary leak check.

Every process started by this test session (the TFF runtime's workers, CLI
subprocesses and their workers) inherits `DP_FEDEMB_TEST_SESSION`, so at the end
we can find any `worker_binary` this session left behind, including orphans that
were re-parented to init, without confusing them with other sessions' workers.
"""

import os
import sys
import uuid

import pytest

from tests import processes

SESSION_MARKER = f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ[processes.MARKER_ENV] = SESSION_MARKER


@pytest.fixture(scope="session")
def tff_runtime():
    """One owned local TFF worker shared by the tests that run computations."""
    from tff_algorithms.federated import runtime

    rt = runtime.start(runtime.RuntimeConfig(), handle_signals=False)
    yield rt
    runtime.stop()


@pytest.fixture(scope="session")
def tiny_pipeline_first_run(tmp_path_factory):
    """The whole pipeline run once on tiny data (support.TINY_PIPELINE), through the
    command line as a user runs it, shared by the modules that inspect its outputs:
    (config, run summary, MLMD store, the command's CompletedProcess)."""
    from pipeline import local_run
    from tests import support

    root = tmp_path_factory.mktemp("pipeline")
    values = support.tiny_pipeline(str(root / "output"))
    config, store, process = support.run_pipeline(values, root)
    summary = local_run.summarize(config)
    return config, summary, store, process


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup` (make test), a module's tests stay on one xdist worker, so
    its module-scoped fixtures (a trained job, a partition) are built once; modules that
    share a session fixture name one group (`xdist_group("tiny_pipeline")`). First of the
    hooks: xdist's own (xdist/remote.py) turns the marker into the `@group` node-id suffix
    its scheduler reads, so a marker added after it would group nothing."""
    for item in items:
        # Slow tests spread over the workers test by test, but those that use a
        # module-scoped fixture (a trained job, a partition, namespaces), which each worker
        # would build again: a slow module's tests are long, and one worker holding each
        # whole module would leave the others idle at the end of `make test-slow`.
        if item.get_closest_marker("xdist_group") is None and (
            item.get_closest_marker("slow") is None or _uses_a_module_fixture(item)
        ):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return False
    return any(d.scope == "module" for defs in definitions.name2fixturedefs.values() for d in defs)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "tensorflow_federated" in sys.modules:
        # Drop TFF's import-time context now, so its __del__ does not print a
        # traceback at interpreter exit when no test started a runtime in-process.
        from tff_algorithms.federated import runtime

        runtime.release_import_time_context()
    leaked = processes.worker_binaries_with_marker(SESSION_MARKER)
    if leaked:
        for pid in leaked:
            processes.kill_quietly(pid)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"FAILED leak check: worker_binary processes left running by this session: {leaked}"
        )
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

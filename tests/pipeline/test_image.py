"""One container image for every step (issue 28): the Dockerfile, the Kubeflow spec and
docs/scaling.md agree on it, and the Kubeflow V2 spec passes Kubeflow's own schema.

No OCI build runs here (no daemon, no base images offline), so what is checked is what
can be without one: the Dockerfile installs through the README's setup and names the
paths the worker StatefulSet uses; every command the compiled spec runs exists in this
(the locked) environment; the spec parses as kfp-pipeline-spec's PipelineSpec and the
config embedded in its steps is the compiled one.
"""

import dataclasses
import importlib
import importlib.util
import json
import os
import re

import pytest
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from pipeline import cli, definition
from pipeline import config as config_lib
from tests import paths
from tff_algorithms.federated import local_workers

REPO = str(paths.REPO)
IMAGE = config_lib.IMAGE
SHIM = "/usr/local/lib/dp_fedemb_loopback_bind.so"


def _read(*parts: str) -> str:
    with open(os.path.join(REPO, *parts), encoding="utf-8") as f:
        return f.read()


def _run_lines(dockerfile: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def test_one_image_name_everywhere():
    assert re.fullmatch(r"dp-fedemb:\d+\.\d+\.\d+", IMAGE)
    assert IMAGE.split(":")[1] in _read("setup.py")  # the tag is the package version
    assert config_lib.PipelineSection().image == IMAGE
    assert f"docker build -t {IMAGE} ." in _read("Dockerfile")
    scaling = _read("docs", "scaling.md")
    # Every dp-fedemb image the docs name (worker StatefulSet, Beam harness, Kubeflow) is
    # it, under whichever registry it was pushed to.
    named = set(re.findall(r"[\w./<>-]*dp-fedemb[\w./-]*:[\w.]+", scaling))
    assert named and {name.rsplit("/", 1)[-1] for name in named} == {IMAGE}, named
    for doc in ("pipeline.md", "config.md"):
        assert IMAGE in _read("docs", doc), doc
        assert not re.search(r"dp-fedemb:(latest|1\b)", _read("docs", doc)), doc


def test_dockerfile_installs_the_readme_way():
    dockerfile = _read("Dockerfile")
    runs = _run_lines(dockerfile)
    # The locked environment through the README's setup, and no second list of packages.
    assert any(re.search(r"(^|&& )make setup\b", run) for run in runs)
    assert "bash scripts/setup_env.sh" in _read("Makefile").split("\nsetup:")[1].split("\n\n")[0]
    for run in runs:
        assert not re.search(r"\bpip3? install\b|\buv pip\b", run), run
    # What the worker StatefulSet (deploy/, tests/repo/test_deploy.py) runs: worker_binary
    # by name, with the loopback shim preloaded from a fixed path.
    stateful_set = _read("deploy", "worker-statefulset.yaml")
    assert 'command: ["worker_binary"' in stateful_set and f"value: {SHIM}" in stateful_set
    assert "/usr/local/bin/worker_binary" in dockerfile and SHIM in dockerfile
    assert "loopback_shim.library_path()" in dockerfile
    # The same Beam as the lock for the SDK harness entry point.
    beam = re.search(r"^apache-beam(?:\[gcp\])?==([\d.]+)", _read("requirements", "lock.txt"), re.M)
    assert f"apache/beam_python3.10_sdk:{beam.group(1)} " in dockerfile
    ignored = _read(".dockerignore").split()
    assert {".venv", ".venv-airflow", ".git", ".cache"} <= set(ignored)


def test_worker_binary_is_in_the_locked_environment():
    # The file the Dockerfile links onto PATH: TFF's own, which the runtime starts locally.
    assert os.access(local_workers.WORKER_BINARY, os.X_OK), local_workers.WORKER_BINARY


@pytest.fixture(scope="module")
def kubeflow(tmp_path_factory):
    out = tmp_path_factory.mktemp("kubeflow") / "pipeline.json"
    overrides = [
        "train.rounds=7",
        "evaluate.privacy_budget_epsilon=6.5",
        "dedup.max_removed_fraction=0.2",
    ]
    args = ["dp-fedemb", "compile", "--target=kubeflow", f"--out={out}"]
    for override in overrides:
        args += ["--set", override]
    assert cli.main(args) == 0  # no --image: the documented default
    config = config_lib.load_config(None, overrides)
    return json.loads(out.read_text()), config


def test_kubeflow_spec_parses_as_pipeline_spec(kubeflow):
    spec, _ = kubeflow
    parsed = json_format.ParseDict(spec["pipelineSpec"], pipeline_spec_pb2.PipelineSpec())
    assert parsed.pipeline_info.name == "dp-fedemb"
    assert set(parsed.root.dag.tasks) >= {definition.PRIVATE_TRAIN, definition.PUSHER}


def test_kubeflow_steps_run_the_image_and_commands_that_exist(kubeflow):
    spec, _ = kubeflow
    executors = spec["pipelineSpec"]["deploymentSpec"]["executors"]
    containers = [e["container"] for e in executors.values() if "container" in e]
    assert len(containers) >= 11
    for container in containers:
        assert container["image"] == IMAGE
        command, args = container["command"], container["args"]
        # `python -m MODULE` with the image's python (.venv/bin first on PATH): here, this one.
        assert command[:2] == ["python", "-m"], command
        assert importlib.util.find_spec(command[2]) is not None, command
        class_path = args[args.index("--executor_class_path") + 1]
        module, _, name = class_path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), class_path


def test_kubeflow_embedded_config_round_trips(kubeflow):
    spec, config = kubeflow
    tasks = spec["pipelineSpec"]["root"]["dag"]["tasks"]

    def param(task: str, name: str):
        value = tasks[task]["inputs"]["parameters"][name]["runtimeValue"]["constantValue"]
        return next(iter(value.values()))

    assert json.loads(param(definition.PRIVATE_TRAIN, "train_job_config")) == json.loads(
        json.dumps(config.train_job_dict())
    )
    assert json.loads(param(definition.PRETRAIN, "train_job_config")) == json.loads(
        json.dumps(config.pretrain_job_dict())
    )
    assert json.loads(param(definition.PRIVATE_TRAIN, "runtime_config")) == json.loads(
        json.dumps(dataclasses.asdict(config.runtime))
    )
    assert json.loads(param(definition.DEDUP, "dedup_config")) == json.loads(
        json.dumps(dataclasses.asdict(config.dedup))
    )
    assert json.loads(param(definition.EXAMPLE_GEN, "split_config")) == json.loads(
        json.dumps(config.split_config_dict())
    )
    assert param(definition.EVALUATE, "privacy_budget_epsilon") == 6.5
    assert json.loads(param(definition.PRIVATE_TRAIN, "train_job_config"))["rounds"] == 7

"""deploy/ (the Kubernetes manifests users apply) agrees with the runtime and itself.

Parsed with PyYAML (in the lock). What must agree, since nothing else would notice a
drift until a cluster run fails: the worker's command line with the flags the runtime
gives its local workers, the loopback shim's path with the Dockerfile's, the image with
the pipeline's, every port (worker, envoy listener and cluster, Service, probe,
NetworkPolicy, the trainer's addresses), the Secrets and where their files are read,
the labels the NetworkPolicy selects, and the trainer's flags with `dp-fedemb train`'s.
"""

import os
import re

import pytest
import yaml
from absl import flags

from pipeline import config as config_lib
from pipeline.commands import train as train_command
from tests import paths
from tff_algorithms.federated import local_workers, runtime

DEPLOY = paths.REPO / "deploy"


def _load(name: str) -> dict:
    with open(DEPLOY / name) as f:
        (document,) = list(yaml.safe_load_all(f))
    return document


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    kustomization = _load("kustomization.yaml")
    by_kind = {}
    for name in kustomization["resources"]:
        document = _load(name)
        by_kind[document["kind"]] = document
    assert set(by_kind) == {"Service", "StatefulSet", "NetworkPolicy", "Job"}
    (generated,) = kustomization["configMapGenerator"]
    by_kind["envoy_configmap"] = generated
    by_kind["envoy"] = _load(generated["files"][0])
    return by_kind


def _container(pod_spec: dict, name: str) -> dict:
    (container,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return container


def _flag_values(argv: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in argv)


def test_every_file_in_deploy_is_applied_and_parses():
    kustomization = _load("kustomization.yaml")
    listed = set(kustomization["resources"]) | {
        f for g in kustomization["configMapGenerator"] for f in g["files"]
    }
    assert listed | {"kustomization.yaml"} == set(os.listdir(DEPLOY))


def test_worker_runs_as_the_runtime_runs_local_workers(manifests):
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    worker = _container(pod, "worker")
    command = worker["command"]
    assert command[0] == os.path.basename(local_workers.WORKER_BINARY)
    deployed = _flag_values(command[1:])
    local = _flag_values(local_workers.worker_flags(0, 0))
    assert set(deployed) == set(local), "worker_binary's flags differ from the runtime's"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["TF_NUM_INTRAOP_THREADS"] == str(runtime.RuntimeConfig().worker_intra_op_threads)
    # The shim the Dockerfile builds, from the module the runtime loads.
    dockerfile = (paths.REPO / "Dockerfile").read_text()
    assert f"/usr/local/lib/{os.path.basename(env['LD_PRELOAD'])}" in dockerfile
    assert env["LD_PRELOAD"].startswith("/usr/local/lib/")
    assert "from tff_algorithms.federated import loopback_shim" in dockerfile
    # The worker listens where envoy's cluster forwards, on the pod's loopback.
    (endpoint,) = manifests["envoy"]["static_resources"]["clusters"][0]["load_assignment"][
        "endpoints"
    ][0]["lb_endpoints"]
    socket = endpoint["endpoint"]["address"]["socket_address"]
    assert socket["address"] == "127.0.0.1"
    assert int(deployed["port"]) == socket["port_value"]


def test_one_image_the_pipelines_own(manifests):
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    trainer = manifests["Job"]["spec"]["template"]["spec"]["containers"][0]
    for image in (_container(pod, "worker")["image"], trainer["image"]):
        assert image.endswith(f"/{config_lib.IMAGE}"), image


def test_the_tls_port_is_the_same_everywhere(manifests):
    listener = manifests["envoy"]["static_resources"]["listeners"][0]
    port = listener["address"]["socket_address"]["port_value"]
    tls = _container(manifests["StatefulSet"]["spec"]["template"]["spec"], "tls")
    assert [p["containerPort"] for p in tls["ports"]] == [port]
    assert tls["readinessProbe"]["tcpSocket"]["port"] == port
    assert [p["port"] for p in manifests["Service"]["spec"]["ports"]] == [port]
    (rule,) = manifests["NetworkPolicy"]["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [port]
    # The trainer dials every pod of the StatefulSet through the headless Service.
    workers = _trainer_flags(manifests).workers
    stateful_set = manifests["StatefulSet"]
    service = manifests["Service"]["metadata"]["name"]
    assert stateful_set["spec"]["serviceName"] == service
    assert manifests["Service"]["spec"]["clusterIP"] == "None"
    name = stateful_set["metadata"]["name"]
    replicas = stateful_set["spec"]["replicas"]
    assert workers == [f"{name}-{i}.{service}:{port}" for i in range(replicas)]


def test_secrets_mounted_where_their_files_are_read(manifests):
    pod = manifests["StatefulSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in _container(pod, "tls")["volumeMounts"]}
    assert volumes["tls"]["secret"]["secretName"] == "tff-worker-tls"
    context = manifests["envoy"]["static_resources"]["listeners"][0]["filter_chains"][0][
        "transport_socket"
    ]["typed_config"]
    assert context["require_client_certificate"] is True
    common = context["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    (certificate,) = common["tls_certificates"]
    files = [
        certificate["certificate_chain"]["filename"],
        certificate["private_key"]["filename"],
        common["validation_context"]["trusted_ca"]["filename"],
    ]
    assert files == [f"{mounts['tls']}/{key}" for key in ("tls.crt", "tls.key", "ca.crt")]
    # The envoy config is the generated ConfigMap, mounted where envoy's -c reads it.
    assert volumes["envoy-config"]["configMap"]["name"] == manifests["envoy_configmap"]["name"]
    config_path = _container(pod, "tls")["args"][1]
    assert config_path == f"{mounts['envoy-config']}/envoy.yaml"
    # The trainer's client certificate, from its own Secret.
    job = manifests["Job"]["spec"]["template"]["spec"]
    job_volumes = {v["name"]: v for v in job["volumes"]}
    job_mounts = {m["name"]: m["mountPath"] for m in job["containers"][0]["volumeMounts"]}
    assert job_volumes["tls"]["secret"]["secretName"] == "dp-fedemb-trainer-tls"
    parsed = _trainer_flags(manifests)
    assert [parsed.worker_ca, parsed.worker_cert, parsed.worker_key] == [
        f"{job_mounts['tls']}/{key}" for key in ("ca.crt", "tls.crt", "tls.key")
    ]
    # Workers read the partition the trainer writes, by the same absolute paths.
    worker_mounts = {m["name"]: m["mountPath"] for m in _container(pod, "worker")["volumeMounts"]}
    assert job_mounts["data"] == worker_mounts["data"]
    claim = volumes["data"]["persistentVolumeClaim"]["claimName"]
    assert job_volumes["data"]["persistentVolumeClaim"]["claimName"] == claim
    assert parsed.output.startswith(job_mounts["data"] + "/")


def test_network_policy_admits_the_trainer_to_the_workers(manifests):
    policy = manifests["NetworkPolicy"]["spec"]
    worker_labels = manifests["StatefulSet"]["spec"]["template"]["metadata"]["labels"]
    trainer_labels = manifests["Job"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert manifests["Service"]["spec"]["selector"].items() <= worker_labels.items()
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= trainer_labels.items()


class _Flags:
    def __init__(self, values: flags.FlagValues) -> None:
        self.workers = values["workers"].value
        self.worker_ca = values["worker-ca"].value
        self.worker_cert = values["worker-cert"].value
        self.worker_key = values["worker-key"].value
        self.output = values["output"].value


def _trainer_flags(manifests) -> _Flags:
    """The trainer Job's command line, parsed by `dp-fedemb train`'s own flags (an
    unknown or misspelt flag fails here)."""
    container = manifests["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["dp-fedemb", "train"]
    values = flags.FlagValues()
    train_command.define_flags(values)
    rest = values(["dp-fedemb train", *container["args"]])
    assert rest == ["dp-fedemb train"]
    # Plaintext to these addresses would be refused: the TLS files are given.
    runtime.RuntimeConfig(
        worker_addresses=tuple(values["workers"].value),
        worker_ca=values["worker-ca"].value,
        worker_cert=values["worker-cert"].value,
        worker_key=values["worker-key"].value,
    )
    assert all(re.fullmatch(r"[a-z0-9.-]+:\d+", w) for w in values["workers"].value)
    return _Flags(values)

"""The Beam data jobs are runner-independent: options pass through, results do not move.

Synthetic data goes through the data jobs with `dp-fedemb data` on the DirectRunner in
memory (one process), and
- ingest -> split -> dedup -> partition through Beam's portable job service with an
  external SDK worker pool, each a separate process: the Job API and Fn API that Flink,
  Spark and Dataflow's runner v2 use. Every file the jobs write is byte-identical to the
  in-memory run's.
- dedup, the job with the most joins and side inputs, in multi_processing mode with two
  SDK worker processes, which split its bundles between them. Its record sets (the
  number of shards is the runner's choice) and report are the in-memory run's.
Both pickle every function to another process that shares no module state with the
test. Each multi_processing job costs two worker processes importing TensorFlow (a
minute each under CI's load, against seconds for the jobs themselves on this input), so
that test keeps to one job; the worker pool imports TensorFlow once for all four.
"""

import contextlib
import glob
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from apache_beam.options import pipeline_options as beam_options

from beam_jobs import records_io, schema, split_protocols, synthetic
from pipeline import cli
from pipeline import config as config_lib
from tff_algorithms.federated import loopback_shim

SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=3, seed=4)
SPLIT_FLAGS = ["--validation-fraction", "0.2", "--test-fraction", "0.2", "--seed", "1"]
SPLIT = split_protocols.SplitConfig(validation_fraction=0.2, test_fraction=0.2, seed=1)
IN_MEMORY = "--direct_num_workers=1 --direct_running_mode=in_memory"
TWO_PROCESSES = "--direct_num_workers=2 --direct_running_mode=multi_processing"


def _sdk_worker_children() -> set[int]:
    """PIDs of this process's children running Beam's SDK worker."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"sdk_worker_main" in command:
            found.add(int(entry))
    return found


class _WorkerWatch:
    """Collects the SDK worker processes started while it runs (polls /proc)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._done.wait(0.2):
            self.seen |= _sdk_worker_children()

    def __enter__(self) -> "_WorkerWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()


def _data(capsys, *args: str) -> dict:
    code = cli.main(["dp-fedemb", "data", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out.strip().splitlines()[-1])


def _records_with_duplicates() -> list[schema.CanonicalRecord]:
    """Synthetic canonical records plus two training records holding evaluation images
    (one exact copy, one shifted by a pixel), so dedup has work to do."""
    records = list(synthetic.records_for_identities(SYNTH, 0, SYNTH.identities))
    held_out = next(
        r
        for r in records
        if split_protocols.identity_split(r.identity, SPLIT) != split_protocols.TRAIN
    )
    trainee = next(
        r
        for r in records
        if split_protocols.identity_split(r.identity, SPLIT) == split_protocols.TRAIN
    )
    pixels = tf.io.decode_png(held_out.image).numpy()[..., 0]
    for image in (held_out.image, schema.encode_png(np.roll(pixels, 1, axis=1))):
        records.append(schema.CanonicalRecord(trainee.user_id, trainee.identity, image))
    return records


def _synthetic_records_with_duplicates(root: str) -> str:
    """The records of `_records_with_duplicates` as one TFRecord file under ROOT."""
    directory = os.path.join(root, "synthetic")
    os.makedirs(directory)
    with tf.io.TFRecordWriter(os.path.join(directory, "records-00000-of-00001.tfrecord")) as w:
        for record in _records_with_duplicates():
            w.write(schema.serialize(record))
    return directory


def _synthetic_image_folder_with_duplicates(root: str) -> str:
    """The records of `_records_with_duplicates` as ROOT/images/<user>/<identity>/N.png,
    the layout `data ingest` reads."""
    directory = os.path.join(root, "images")
    for i, record in enumerate(_records_with_duplicates()):
        folder = os.path.join(directory, record.user_id, record.identity)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i:03d}.png"), "wb") as f:
            f.write(record.image)
    return directory


def _run_data_jobs(
    capsys, records: str, out: str, beam_args: str, runner: str = "DirectRunner"
) -> dict:
    beam = ["--runner", runner, "--beam-args", beam_args]
    return {
        "split": _data(
            capsys, "split", "--input", records, "--out", f"{out}/split", *SPLIT_FLAGS, *beam
        ),
        "dedup": _data(capsys, "dedup", "--input", f"{out}/split", "--out", f"{out}/dedup", *beam),
        "partition": _data(
            capsys,
            "partition",
            "--input",
            f"{out}/dedup/train",
            "--out",
            f"{out}/partition",
            "--num-shards",
            "3",
            "--users-per-virtual-client",
            "2",
            "--virtual-clients-per-round",
            "2",
            "--rounds",
            "4",
            *beam,
        ),
    }


def _run_all_data_jobs(capsys, images: str, out: str, runner: str, beam_args: str) -> dict:
    """ingest (an image folder) -> split -> dedup -> partition, each on RUNNER."""
    beam = ["--runner", runner, "--beam-args", beam_args]
    ingested = _data(capsys, "ingest", "--input", images, "--out", f"{out}/ingested", *beam)
    return {"ingest": ingested, **_run_data_jobs(capsys, f"{out}/ingested", out, beam_args, runner)}


def _records(directory: str) -> list[bytes]:
    files = sorted(glob.glob(records_io.records_pattern(directory)))
    assert files, f"no records in {directory}"
    return sorted(r.numpy() for r in tf.data.TFRecordDataset(files))


def _files(directory: str) -> dict[str, bytes]:
    contents = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                contents[os.path.relpath(path, directory)] = f.read()
    return contents


@pytest.mark.slow
def test_two_process_direct_runner_gives_the_in_memory_results(tmp_path, capsys):
    records = _synthetic_records_with_duplicates(str(tmp_path))
    split_dir = str(tmp_path / "split")
    in_memory = ["--runner", "DirectRunner", "--beam-args", IN_MEMORY]
    _data(capsys, "split", "--input", records, "--out", split_dir, *SPLIT_FLAGS, *in_memory)
    single_dir, multi_dir = str(tmp_path / "in_memory"), str(tmp_path / "two_processes")
    single = _data(capsys, "dedup", "--input", split_dir, "--out", single_dir, *in_memory)
    with _WorkerWatch() as watch:
        multi = _data(
            capsys,
            "dedup",
            "--input",
            split_dir,
            "--out",
            multi_dir,
            "--runner",
            "DirectRunner",
            "--beam-args",
            TWO_PROCESSES,
        )
    # The job ran in SDK worker processes: the options reached the runner.
    assert len(watch.seen) >= 2, f"SDK worker processes seen: {sorted(watch.seen)}"
    removed = single["train_vs_evaluation"]
    assert removed["removed_exact"] >= 1 and removed["removed_exact"] + removed["removed_near"] >= 2
    assert multi == single
    report = "dedup_report.json"
    assert _files(multi_dir)[report] == _files(single_dir)[report]
    for name in SPLIT.splits:
        assert _records(f"{multi_dir}/{name}") == _records(f"{single_dir}/{name}"), name


# Beam's portable job service (the Job API Flink, Spark and Dataflow's runner v2 speak)
# and an external SDK worker pool, each a process of its own. The worker pool runs its
# SDK harnesses as threads, so TensorFlow is imported once for all jobs, not per job.
_WORKER_POOL = """
import os, sys
from apache_beam.runners.worker import worker_pool_main
address, server = worker_pool_main.BeamFnExternalWorkerPoolServicer.start(use_process=False)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(address.rsplit(":", 1)[1])
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
server.wait_for_termination()
"""
_TENSORFLOW_LIBRARY = b"_pywrap_tensorflow_internal"


def _loopback(hex_address: str) -> bool:
    """Whether a /proc/net/tcp{,6} local address (hex, 32-bit words in host order) is
    loopback; an IPv4-mapped IPv6 address counts by its IPv4 address."""
    raw = b"".join(
        bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)
    )
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _listening_addresses(pid: int) -> list[tuple[str, bool]]:
    """(hex address:port, is loopback) of every TCP socket PID listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address = fields[1].split(":")[0]
                    found.append((fields[1], _loopback(address)))
    return found


def _process_group(pgid: int) -> list[int]:
    """The live processes of process group PGID (zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def _maps(pid: int) -> bytes:
    with open(f"/proc/{pid}/maps", "rb") as f:
        return f.read()


class _PortableServices:
    """A Beam job service and an SDK worker pool, started on loopback and stopped at the
    end, whatever happens: each is the leader of its own process group, which is killed."""

    def __init__(self, root: str) -> None:
        self._root = root
        self._started: list[subprocess.Popen] = []
        self._port_files: dict[int, str] = {}
        # Beam binds the job service's data, control, state and logging servers and the
        # worker pool to every interface ("[::]:0"); the loopback shim rewrites those
        # binds to 127.0.0.1, so nothing here is reachable from another host.
        self._env = dict(os.environ, LD_PRELOAD=loopback_shim.library_path())

    def start(self) -> None:
        """Starts both (their ports come later, from `port`)."""
        self.job_service = self._start(
            "job_service",
            "-m",
            "apache_beam.runners.portability.local_job_service_main",
            "--staging_dir",
            os.path.join(self._root, "staging"),
            "--port_file",
        )
        self.worker_pool = self._start("worker_pool", "-c", _WORKER_POOL)

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        port_file = os.path.join(self._root, f"{name}.port")
        with open(os.path.join(self._root, f"{name}.log"), "wb") as log:
            process = subprocess.Popen(
                [sys.executable, *args, port_file],
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._started.append(process)
        self._port_files[process.pid] = port_file
        return process

    def port(self, process: subprocess.Popen, timeout: float = 180) -> int:
        """The port PROCESS listens on, once it has written it."""
        port_file = self._port_files[process.pid]
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            assert process.poll() is None, f"{process.args} exited with {process.returncode}"
            assert time.monotonic() < deadline, f"{process.args} wrote no port in {timeout} s"
            time.sleep(0.2)
        with open(port_file) as f:
            return int(f.read())

    def stop(self) -> None:
        for process in self._started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in self._started:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            # Nothing of the group may outlive the test (a worker the pool started).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while left := [pid for p in self._started for pid in _process_group(p.pid)]:
            assert time.monotonic() < deadline, f"processes left behind: {left}"
            time.sleep(0.1)


@pytest.fixture
def portable_services(tmp_path):
    services_dir = tmp_path / "services"
    services_dir.mkdir()
    services = _PortableServices(str(services_dir))
    try:
        services.start()  # in the try: a process started before a failure is stopped too
        yield services
    finally:
        services.stop()


@pytest.mark.slow
def test_portable_job_service_with_an_external_worker_pool_gives_the_direct_results(
    tmp_path, capsys, portable_services
):
    host = socket.getfqdn()
    # Beam's job service tells an external worker to dial the runner at getfqdn().
    if not all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, 0)):
        pytest.skip(f"{host} (this host's name) does not resolve to loopback")
    images = _synthetic_image_folder_with_duplicates(str(tmp_path))
    direct_dir, portable_dir = str(tmp_path / "direct"), str(tmp_path / "portable")
    direct = _run_all_data_jobs(capsys, images, direct_dir, "DirectRunner", IN_MEMORY)
    services = portable_services
    job_port, pool_port = services.port(services.job_service), services.port(services.worker_pool)
    pool_pid = services.worker_pool.pid
    assert _TENSORFLOW_LIBRARY not in _maps(pool_pid)
    portable = _run_all_data_jobs(
        capsys,
        images,
        portable_dir,
        "PortableRunner",
        f"--job_endpoint=localhost:{job_port} --environment_type=EXTERNAL "
        f"--environment_config=localhost:{pool_port}",
    )
    # The jobs' functions ran in the worker pool's process: only their modules import
    # TensorFlow there. The job service (the runner) never loaded it.
    assert pool_pid not in (os.getpid(), services.job_service.pid)
    assert _TENSORFLOW_LIBRARY in _maps(pool_pid)
    assert _TENSORFLOW_LIBRARY not in _maps(services.job_service.pid)
    for process in (services.job_service, services.worker_pool):
        listening = _listening_addresses(process.pid)
        assert listening and all(loopback for _, loopback in listening), listening
    assert portable == direct
    # Every file the jobs wrote is byte-identical, record shards included.
    assert _files(portable_dir) == _files(direct_dir)


# The invocations docs/scaling.md shows, as `--beam-args` values (keep the two in step).
RUNNER_ARGS = {
    "DataflowRunner": (
        "--project=my-project --region=europe-west1 --temp_location=gs://my-bucket/tmp "
        "--sdk_container_image=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1 "
        "--max_num_workers=50",
        beam_options.GoogleCloudOptions,
        {"project": "my-project", "region": "europe-west1"},
    ),
    "FlinkRunner": (
        "--flink_master=flink-jobmanager:8081 --environment_type=DOCKER "
        "--environment_config=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1 --parallelism=32",
        beam_options.FlinkRunnerOptions,
        {"flink_master": "flink-jobmanager:8081", "parallelism": 32},
    ),
    "PortableRunner": (
        "--job_endpoint=localhost:8099 --environment_type=EXTERNAL "
        "--environment_config=localhost:50000",
        beam_options.PortableOptions,
        {
            "job_endpoint": "localhost:8099",
            "environment_type": "EXTERNAL",
            "environment_config": "localhost:50000",
        },
    ),
    "SparkRunner": (
        "--spark_master_url=spark://spark-master:7077 --environment_type=DOCKER "
        "--environment_config=europe-docker.pkg.dev/my-project/dp-fedemb/beam:1",
        beam_options.SparkRunnerOptions,
        {"spark_master_url": "spark://spark-master:7077"},
    ),
}


@pytest.mark.parametrize("runner", sorted(RUNNER_ARGS))
def test_documented_runner_options_reach_the_jobs_options(runner):
    import shlex

    args, options_class, expected = RUNNER_ARGS[runner]
    options = records_io.pipeline_options([f"--runner={runner}", *shlex.split(args)])
    assert options.view_as(beam_options.StandardOptions).runner == runner
    view = options.view_as(options_class)
    assert {name: getattr(view, name) for name in expected} == expected


@pytest.mark.parametrize(
    "runner, beam_args, message",
    [
        (
            "DirectRunner",
            "--direct_num_wokers=2",
            "unknown Beam pipeline option --direct_num_wokers",
        ),
        ("DirectRunner", "stray", "look like --name=value"),
        ("PortableRunner", "--environment_type=EXTERNAL", "needs --job_endpoint=HOST:PORT"),
        ("DirectRunner", "--job_endpoint=localhost:8099", "not --runner=DirectRunner"),
    ],
)
def test_bad_beam_options_are_one_error_line(tmp_path, capsys, runner, beam_args, message):
    (tmp_path / "in").mkdir()
    code = cli.main(
        ["dp-fedemb", "data", "split", "--input", str(tmp_path / "in")]
        + ["--out", str(tmp_path / "o"), "--runner", runner, "--beam-args", beam_args]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and message in err[0], err


def test_unknown_runner_is_one_error_line(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    with tf.io.TFRecordWriter(str(tmp_path / "in" / "records-00000-of-00001.tfrecord")) as w:
        w.write(schema.serialize(next(synthetic.records_for_identities(SYNTH, 0, 1))))
    code = cli.main(
        ["dp-fedemb", "data", "split", "--input", str(tmp_path / "in")]
        + ["--out", str(tmp_path / "out"), "--runner", "NoSuchRunner"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "NoSuchRunner" in err[-1], err


def test_pipeline_config_reaches_every_beam_job_tfx_component_and_the_tff_workers():
    from pipeline import definition

    beam_args = ["--runner=DirectRunner", *TWO_PROCESSES.split()]
    config = config_lib.load_config(
        overrides=[
            f"pipeline.beam_args=[{', '.join(beam_args)}]",
            "runtime.worker_addresses=[10.0.0.5:8000, 10.0.0.6:8000]",
            "runtime.worker_ca=/tls/ca.pem",
            "runtime.worker_cert=/tls/trainer.pem",
            "runtime.worker_key=/tls/trainer.key",
        ]
    )
    components = definition.build_components(config)
    passed = {
        c.id: json.loads(c.exec_properties["beam_args"])
        for c in components
        if "beam_args" in c.exec_properties
    }
    assert passed == {
        definition.EXAMPLE_GEN: beam_args,
        definition.DEDUP: beam_args,
        definition.PARTITION: beam_args,
        definition.PRETRAIN: beam_args,
    }
    # TFX's own Beam components (StatisticsGen, ...) take the pipeline-level args, and on
    # the DirectRunner the pipeline's image as their SDK container (definition.tfx_beam_args).
    pipeline = definition.build_pipeline(config, root="/tmp/unused-root")
    assert pipeline.beam_pipeline_args == [
        *beam_args,
        f"--sdk_container_image={config_lib.IMAGE}",
    ]
    # Private training connects to the configured TFF workers (tests/tff_algorithms/federated/test_multi_worker.py).
    private_train = next(c for c in components if c.id == definition.PRIVATE_TRAIN)
    assert json.loads(private_train.exec_properties["runtime_config"]) == {
        "worker_addresses": ["10.0.0.5:8000", "10.0.0.6:8000"],
        "local_workers": 1,
        "worker_intra_op_threads": 1,
        "worker_ca": "/tls/ca.pem",
        "worker_cert": "/tls/trainer.pem",
        "worker_key": "/tls/trainer.key",
        "allow_insecure_workers": False,
        # A lost worker's bounds and policy (runtime.RuntimeConfig), their defaults.
        "first_round_deadline_s": 900.0,
        "round_deadline_factor": 10.0,
        "min_round_deadline_s": 60.0,
        "max_worker_losses": 2,
        # Who runs the rounds (runtime.executor): TFF's workers, the default.
        "executor": "worker",
    }


@pytest.mark.parametrize(
    "override, message",
    [
        ("pipeline.beam_args=[--direct_num_wokers=2]", "unknown Beam pipeline option"),
        ("pipeline.beam_args=[--runner=PortableRunner]", "PortableRunner needs --job_endpoint"),
        ("runtime.local_workers=0", "config runtime: local_workers must be >= 1"),
        (
            "runtime.worker_intra_op_threads=-1",
            "config runtime: worker_intra_op_threads must be >= 0",
        ),
    ],
)
def test_pipeline_config_refuses_bad_beam_args_and_workers(override, message):
    with pytest.raises(ValueError, match=message):
        config_lib.load_config(overrides=[override])

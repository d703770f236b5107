"""No leakage in outputs (issue 8 item 6).

After a `dp-fedemb train` run (as a subprocess: its stdout and stderr are the logs) and
the shared tiny pipeline run (conftest's `tiny_pipeline_first_run`), every file written
is scanned: SavedModels, checkpoints, metrics, ledgers, reports, evaluation, statistics,
schema, anomalies, the ML Metadata store, the logs. Asserted:
- no variable with a per-virtual-client head's shape in any SavedModel or checkpoint;
- no training-user identifier (user or identity name) anywhere;
- no raw training image: neither a distinctive run of a training PNG's encoded bytes
  nor a row of its decoded pixels (as uint8 or as the model's float32 input);
- no schedule or noise seed in published outputs and logs.
Excluded, by design: the data itself (ingested records, splits, the user-sharded
partition: Examples and VirtualClientPartition artifacts, `OUT/data`), and for seeds
only `OUT/train_job.json` and the checkpoints, which exist to resume and are documented
as private as the training data (tff_algorithms/jobs/train_job.py).
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from beam_jobs import partition, schema, synthetic
from pipeline.components import artifacts
from tff_algorithms.base import job_files

# One xdist worker runs every module of the session's tiny pipeline run (conftest).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tiny_pipeline")]

# Distinctive names: any occurrence in an output is a leak, never a coincidence.
SYNTH = synthetic.SyntheticConfig(identities=24, images_per_identity=4, seed=3)
EMBEDDING_SIZE = 16
USERS_PER_VIRTUAL_CLIENT = 2


def _user(index: int) -> str:
    return f"zqleak-user-{index:03d}-b7e1"


def _identity(index: int) -> str:
    return f"zqleak-identity-{index:03d}-4c9d"


def _image_needles(encoded: bytes) -> list[bytes]:
    """Byte runs that only this image's data would contain: a stretch of its compressed
    PNG stream, and its most varied pixel row as uint8 and as float32 model input."""
    pixels = schema.decode_image(encoded)
    row = pixels[int(np.argmax(pixels.reshape(pixels.shape[0], -1).std(axis=1)))]
    middle = len(encoded) // 2
    return [
        encoded[middle - 16 : middle + 16],
        row.tobytes(),
        (row.astype(np.float32) / 255.0).tobytes(),
    ]


def _files_under(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            if not any(part in path for part in skip):
                found.append(path)
    return found


def _variables_indexes(paths: list[str]) -> list[str]:
    return [p[: -len(".index")] for p in paths if p.endswith(".index")]


def _assert_no_head(variable_prefixes: list[str], head_shape: tuple[int, int]) -> None:
    assert variable_prefixes
    for prefix in variable_prefixes:
        for name, shape in tf.train.list_variables(prefix):
            assert tuple(shape) not in (head_shape, head_shape[::-1]), (prefix, name, shape)
            # Scalars such as the local heads' seed are fine; head weights are not.
            assert not ("head" in name.lower() and len(shape) >= 2), (prefix, name, shape)


def _leaks(paths: list[str], needles: dict[str, bytes]) -> list[tuple[str, str]]:
    found = []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        found.extend((path, what) for what, needle in needles.items() if needle in data)
    return found


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """`dp-fedemb train` on an image folder with distinctive names; its logs included."""
    root = tmp_path_factory.mktemp("leak")
    data = root / "data"
    images = []
    for index, record in enumerate(synthetic.records_for_identities(SYNTH, 0, SYNTH.identities)):
        identity_index = index // SYNTH.images_per_identity
        folder = data / schema.path_component(_user(identity_index))
        folder = folder / schema.path_component(_identity(identity_index))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index % SYNTH.images_per_identity}.png").write_bytes(record.image)
        images.append((_user(identity_index), record.image))
    output = root / "out"
    process = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "dp-fedemb"),
            "train",
            f"--data={data}",
            f"--output={output}",
            "--recipe=paper",
            "--rounds=2",
            "--noise-multiplier=0.5",
            f"--users-per-virtual-client={USERS_PER_VIRTUAL_CLIENT}",
            "--virtual-clients-per-round=3",
            "--batch-size=8",
            f"--embedding-size={EMBEDDING_SIZE}",
            "--evaluate-every=0",
            "--delta=1e-3",
            "--validation-fraction=0.25",
            "--test-fraction=0.15",
            "--num-shards=2",
        ],
        capture_output=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr.decode(errors="replace")[-3000:]
    logs = root / "logs.txt"
    logs.write_bytes(process.stdout + process.stderr)
    training_users = set(partition.PartitionReader(str(output / "data" / "partition")).user_ids())
    return str(output), str(logs), training_users, images


def test_train_job_outputs_and_logs_leak_nothing(train_run):
    output, logs, training_users, images = train_run
    assert training_users and training_users <= {_user(i) for i in range(SYNTH.identities)}
    outputs = _files_under(output, skip=(os.path.join(output, "data") + os.sep,)) + [logs]
    _assert_no_head(_variables_indexes(outputs), (EMBEDDING_SIZE, USERS_PER_VIRTUAL_CLIENT))
    needles: dict[str, bytes] = {}
    for user in training_users:
        index = int(user.split("-")[2])
        needles[f"user {user}"] = user.encode()
        needles[f"identity of {user}"] = _identity(index).encode()
    for number, (user, encoded) in enumerate(images):
        if user in training_users:
            for kind, needle in zip(("png", "uint8 row", "float row"), _image_needles(encoded)):
                needles[f"{kind} of image {number}"] = needle
    assert _leaks(outputs, needles) == []
    # Seeds: nowhere but the private resume state.
    private = ("train_job.json", os.sep + "checkpoints" + os.sep)
    published = [p for p in outputs if not any(part in p for part in private)]
    # Drawn from OS entropy (62 bits): its decimal digits cannot match by chance.
    with open(os.path.join(output, "train_job.json")) as f:
        schedule_seed = json.load(f)["schedule_seed"]
    assert _leaks(published, {"schedule seed": str(schedule_seed).encode()}) == []
    metrics = json.load(open(os.path.join(output, job_files.METRICS_FILE)))
    assert metrics["schedule_seed_source"] == "os-entropy"
    assert not {"schedule_seed", "noise_seed"} & set(metrics["config"])


def _artifact_dirs(store, type_names: tuple[str, ...]) -> list[str]:
    return [a.uri for name in type_names for a in store.get_artifacts_by_type(name)]


def test_pipeline_artifacts_and_metadata_leak_nothing(tiny_pipeline_first_run):
    config, summary, store, _ = tiny_pipeline_first_run
    output_dir = os.path.abspath(config.pipeline.output_dir)
    data_dirs = _artifact_dirs(store, ("Examples", artifacts.VirtualClientPartition.TYPE_NAME))
    [partition_dir] = _artifact_dirs(store, (artifacts.VirtualClientPartition.TYPE_NAME,))
    training_users = partition.PartitionReader(partition_dir).user_ids()
    reader = partition.PartitionReader(partition_dir)
    records = [r for u in training_users for r in reader.user_records(u)]
    outputs = _files_under(output_dir, skip=tuple(d + os.sep for d in data_dirs))
    assert any(p.endswith("metadata.sqlite") for p in outputs)
    assert any("StatisticsGen" in p for p in outputs) and any("SchemaGen" in p for p in outputs)
    train = config.train_job_dict()
    _assert_no_head(
        _variables_indexes(outputs),
        (train["embedding_size"], train["head_capacity"] or train["users_per_virtual_client"]),
    )
    # Synthetic names are short ("u07", "id12"): matched as whole tokens.
    names = {r.user_id for r in records} | {r.identity for r in records}
    token = re.compile(
        rb"(?<![A-Za-z0-9_])("
        + b"|".join(re.escape(n.encode()) for n in names)
        + rb")(?![A-Za-z0-9_])"
    )
    for path in outputs:
        if "variables.data-" in path:
            continue  # float weights: random bytes would match short names by chance
        with open(path, "rb") as f:
            hits = sorted({m.group(1) for m in token.finditer(f.read())})
        assert hits == [], (path, hits[:5])
    needles = {}
    for number, record in enumerate(records):
        for kind, needle in zip(("png", "uint8 row", "float row"), _image_needles(record.image)):
            needles[f"{kind} of training image {number}"] = needle
    assert _leaks(outputs, needles) == []
    assert summary.report_path in outputs

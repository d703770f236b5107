"""The data `dp-fedemb train` prepares under OUTPUT/data, once: ingest, split, partition
of the train split (the Beam jobs), and the layout of what it writes, the only files a
restarted preparation may remove (`owned_files.remove_tree`)."""

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from tff_algorithms.base import owned_files

PREPARED_FILE = "prepared.json"
# What `prepare_data` writes under OUTPUT/data (ingest, split, partition and Beam's
# temporaries): the only files a restarted preparation removes.
_RECORDS = r"records-\d{5}-of-\d{5}\.tfrecord"
_BEAM_TEMPORARY = r"beam-temp-[^/]+"
# Spill folders a killed split or partition leaves (beam_jobs/spill.py); split's auto
# mode spills once per candidate mode, as <mode>.spill.tmp.
_SPILL_DIR = r"(split/([a-z_]+\.)?|partition/)spill\.tmp"
_SPILL_FILE = rf"{_SPILL_DIR}/[a-z0-9_-]+-[0-9a-f]{{32}}\.frames"
DATA_LAYOUT = owned_files.TreeLayout(
    "data prepared by dp-fedemb train",
    files=(
        rf"({PREPARED_FILE}|ingested/({_RECORDS}|ingest_summary\.json)"
        rf"|split/(split_summary\.json|split_mode_check\.json|[a-z_]+/{_RECORDS})"
        rf"|{_SPILL_FILE}"
        r"|partition/(manifest\.json|participation\.json"
        r"|shard-\d{5}-part-\d{5}\.tfrecord(\.tmp)?|index/shard-\d{5}\.jsonl(\.tmp)?)"
        rf"|(ingested|split(/[a-z_]+)?|partition)/{_BEAM_TEMPORARY}/[^/]+)"
    ),
    directories=(
        rf"(ingested|split|split/[a-z_]+|partition|partition/index|{_SPILL_DIR}"
        rf"|(ingested|split(/[a-z_]+)?|partition)/{_BEAM_TEMPORARY})"
    ),
)


@dataclasses.dataclass(frozen=True)
class PreparedData:
    partition_dir: str
    validation_dir: str
    test_dir: str


def _beam_source(data: str) -> str:
    """The ingest source: a TFRecord pattern for a directory of TFRecords, else the folder."""
    import tensorflow as tf

    if tf.io.gfile.glob(os.path.join(data, "*.tfrecord*")):
        return os.path.join(data, "*.tfrecord*")
    return data


def prepare_data(
    data: str, data_dir: str, split: Mapping[str, Any], num_shards: int, beam_args: list[str]
) -> PreparedData:
    """Ingest -> split by identity and user -> partition of train, unless already prepared."""
    from beam_jobs import ingest, partition_job, split_protocols, splits

    prepared = PreparedData(
        os.path.join(data_dir, "partition"),
        os.path.join(data_dir, "split", split_protocols.VALIDATION),
        os.path.join(data_dir, "split", split_protocols.TEST),
    )
    request = {"data": os.path.abspath(data), "split": dict(split), "num_shards": num_shards}
    marker = os.path.join(data_dir, PREPARED_FILE)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) != request:
                raise ValueError(
                    f"{data_dir} was prepared from other data or split settings; use a new --output"
                )
        return prepared
    # A preparation killed midway leaves no marker: start it again from scratch, removing
    # only what it wrote.
    owned_files.remove_tree(data_dir, DATA_LAYOUT)
    ingest.run_ingest([_beam_source(data)], os.path.join(data_dir, "ingested"), beam_args=beam_args)
    splits.run_split(
        os.path.join(data_dir, "ingested"),
        os.path.join(data_dir, "split"),
        split_protocols.SplitConfig(**split),
        beam_args,
    )
    partition_job.run_partition(
        os.path.join(data_dir, "split", split_protocols.TRAIN),
        prepared.partition_dir,
        num_shards,
        beam_args=beam_args,
    )
    with open(marker, "w") as f:
        json.dump(request, f)
    return prepared

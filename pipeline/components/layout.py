"""Where files live inside artifacts, between the TFX and the beam_jobs layouts.

TFX keeps split S of an Examples artifact in URI/Split-S/; beam_jobs reads and writes
DIR/S/records-*.tfrecord. Components stage inputs into the beam_jobs layout with hard
links (free on a local filesystem; copied elsewhere) and publish outputs by renaming
record files into the Split-S directories, so no component rewrites records itself.
"""

import os

import tensorflow as tf
from tfx import types
from tfx.types import artifact_utils

SERVING_MODEL_DIR = "Format-Serving"  # the directory the standard Pusher pushes
# Examples' custom property: the split mode (beam_jobs.split_protocols.MODES) the splits were made by.
SPLIT_MODE = "split_mode"
# Records ingested from data.evaluation_inputs (the test split's source); absent when
# the test split holds held-out private users.
EVALUATION_INPUT_RECORDS = "evaluation_input_records"
# The Examples artifact's file of ingest and split summaries ({"ingest": ..., "split": ...}).
SUMMARY_FILE = "summary.json"


def split_dir(examples: types.Artifact, split: str) -> str:
    return os.path.join(examples.uri, f"Split-{split}")


def split_names(examples: types.Artifact) -> list[str]:
    return artifact_utils.decode_split_names(examples.split_names)


def split_mode(examples: types.Artifact) -> str:
    """The split mode of an Examples artifact; identity_and_user for artifacts made before
    split modes existed (the only rule then)."""
    from beam_jobs import split_protocols

    if examples.has_custom_property(SPLIT_MODE):
        return examples.get_string_custom_property(SPLIT_MODE)
    return split_protocols.IDENTITY_AND_USER


def has_evaluation_inputs(examples: types.Artifact) -> bool:
    """Whether the test split came from data.evaluation_inputs, not private users."""
    return examples.has_custom_property(EVALUATION_INPUT_RECORDS)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another device, or not a local path
        tf.io.gfile.copy(source, target, overwrite=True)


def stage_splits(examples: types.Artifact, staging_dir: str) -> None:
    """STAGING/<split>/ holds the record files of every split of `examples`."""
    for split in split_names(examples):
        target = os.path.join(staging_dir, split)
        tf.io.gfile.makedirs(target)
        for name in tf.io.gfile.listdir(split_dir(examples, split)):
            _link_or_copy(
                os.path.join(split_dir(examples, split), name), os.path.join(target, name)
            )


def publish_splits(staging_dir: str, splits: list[str], examples: types.Artifact) -> None:
    """Moves STAGING/<split>/* into `examples`' Split-<split>/ and records the split names."""
    for split in splits:
        target = split_dir(examples, split)
        tf.io.gfile.makedirs(target)
        source = os.path.join(staging_dir, split)
        for name in tf.io.gfile.listdir(source):
            tf.io.gfile.rename(os.path.join(source, name), os.path.join(target, name))
    examples.split_names = artifact_utils.encode_split_names(list(splits))


def serving_model_dir(model: types.Artifact) -> str:
    """The SavedModel of a Model artifact: URI/Format-Serving, or URI for an imported one."""
    candidate = os.path.join(model.uri, SERVING_MODEL_DIR)
    return candidate if tf.io.gfile.isdir(candidate) else model.uri


def remove_tree(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)

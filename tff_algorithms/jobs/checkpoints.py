"""The one checkpoint format of every algorithm, and resuming from the newest intact one.

A checkpoint is a `tf.train.Checkpoint` OUTPUT/checkpoints/ckpt-<step>.* holding what a
round (`loop.Round`) names as its state and the loop's own (the step, the ledger, the
history, the noise seed) together, so a resumed job ends where an uninterrupted one
ends. A TFF state (a federated process's, FDML's server state) is held in variables,
one per leaf (`StructureState`).

A kill during a save leaves a partial one, and after a machine crash the newest can
exist with files never flushed: on start the newest checkpoint that does not read back
whole (`read_error`) is removed, with any newer, and training resumes from the one
before it, to the same end. A checkpoint that reads back but does not fit this job's
state is an error, in one line. Three earlier formats are refused in one line: the
federated program's TFF program-state folders round_<N>/, FDML's fdml-<round>.npz files,
and the oracle's checkpoints whose step was named "epoch" (docs/design.md section 4,
"The training loop").
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
from absl import logging

KEEP_CHECKPOINTS = 2
# tf.train.CheckpointManager's names: ckpt-N.index, ckpt-N.data-*, a save's ckpt-N_temp*.
_ENTRY = re.compile(r"^ckpt-(\d+)(?:\.index|\.data-\d+-of-\d+|_temp.*)$")
_STATE_FILE = "checkpoint"
_OLD_FORMATS = {
    re.compile(r"^fdml-\d+\.npz$"): "FDML checkpoints of an earlier release (fdml-<round>.npz)",
    re.compile(r"^round_\d+(?:_temp\d+)?$"): (
        "federated checkpoints of an earlier release (TFF program state, round_<N>/)"
    ),
}
_OLD_CENTRALIZED_STEP = "epoch/"
_NEW_DIRECTORY = (
    "which this release does not resume: finish that job with the release that started "
    "it, or train into a new output directory"
)


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`, for one-line errors and warnings."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


class StructureState:
    """A TFF state (nested structure of arrays) held in variables, one per leaf, so a
    `tf.train.Checkpoint` saves and restores it; `get` rebuilds the structure. A leaf's
    shape may change from round to round (DP-FTRL's tree state grows with its depth)."""

    def __init__(self, state: Any) -> None:
        self._template = state
        self.leaves = [
            tf.Variable(np.asarray(leaf), shape=tf.TensorShape(None))
            for leaf in tf.nest.flatten(state)
        ]

    def get(self) -> Any:
        return tf.nest.pack_sequence_as(self._template, [v.numpy() for v in self.leaves])

    def set(self, state: Any) -> None:
        for variable, leaf in zip(self.leaves, tf.nest.flatten(state), strict=True):
            variable.assign(leaf)


def read_error(prefix: str) -> str | None:
    """Why checkpoint `prefix` does not read back whole, or None if it does: every value
    is read (TF checks each one's checksum), so missing or truncated files show here."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as e:  # any failure to read is a torn write
        return first_line(e)
    return None


def _entries_by_step(directory: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for name in tf.io.gfile.listdir(directory):
        name = name.rstrip("/")
        if m := _ENTRY.match(name):
            found.setdefault(int(m.group(1)), []).append(name)
    return found


def _remove_entries(directory: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(directory, name)
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)


def _refuse_old_formats(directory: str) -> None:
    names = [name.rstrip("/") for name in tf.io.gfile.listdir(directory)]
    for pattern, what in _OLD_FORMATS.items():
        if any(pattern.match(name) for name in names):
            raise ValueError(f"{directory} holds {what}, {_NEW_DIRECTORY}")


def newest_intact_checkpoint(directory: str) -> str | None:
    """The prefix of the newest checkpoint in `directory` that reads back whole, or None.

    Newer ones that do not (torn writes, partial saves) are removed, as are the values
    of older ones whose index a killed prune already removed, and the checkpoint-state
    file is rewritten to list the ones that remain, so training resumes from the one
    before and saves the removed steps again, and the older ones are pruned as new ones
    are saved.
    """
    tf.io.gfile.makedirs(directory)
    _refuse_old_formats(directory)
    entries = _entries_by_step(directory)
    newest = None
    for step in sorted(entries, reverse=True):
        prefix = os.path.join(directory, f"ckpt-{step}")
        error = read_error(prefix) if f"ckpt-{step}.index" in entries[step] else "no index"
        if error is None:
            newest = step
            break
        logging.warning(
            "checkpoint %s is incomplete (%s); removing it and resuming from an earlier one",
            prefix,
            error,
        )
        _remove_entries(directory, entries.pop(step))
    for step, names in list(entries.items()):
        if f"ckpt-{step}.index" not in names:
            # A prune killed between the index and the values (TF removes the index
            # first): older than the one resumed from, so nothing is lost.
            _remove_entries(directory, entries.pop(step))
        else:  # a save killed before its merge
            _remove_entries(directory, [n for n in names if "_temp" in n])
    kept = [os.path.join(directory, f"ckpt-{step}") for step in sorted(entries)]
    state_file = os.path.join(directory, _STATE_FILE)
    if kept:
        # With their save times, so the manager prunes them too (it keeps, as preserved,
        # those listed without a time after the last preserved one).
        tf.compat.v1.train.update_checkpoint_state(
            directory,
            kept[-1],
            all_model_checkpoint_paths=kept,
            all_model_checkpoint_timestamps=[
                tf.io.gfile.stat(f"{prefix}.index").mtime_nsec / 1e9 for prefix in kept
            ],
            last_preserved_timestamp=0.0,
        )
    elif tf.io.gfile.exists(state_file):
        tf.io.gfile.remove(state_file)
    return None if newest is None else kept[-1]


def _restore(checkpoint: tf.train.Checkpoint, prefix: str) -> None:
    names = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    if any(n.startswith(_OLD_CENTRALIZED_STEP) for n in names) and not any(
        n.startswith("step/") for n in names
    ):
        raise ValueError(
            f"{prefix} is a centralized checkpoint of an earlier release (its step is "
            f"named 'epoch'), {_NEW_DIRECTORY}"
        )
    try:
        checkpoint.restore(prefix).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as e:  # shapes, dtypes
        raise ValueError(
            f"checkpoint {prefix} reads back but does not fit this job ({first_line(e)}): "
            "it was written by another job or release; train into a new output directory"
        ) from None


class Checkpoints:
    """The job's checkpoints of `trackables`: restored from the newest intact one on
    construction (`resumed`), saved by step number, the newest `KEEP_CHECKPOINTS` kept."""

    def __init__(self, directory: str, trackables: Mapping[str, Any]) -> None:
        self._directory = directory
        self._checkpoint = tf.train.Checkpoint(**trackables)
        latest = newest_intact_checkpoint(directory)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, directory, max_to_keep=KEEP_CHECKPOINTS
        )
        if latest is not None:
            _restore(self._checkpoint, latest)
        self.resumed = latest is not None

    def save(self, step: int) -> None:
        try:
            self._manager.save(checkpoint_number=step)
        except BaseException:
            # A save stopped by a full disk: its partial files go (the step is trained
            # again on resume). The save's error is what the user must see.
            with contextlib.suppress(OSError, tf.errors.OpError):
                partial = _entries_by_step(self._directory).get(step, [])
                _remove_entries(self._directory, partial)
            raise

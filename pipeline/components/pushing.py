"""Pusher: TFX's, except that a model the newest serving version already holds is not
pushed again.

A second run of an unchanged pipeline evaluates again (the latest-blessed-model resolver
now supplies a baseline, docs/pipeline.md "Caching") and blesses the same model. TFX's
Pusher would copy it into a new timestamped version, which a model server watching the
directory loads as a new model. This executor records the existing version as the push
instead, so re-running a finished pipeline changes nothing that serves. A blessed model
that differs from the newest version, or equals only an older one (pushing it makes it
the one served again), is pushed to a new version.

A version appears whole or not at all: it is copied under a temporary name TF Serving
ignores (it loads only all-digit names), synced, and renamed to its version number
(issue 63; on an object store, which renames no folder, it is written in place with
saved_model.pb last, as TFX does). A temporary folder of an interrupted push, or a torn version an earlier
release left (it copied straight into the version, so a kill left a version without a
complete saved_model.pb), is removed before the next push, with one line; a torn
version holding a file the product never writes there stops the push instead.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from tensorflow.core.protobuf import saved_model_pb2
from tfx import types
from tfx.components import Pusher as TfxPusher
from tfx.components.pusher import executor as tfx_executor
from tfx.dsl.components.base import executor_spec
from tfx.dsl.io import fileio
from tfx.proto import pusher_pb2
from tfx.types import artifact_utils, standard_component_specs
from tfx.utils import io_utils, proto_utils

from pipeline import console

_CHUNK_BYTES = 1 << 20
# A push in progress; TF Serving loads only versions named by digits.
TEMPORARY_PREFIX = ".pushing-"
SAVED_MODEL_FILE = "saved_model.pb"
# What a version holds: the SavedModel's files and the model card RenderReport writes.
_VERSION_FILES = re.compile(
    r"(saved_model\.pb|fingerprint\.pb|keras_metadata\.pb|model_card\.(json|md|html)"
    r"|(variables|assets)/.+)"
)
# The PushedModel's custom property when the newest version already held the model.
ALREADY_SERVED = "already_served"


def _files_under(root: str) -> set[str]:
    """Relative paths of the files below `root`."""
    found = set()
    for directory, _, files in fileio.walk(root):
        relative = os.path.relpath(directory, root)
        found.update(os.path.normpath(os.path.join(relative, name)) for name in files)
    return found


def _same_bytes(a: str, b: str) -> bool:
    with fileio.open(a, "rb") as f, fileio.open(b, "rb") as g:
        while True:
            chunk = f.read(_CHUNK_BYTES)
            if chunk != g.read(_CHUNK_BYTES):
                return False
            if not chunk:
                return True


def newest_version_holding(model_path: str, base_directory: str) -> str | None:
    """The newest version directory under `base_directory` when it holds exactly the
    files of the SavedModel at `model_path` (byte for byte; files beside them, such as
    the model card the report writes there, are allowed); None otherwise."""
    if not fileio.isdir(base_directory):
        return None
    versions = [v for v in fileio.listdir(base_directory) if v.rstrip("/").isdigit()]
    if not versions:
        return None
    newest = os.path.join(base_directory, max(versions, key=lambda v: int(v.rstrip("/"))))
    model_files = _files_under(model_path)
    if not model_files:
        return None
    model_entries = {path.split(os.sep, 1)[0] for path in model_files}
    held = {p for p in _files_under(newest) if p.split(os.sep, 1)[0] in model_entries}
    if held != model_files:
        return None
    for path in sorted(model_files):
        if not _same_bytes(os.path.join(model_path, path), os.path.join(newest, path)):
            return None
    return newest


def _is_whole_saved_model(version: str) -> bool:
    """Whether `version` has a saved_model.pb that parses (an earlier release copied it
    last, so a whole one means the version was complete)."""
    path = os.path.join(version, SAVED_MODEL_FILE)
    if not fileio.exists(path):
        return False
    with fileio.open(path, "rb") as f:
        content = f.read()
    try:
        return bool(content) and bool(saved_model_pb2.SavedModel.FromString(content).meta_graphs)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError: a truncated copy
        return False


def _remove_own(path: str, what: str) -> None:
    """Removes `path` after checking every file in it is one a serving version holds;
    otherwise stops naming the file (ValueError) and removes nothing."""
    for name in sorted(_files_under(path)):
        if not _VERSION_FILES.fullmatch(name.replace(os.sep, "/")):
            raise ValueError(
                f"{what} {path} holds {name}, which dp-fedemb does not write there; "
                "move it elsewhere (or remove the folder) and re-run"
            )
    fileio.rmtree(path)


def remove_torn_versions(base_directory: str) -> list[str]:
    """Removes interrupted pushes and torn versions under `base_directory`, one line
    each, and returns their paths (module docstring)."""
    if not fileio.isdir(base_directory):
        return []
    removed = []
    for name in sorted(entry.rstrip("/") for entry in fileio.listdir(base_directory)):
        path = os.path.join(base_directory, name)
        if name.startswith(TEMPORARY_PREFIX):
            _remove_own(path, "interrupted push")
            console.note(f"removed {path}: a push that was interrupted (never served)")
        elif name.isdigit() and not _is_whole_saved_model(path):
            _remove_own(path, "torn serving version")
            console.note(
                f"removed torn serving version {path}: an interrupted push left it "
                f"without a complete {SAVED_MODEL_FILE}"
            )
        else:
            continue
        removed.append(path)
    return removed


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_tree(root: str) -> None:
    """fsyncs every file and folder under a local `root`, so that the rename publishes
    data that is on disk."""
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def push_new_version(model_path: str, base_directory: str) -> str:
    """Copies the SavedModel at `model_path` to a new version under `base_directory`
    (its unix time, later than every version there) through a temporary name and one
    rename; returns the version's path."""
    fileio.makedirs(base_directory)
    versions = [
        int(v.rstrip("/")) for v in fileio.listdir(base_directory) if v.rstrip("/").isdigit()
    ]
    version = str(max([int(time.time()), *(v + 1 for v in versions)]))
    serving_path = os.path.join(base_directory, version)
    local = "://" not in base_directory
    # An object store renames no folder: there the version is written in place, as TFX
    # does, and only saved_model.pb's coming last marks it complete.
    target = os.path.join(base_directory, TEMPORARY_PREFIX + version) if local else serving_path
    # saved_model.pb last, as TFX copies it: a reader of the folder sees it only complete.
    io_utils.copy_dir(model_path, target, deny_regex_patterns=[re.escape(SAVED_MODEL_FILE)])
    io_utils.copy_file(
        os.path.join(model_path, SAVED_MODEL_FILE), os.path.join(target, SAVED_MODEL_FILE)
    )
    if local:
        _sync_tree(target)
        os.rename(target, serving_path)
        _fsync(base_directory)  # the rename itself
    return serving_path


def _filesystem_base_directory(exec_properties: dict[str, Any]) -> str | None:
    destination = pusher_pb2.PushDestination()
    proto_utils.json_to_proto(
        exec_properties[standard_component_specs.PUSH_DESTINATION_KEY], destination
    )
    if destination.WhichOneof("destination") != "filesystem":
        return None
    return destination.filesystem.base_directory


class Executor(tfx_executor.Executor):
    """TFX's Pusher executor; to a filesystem destination a blessed model is pushed whole
    through a rename, or, when the newest version already holds it, recorded as pushed
    there (module docstring)."""

    def Do(  # noqa: N802 - TFX's method name
        self,
        input_dict: dict[str, list[types.Artifact]],
        output_dict: dict[str, list[types.Artifact]],
        exec_properties: dict[str, Any],
    ) -> None:
        base_directory = _filesystem_base_directory(exec_properties)
        if base_directory is None or not self.CheckBlessing(input_dict):
            super().Do(input_dict, output_dict, exec_properties)
            return
        model_path = self.GetModelPath(input_dict)
        remove_torn_versions(base_directory)
        model_push = artifact_utils.get_single_instance(
            output_dict[standard_component_specs.PUSHED_MODEL_KEY]
        )
        held = newest_version_holding(model_path, base_directory)
        serving_path = held or push_new_version(model_path, base_directory)
        # Archived in the PushedModel artifact, as TFX's executor does.
        io_utils.copy_dir(model_path, model_push.uri)
        self._MarkPushed(
            model_push,
            pushed_destination=serving_path,
            pushed_version=os.path.basename(serving_path),
        )
        if held is not None:
            # For a reader of ML Metadata: this push copied nothing to the destination.
            model_push.set_int_custom_property(ALREADY_SERVED, 1)


class Pusher(TfxPusher):
    """TFX's Pusher component with `Executor` above."""

    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(Executor)

"""Pusher: TFX's, except that a model the newest serving version already holds is not
pushed again.

A second run of an unchanged pipeline evaluates again (the latest-blessed-model resolver
now supplies a baseline, docs/pipeline.md "Caching") and blesses the same model. TFX's
Pusher would copy it into a new timestamped version, which a model server watching the
directory loads as a new model. This executor records the existing version as the push
instead, so re-running a finished pipeline changes nothing that serves. A blessed model
that differs from the newest version, or equals only an older one (pushing it makes it
the one served again), is pushed as TFX pushes it.
"""

from __future__ import annotations

import os
from typing import Any

from tfx import types
from tfx.components import Pusher as TfxPusher
from tfx.components.pusher import executor as tfx_executor
from tfx.dsl.components.base import executor_spec
from tfx.dsl.io import fileio
from tfx.proto import pusher_pb2
from tfx.types import artifact_utils, standard_component_specs
from tfx.utils import io_utils, proto_utils

_CHUNK_BYTES = 1 << 20
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


def _filesystem_base_directory(exec_properties: dict[str, Any]) -> str | None:
    destination = pusher_pb2.PushDestination()
    proto_utils.json_to_proto(
        exec_properties[standard_component_specs.PUSH_DESTINATION_KEY], destination
    )
    if destination.WhichOneof("destination") != "filesystem":
        return None
    return destination.filesystem.base_directory


class Executor(tfx_executor.Executor):
    """TFX's Pusher executor; a blessed model already in the newest version is recorded
    as pushed there (the PushedModel artifact archives it, as TFX's does)."""

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
        held = newest_version_holding(model_path, base_directory)
        if held is None:
            super().Do(input_dict, output_dict, exec_properties)
            return
        model_push = artifact_utils.get_single_instance(
            output_dict[standard_component_specs.PUSHED_MODEL_KEY]
        )
        io_utils.copy_dir(model_path, model_push.uri)
        self._MarkPushed(model_push, pushed_destination=held, pushed_version=os.path.basename(held))
        # For a reader of ML Metadata: this push copied nothing to the destination.
        model_push.set_int_custom_property(ALREADY_SERVED, 1)


class Pusher(TfxPusher):
    """TFX's Pusher component with `Executor` above."""

    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(Executor)

"""Serving versions appear whole or not at all (issue 63): the Pusher's executor on a real
SavedModel, SIGKILLed in the middle of its copy, and torn versions an earlier release
left (`pipeline/components/pushing.py`)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf
from tfx.types import standard_artifacts

from pipeline.components import layout, pushing


class _Double(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def serve(self, x):
        return {"y": 2 * x}


def _model_artifact(root) -> standard_artifacts.Model:
    model = standard_artifacts.Model()
    model.uri = str(root / "model")
    module = _Double()
    module.weights = tf.Variable(tf.zeros([4096]))  # a variables file to copy
    tf.saved_model.save(
        module,
        os.path.join(model.uri, layout.SERVING_MODEL_DIR),
        signatures={"serving_default": module.serve},
    )
    return model


def _push(model_uri: str, serving: str, pushed_uri: str) -> None:
    """Runs the Pusher's executor on a blessed model (the component's own Do)."""
    from tfx.proto import pusher_pb2
    from tfx.utils import proto_utils

    model = standard_artifacts.Model()
    model.uri = model_uri
    blessing = standard_artifacts.ModelBlessing()
    blessing.uri = os.path.join(os.path.dirname(pushed_uri), "blessing")
    blessing.set_int_custom_property("blessed", 1)
    pushed = standard_artifacts.PushedModel()
    pushed.uri = pushed_uri
    destination = pusher_pb2.PushDestination(
        filesystem=pusher_pb2.PushDestination.Filesystem(base_directory=serving)
    )
    pushing.Executor().Do(
        {"model": [model], "model_blessing": [blessing]},
        {"pushed_model": [pushed]},
        {"push_destination": proto_utils.proto_to_json(destination)},
    )


def _versions(serving) -> list[str]:
    return sorted(os.listdir(serving)) if os.path.isdir(serving) else []


def _serves(version: str) -> None:
    loaded = tf.saved_model.load(version)
    out = loaded.signatures["serving_default"](tf.constant([1.5]))["y"]
    assert out.numpy().tolist() == [3.0]


_CHILD = textwrap.dedent(
    """
    import sys
    from tfx.dsl.io import fileio
    from tests.pipeline import test_push_versions

    copy, copied = fileio.copy, []

    def copy_then_wait(src, dst, overwrite=False):
        copy(src, dst, overwrite)
        copied.append(dst)
        if len(copied) == 2:  # mid-write: some files copied, saved_model.pb not yet
            print("mid-write", flush=True)
            sys.stdin.read()  # until the test kills this process

    fileio.copy = copy_then_wait
    test_push_versions._push(*sys.argv[1:4])
    """
)


def test_a_pusher_killed_mid_write_leaves_no_version_and_the_rerun_pushes_one(tmp_path):
    model = _model_artifact(tmp_path)
    serving = str(tmp_path / "serving")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, model.uri, serving, str(tmp_path / "pushed1")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert child.stdout.readline() == b"mid-write\n"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    (left,) = _versions(serving)
    # What TF Serving sees: no version, only a folder it ignores.
    assert left.startswith(pushing.TEMPORARY_PREFIX) and not left[1:].isdigit()
    assert not os.path.exists(os.path.join(serving, left, pushing.SAVED_MODEL_FILE))

    _push(model.uri, serving, str(tmp_path / "pushed2"))
    (version,) = _versions(serving)
    assert version.isdigit()
    _serves(os.path.join(serving, version))


def test_a_torn_version_of_an_earlier_release_is_removed_with_one_line(tmp_path, capsys):
    model = _model_artifact(tmp_path)
    serving = tmp_path / "serving"
    source = os.path.join(model.uri, layout.SERVING_MODEL_DIR)
    # An earlier release copied straight into the version, saved_model.pb last: killed
    # during that copy, it left the variables and a cut saved_model.pb.
    torn = serving / "100"
    tf.io.gfile.makedirs(str(torn))
    for name in ("fingerprint.pb", "variables"):
        if os.path.isdir(os.path.join(source, name)):
            tf.io.gfile.makedirs(str(torn / name))
            for file in os.listdir(os.path.join(source, name)):
                tf.io.gfile.copy(os.path.join(source, name, file), str(torn / name / file))
        else:
            tf.io.gfile.copy(os.path.join(source, name), str(torn / name))
    with open(os.path.join(source, "saved_model.pb"), "rb") as f:
        (torn / "saved_model.pb").write_bytes(f.read()[:100])
    empty = serving / "101"  # killed before the first file
    os.makedirs(empty)

    _push(model.uri, str(serving), str(tmp_path / "pushed"))
    (version,) = _versions(serving)
    assert int(version) > 101
    _serves(str(serving / version))
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "torn serving version" in line] == [
        f"    removed torn serving version {torn}: an interrupted push left it without a "
        "complete saved_model.pb",
        f"    removed torn serving version {empty}: an interrupted push left it without a "
        "complete saved_model.pb",
    ]


def test_a_torn_version_holding_a_file_of_someone_else_stops_the_push(tmp_path):
    model = _model_artifact(tmp_path)
    serving = tmp_path / "serving"
    os.makedirs(serving / "100")
    (serving / "100" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds notes.txt, which dp-fedemb does not write"):
        _push(model.uri, str(serving), str(tmp_path / "pushed"))
    assert (serving / "100" / "notes.txt").read_text() == "mine"
    assert _versions(serving) == ["100"]


def test_whole_versions_are_kept_and_a_new_one_is_later_than_all(tmp_path):
    model = _model_artifact(tmp_path)
    serving = tmp_path / "serving"
    _push(model.uri, str(serving), str(tmp_path / "pushed1"))
    (first,) = _versions(serving)
    future = str(int(first) + 10**6)
    os.rename(serving / first, serving / future)  # a clock that went back
    (serving / future / "variables" / "variables.index").write_bytes(b"another model")
    _push(model.uri, str(serving), str(tmp_path / "pushed2"))
    assert _versions(serving) == [future, str(int(future) + 1)]

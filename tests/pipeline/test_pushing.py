"""The Pusher's check for a model the newest serving version already holds
(`pipeline/components/pushing.py`); the whole re-run is in test_e2e."""

import os
import shutil

from pipeline.components import pushing


def _write(root, files: dict[str, bytes]) -> str:
    for path, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "wb") as f:
            f.write(content)
    return str(root)


MODEL = {
    "saved_model.pb": b"graph",
    "fingerprint.pb": b"fp",
    "variables/variables.index": b"index",
    "variables/variables.data-00000-of-00001": b"weights" * 1000,
}


def test_the_newest_version_holding_the_model_is_found_beside_its_model_card(tmp_path):
    model = _write(tmp_path / "model", MODEL)
    serving = tmp_path / "serving"
    _write(serving / "100", {**MODEL, "variables/variables.index": b"other"})
    newest = _write(serving / "200", {**MODEL, "model_card.json": b"{}", "model_card.html": b""})
    assert pushing.newest_version_holding(model, str(serving)) == newest


def test_a_different_missing_or_extra_model_file_is_not_the_model(tmp_path):
    model = _write(tmp_path / "model", MODEL)
    serving = tmp_path / "serving"
    changed = {**MODEL, "variables/variables.data-00000-of-00001": b"weights" * 999 + b"weightz"}
    _write(serving / "200", changed)
    assert pushing.newest_version_holding(model, str(serving)) is None
    shutil.rmtree(serving / "200")
    # A push cut short before TFX copies saved_model.pb, its last file.
    _write(serving / "200", {k: v for k, v in MODEL.items() if k != "saved_model.pb"})
    assert pushing.newest_version_holding(model, str(serving)) is None
    shutil.rmtree(serving / "200")
    _write(serving / "200", {**MODEL, "variables/variables.data-00001-of-00002": b"more"})
    assert pushing.newest_version_holding(model, str(serving)) is None


def test_a_model_held_only_by_an_older_version_is_pushed_again(tmp_path):
    """Pushing it again makes it the version a model server serves."""
    model = _write(tmp_path / "model", MODEL)
    serving = tmp_path / "serving"
    _write(serving / "100", MODEL)
    _write(serving / "99", MODEL)
    assert pushing.newest_version_holding(model, str(serving)) == str(serving / "100")
    _write(serving / "200", {**MODEL, "saved_model.pb": b"another graph"})
    assert pushing.newest_version_holding(model, str(serving)) is None


def test_no_serving_directory_or_no_version_holds_nothing(tmp_path):
    model = _write(tmp_path / "model", MODEL)
    assert pushing.newest_version_holding(model, str(tmp_path / "missing")) is None
    os.makedirs(tmp_path / "serving" / "not_a_version")
    assert pushing.newest_version_holding(model, str(tmp_path / "serving")) is None

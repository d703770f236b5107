"""A user's backbone that cannot train is refused by `dp-fedemb train` and `dp-fedemb run`
in one line and a non-zero exit, before any data job runs."""

import os

import pytest

from beam_jobs import synthetic
from pipeline import cli


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("raw"))
    synthetic.write_image_folder(
        root, synthetic.SyntheticConfig(identities=6, images_per_identity=2)
    )
    return root


def _error_lines(capsys, *args: str) -> tuple[int, list[str]]:
    code = cli.main(["dp-fedemb", *args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "architecture, extra, message",
    [
        ("file:{root}/missing.keras", [], "no such file or folder"),
        ("file:{root}/notes.keras", [], "is not a Keras model"),
        ("keras:MobileNetV9", [], "has no constructor"),
        ("keras:MobileNetV3Small", ["--image-size=16"], "cannot take images of 16×16×1"),
        ("python:no_such_module_here:build", [], "is not found"),
        ("mobilenet_v3", [], "architecture must be one of"),
    ],
)
def test_train_refuses_a_bad_backbone_in_one_line_before_any_data_job(
    data, tmp_path, capsys, architecture, extra, message
):
    (tmp_path / "notes.keras").write_text("not a model")
    output = str(tmp_path / "out")
    code, lines = _error_lines(
        capsys,
        "train",
        "--data",
        data,
        "--output",
        output,
        f"--architecture={architecture.format(root=tmp_path)}",
        *extra,
    )
    assert code != 0
    assert len(lines) == 1 and message in lines[0], lines
    assert not os.path.exists(os.path.join(output, "data")), "a data job ran"


def test_run_refuses_a_bad_backbone_in_one_line(tmp_path, capsys):
    code, lines = _error_lines(
        capsys,
        "run",
        "--output",
        str(tmp_path / "out"),
        "--set",
        f"train.architecture=file:{tmp_path}/missing.keras",
    )
    assert code != 0
    assert len(lines) == 1 and "no such file or folder" in lines[0], lines
    assert not os.path.exists(tmp_path / "out" / "pipeline_root")


def test_an_unknown_batch_norm_mode_is_refused_in_one_line(data, tmp_path, capsys):
    code, lines = _error_lines(
        capsys, "train", "--data", data, "--output", str(tmp_path / "o"), "--batch-norm=freez"
    )
    assert code != 0
    assert len(lines) == 1 and "--batch-norm must be one of" in lines[0], lines

"""Issue 37: the product never deletes or overwrites a file it did not create.

`dp-fedemb train` claims its output directory (tff_algorithms/base/owned_files.py): images kept
under OUTPUT, an output inside or equal to --data, a symbolic link, or a user's file put
inside OUTPUT/data, a checkpoint or the SavedModel are refused in one line, and nothing of
the user's is removed.
"""

import json
import os

import pytest

from beam_jobs import partition_job, spill, split_protocols, splits, synthetic
from pipeline.commands import train_data
from tests import support
from tff_algorithms.base import job_files, owned_files

IMAGES = synthetic.SyntheticConfig(identities=4, images_per_identity=2, seed=1)


def _images(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def _refused_train(data, output, cwd=None) -> str:
    line, _ = support.run_refused(
        "train", "--data", str(data), "--output", str(output), timeout=300, cwd=cwd
    )
    return line


def test_images_kept_under_the_output_directory_are_refused_not_deleted(tmp_path):
    photos = tmp_path / "p" / "data" / "photos"
    synthetic.write_image_folder(str(photos), IMAGES)
    before = _images(photos)
    line = _refused_train(photos, tmp_path / "p")
    assert "--data" in line and "inside --output" in line
    assert _images(photos) == before
    # The same from the project folder, with --output .
    line = _refused_train("data/photos", ".", cwd=tmp_path / "p")
    assert "inside --output" in line
    assert _images(photos) == before
    assert sorted(os.listdir(tmp_path / "p")) == ["data"]


def test_output_equal_to_or_inside_data_is_refused(tmp_path):
    data = tmp_path / "images"
    synthetic.write_image_folder(str(data), IMAGES)
    before = _images(data)
    assert "inside --output" in _refused_train(data, data)
    assert "inside --data" in _refused_train(data, data / "out")
    assert _images(data) == before


def test_a_symlinked_output_is_refused_before_anything_is_written(tmp_path):
    data, target = tmp_path / "images", tmp_path / "elsewhere"
    synthetic.write_image_folder(str(data), IMAGES)
    target.mkdir()
    (tmp_path / "out").symlink_to(target)
    line = _refused_train(data, tmp_path / "out")
    assert "symbolic link" in line
    assert os.listdir(target) == []


def test_an_output_directory_holding_other_files_is_refused_naming_one(tmp_path):
    data, output = tmp_path / "images", tmp_path / "project"
    synthetic.write_image_folder(str(data), IMAGES)
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    line = _refused_train(data, output)
    assert "notes.txt" in line and "did not create" in line
    assert os.listdir(output) == ["notes.txt"]


@pytest.mark.slow
def test_a_users_file_in_a_killed_preparation_is_refused_not_deleted(tmp_path):
    """OUTPUT/data without prepared.json is restarted from scratch: only the files a
    preparation writes may go."""
    data, output = tmp_path / "images", tmp_path / "out"
    synthetic.write_image_folder(str(data), IMAGES)
    owned_files.claim(str(output), "train")
    prepared = owned_files.create_entry(str(output), "data")
    os.makedirs(os.path.join(prepared, "ingested"))
    beam_file = os.path.join(prepared, "ingested", "records-00000-of-00001.tfrecord")
    open(beam_file, "wb").close()
    mine = os.path.join(prepared, "ingested", "my_photo.png")
    open(mine, "wb").close()
    line = _refused_train(data, output)
    assert "my_photo.png" in line
    assert os.path.exists(mine) and os.path.exists(beam_file)
    # Without the user's file the preparation's own leftovers are removed (the layout
    # matches what prepare_data writes).
    os.remove(mine)
    owned_files.remove_tree(prepared, train_data.DATA_LAYOUT)
    assert not os.path.exists(prepared)


def test_the_data_layout_matches_a_real_preparation_and_what_a_killed_one_leaves(tmp_path):
    data, prepared_dir = tmp_path / "images", str(tmp_path / "data")
    synthetic.write_image_folder(str(data), support.TRAIN_CLI_DATA)
    split = {
        "validation_fraction": 0.2,
        "test_fraction": 0.2,
        "public_fraction": 0.0,
        "seed": 0,
        "mode": split_protocols.AUTO,  # leaves its mode check beside the summary
    }
    prepared = train_data.prepare_data(str(data), prepared_dir, split, 4, [])
    assert os.listdir(prepared.partition_dir)
    assert os.path.exists(os.path.join(prepared_dir, "split", splits.MODE_CHECK_FILE))
    assert train_data.DATA_LAYOUT.foreign_entry(prepared_dir) is None
    # A split or partition killed midway leaves its spill files (the spill folders of
    # every split mode included); a restart must be free to remove them.
    spill_dirs = [
        os.path.join(prepared_dir, "split", spill.SPILL_DIR),
        *(
            os.path.join(prepared_dir, "split", f"{mode}.{spill.SPILL_DIR}")
            for mode in split_protocols.MODES
        ),
        os.path.join(prepared_dir, "partition", partition_job.SPILL_DIR),
    ]
    for spill_dir in spill_dirs:
        os.makedirs(spill_dir)
        files = spill.SpillFiles(spill_dir)
        files.append("records", b"a record")
        files.append("shard-00003", b"a record")
        files.close()
    assert train_data.DATA_LAYOUT.foreign_entry(prepared_dir) is None
    mine = os.path.join(spill_dirs[-1], "notes.txt")
    open(mine, "w").close()
    assert train_data.DATA_LAYOUT.foreign_entry(prepared_dir) == mine
    os.remove(mine)
    owned_files.remove_tree(prepared_dir, train_data.DATA_LAYOUT)
    assert not os.path.exists(prepared_dir)


def test_pruning_checkpoints_removes_only_the_files_of_the_checkpoints_it_saved(
    tmp_path, tff_runtime
):
    process = support.toy_process()
    directory = str(tmp_path / "checkpoints")
    support.train_toy_rounds(process, directory, 1)
    mine = os.path.join(directory, "notes.txt")
    open(mine, "w").close()
    # The newest two are kept: saving rounds 2 to 4 removes rounds 1 and 2, file by file.
    result = support.train_toy_rounds(process, directory, 4)
    assert result.resumed_from_round == 1
    assert os.path.exists(mine)
    assert {name.split(".")[0] for name in os.listdir(directory)} == {
        "checkpoint",
        "ckpt-3",
        "ckpt-4",
        "notes",
    }


def test_remove_tree_checks_every_path_before_removing_any(tmp_path):
    model = tmp_path / "saved_model"
    (model / "variables").mkdir(parents=True)
    (model / "saved_model.pb").write_bytes(b"")
    (model / "variables" / "variables.index").write_bytes(b"")
    (model / "variables" / "extra").symlink_to("/etc/hostname")
    with pytest.raises(owned_files.ForeignEntryError, match="extra"):
        owned_files.remove_tree(str(model), owned_files.SAVED_MODEL)
    assert (model / "saved_model.pb").exists()
    (model / "variables" / "extra").unlink()
    os.mkfifo(model / "fifo")
    with pytest.raises(owned_files.ForeignEntryError, match="fifo"):
        owned_files.remove_tree(str(model), owned_files.SAVED_MODEL)
    (model / "fifo").unlink()
    owned_files.remove_tree(str(model), owned_files.SAVED_MODEL)
    assert not model.exists()


def test_claim_records_what_it_creates_and_adopts_legacy_outputs(tmp_path):
    output = str(tmp_path / "out")
    owned_files.claim(output, "train")
    path = owned_files.create_entry(output, job_files.METRICS_FILE)
    open(path, "w").close()
    owned_files.claim(output, "train")  # again: everything in it is recorded
    open(os.path.join(output, "theirs.txt"), "w").close()
    with pytest.raises(owned_files.ForeignEntryError, match="theirs.txt"):
        owned_files.claim(output, "train")
    with pytest.raises(owned_files.ForeignEntryError, match="theirs.txt"):
        owned_files.create_entry(output, "theirs.txt")
    # An output directory written before the record existed: its job file marks it.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in (job_files.JOB_FILE, "checkpoints", "data"):
        (legacy / name).mkdir() if "." not in name else (legacy / name).write_text("{}")
    owned_files.claim(
        str(legacy), "train", job_files.JOB_FILE, legacy_names=job_files.TRAIN_OUTPUT_NAMES
    )
    record = json.loads((legacy / owned_files.OWNED_FILE).read_text())
    assert record["created"] == sorted([job_files.JOB_FILE, "checkpoints", "data"])


def test_data_jobs_write_only_into_an_empty_folder_or_their_own(tmp_path):
    images = tmp_path / "images"
    synthetic.write_image_folder(str(images), IMAGES)
    before = _images(images)
    line, _ = support.run_refused(
        "data", "ingest", "--input", str(images), "--out", str(images), timeout=120
    )
    assert "lies in --input" in line
    line, _ = support.run_refused(
        "data", "ingest", "--input", str(images), "--out", str(tmp_path), timeout=120
    )
    assert "already holds images" in line and "did not write" in line
    assert _images(images) == before
    # Its own output again (a re-run) is accepted; another verb's is not.
    out = str(tmp_path / "ingested")
    owned_files.claim_whole(out, "data ingest")
    open(os.path.join(out, "records-00000-of-00001.tfrecord"), "wb").close()
    owned_files.claim_whole(out, "data ingest")
    with pytest.raises(owned_files.ForeignEntryError, match="data split did not write"):
        owned_files.claim_whole(out, "data split")

"""Issue 37, item 8: a disk that fills during a job.

A real small filesystem (tests/small_fs.py: a tmpfs) fills while `dp-fedemb data synth`
and `dp-fedemb train` write to it. Each time the command ends with one error line naming
the need (no traceback), nothing of the user's is lost, no temporary is left behind, and
once space is freed the same command continues to the end.
"""

import errno
import json
import os
import subprocess

import pytest

from beam_jobs import synthetic
from tests import small_fs, support
from tff_algorithms.base import job_files

# End to end or multi-minute: `make test-slow` (CI) runs it, `make test` leaves it out.
pytestmark = pytest.mark.slow

SYNTH = synthetic.SyntheticConfig(identities=40, images_per_identity=6, seed=5)
_SYNTH_FLAGS = ("--identities=40", "--images-per-identity=6", "--seed=5")


def _files(root: str) -> dict[str, bytes]:
    return {
        os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
        for d, _, names in os.walk(root)
        for f in names
    }


def test_synth_stopped_by_a_full_disk_continues_to_the_same_images(tmp_path):
    expected = str(tmp_path / "expected")
    synthetic.write_image_folder(expected, SYNTH)
    with small_fs.small_filesystem(str(tmp_path / "disk"), 120) as disk:
        out = os.path.join(disk, "synth")
        line, _ = support.run_refused("data", "synth", "--out", out, *_SYNTH_FLAGS, timeout=120)
        assert "No space left on device" in line and "re-run the same command" in line
        written = _files(out)
        assert 0 < len(written) < len(_files(expected))
        assert all(written[path] for path in written if not path.endswith(".partial"))
        small_fs.resize(disk, 8192)
        done = subprocess.run(
            [support.CONSOLE_SCRIPT, "data", "synth", "--out", out, *_SYNTH_FLAGS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert _files(out) == _files(expected)


def test_a_full_disk_stops_the_writing_processes_with_the_disks_error(tmp_path):
    expected = str(tmp_path / "expected")
    synthetic.write_image_folder(expected, SYNTH, processes=1)
    with small_fs.small_filesystem(str(tmp_path / "disk"), 120) as disk:
        out = os.path.join(disk, "synth")
        with pytest.raises(OSError) as raised:
            synthetic.write_image_folder(out, SYNTH, processes=2)
        assert raised.value.errno == errno.ENOSPC
        small_fs.resize(disk, 8192)
        synthetic.write_image_folder(out, SYNTH, processes=2)
        assert _files(out) == _files(expected)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_train_stopped_by_a_full_disk_loses_nothing_and_the_rerun_completes(tmp_path):
    data = str(tmp_path / "images")
    synthetic.write_image_folder(data, support.TRAIN_CLI_DATA)
    images = _files(data)
    command = [support.CONSOLE_SCRIPT, "train", "--data", data, *support.train_cli_flags(2)]
    # KiB free for each attempt: in data preparation, in the first checkpoints, at export.
    sizes = (400, 2400, 5200)
    with small_fs.small_filesystem(str(tmp_path / "disk"), sizes[0]) as disk:
        output = os.path.join(disk, "out")
        stopped_in = []
        for size in sizes:
            small_fs.resize(disk, size)
            attempt = subprocess.run(
                [*command, "--output", output], capture_output=True, text=True, timeout=900
            )
            if attempt.returncode == 0:
                break
            errors = [line for line in attempt.stderr.splitlines() if ": error: " in line]
            assert len(errors) == 1, attempt.stderr[-3000:]
            assert "No space left on device" in errors[0], errors[0]
            assert "Traceback" not in attempt.stderr, attempt.stderr[-3000:]
            assert not [n for n in os.listdir(output) if ".tmp-" in n]
            stopped_in.append(sorted(os.listdir(output)))
            assert _files(data) == images
        assert len(stopped_in) >= 2, stopped_in  # the disk filled at several points
        small_fs.resize(disk, 65536)
        done = subprocess.run(
            [*command, "--output", output], capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = json.load(open(os.path.join(output, job_files.METRICS_FILE)))
        assert metrics["rounds"] == 2 and metrics["epsilon"] > 0
        assert os.path.exists(os.path.join(output, job_files.SAVED_MODEL_DIR, "saved_model.pb"))
        assert _files(data) == images


def test_a_read_only_file_system_is_called_read_only(tmp_path):
    """Issue 63: it was reported as "free space (or write to a larger disk)"."""
    with small_fs.small_filesystem(str(tmp_path / "disk"), 8192) as disk:
        os.makedirs(os.path.join(disk, "synth"))
        small_fs.remount(disk, "ro")
        line, _ = support.run_refused(
            "data", "synth", "--out", os.path.join(disk, "synth"), *_SYNTH_FLAGS, timeout=120
        )
    assert "Read-only file system" in line and "the file system is read-only" in line, line
    assert "free space" not in line, line

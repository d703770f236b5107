"""pipeline/console.py: the libraries' known noise leaves the console for the full log,
everything else still reaches the user; round progress lines."""

import io
import os
import subprocess
import sys
import warnings

from pipeline import console

NOISE = (
    "2026-11-25 15:19:01.517459: E tensorflow/compiler/xla/stream_executor/cuda/"
    "cuda_dnn.cc:9342] Unable to register cuDNN factory: Attempting to register factory "
    "for plugin cuDNN when one has already been registered"
)
UNKNOWN = "E0000 something nobody has seen before: disk full"


def test_known_noise_goes_to_the_log_and_everything_else_to_the_console(tmp_path, capfd):
    with console.QuietStderr() as quiet:
        # Written by a child process that inherited descriptor 2, as C++ and workers do.
        subprocess.run(
            [sys.executable, "-c", f"import sys; print({NOISE!r}, file=sys.stderr)"], check=True
        )
        os.write(2, f"{UNKNOWN}\n".encode())
        with warnings.catch_warnings():
            # Shown whatever filters earlier imports in this session installed.
            warnings.simplefilter("always")
            warnings.warn("a library's FutureWarning", FutureWarning, stacklevel=1)
        console.keep_log_in(str(tmp_path), "test")
        os.write(2, b"ArtifactQuery.property_predicate is not supported.\n")
    captured = capfd.readouterr()
    # Other threads of the test session may write too: judge only the lines written here.
    assert f"{UNKNOWN}\n" in captured.err
    assert NOISE not in captured.err and "FutureWarning" not in captured.err
    assert "ArtifactQuery" not in captured.err
    assert f"dp-fedemb test: full log in {quiet.log_path}\n" in captured.out
    assert os.path.dirname(quiet.log_path) == str(tmp_path / console.LOG_DIR)
    logged = open(quiet.log_path).read()
    # Before and after the log's directory was known; lines through descriptor 2 in
    # their order (a Python warning is logged at once, so it may come before a line
    # still in the pipe).
    warning, artifact = "a library's FutureWarning", "ArtifactQuery.property_predicate"
    for before, after in ((NOISE, UNKNOWN), (UNKNOWN, artifact), (warning, artifact)):
        assert logged.index(before) < logged.index(after)
    os.write(2, b"after the command\n")  # descriptor 2 is the console again
    assert "after the command\n" in capfd.readouterr().err


def test_verbose_shows_everything(monkeypatch, capfd):
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    with console.QuietStderr():
        os.write(2, f"{NOISE}\n".encode())
    assert f"{NOISE}\n" in capfd.readouterr().err


def test_nested_filters_are_one(capfd):
    with console.QuietStderr() as outer, console.QuietStderr() as inner:
        assert inner is outer
        os.write(2, f"{NOISE}\n{UNKNOWN}\n".encode())
    err = capfd.readouterr().err
    assert f"{UNKNOWN}\n" in err and NOISE not in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _record(round_number: int, seconds: float, epsilon: float, recall=None) -> dict:
    record = {"round": round_number, "round_seconds": seconds, "epsilon": epsilon}
    if recall is not None:
        record["eval"] = {"recall_at_far": {"0.001": recall}}
    return record


def test_round_progress_lines_piped_and_on_a_terminal():
    piped = io.StringIO()
    progress = console.RoundProgress(4, label="PrivateTrain", stream=piped)
    progress(_record(1, 30.0, 1.5, recall=0.25))
    progress(_record(2, 10.0, 2.25))
    lines = piped.getvalue().splitlines()
    # The last recall carries over; 2 rounds left at the mean of 30 s and 10 s.
    assert lines == [
        "PrivateTrain round 1/4  30.00s  ε 1.5  recall@FAR=1e-3 0.2500  1m30s left",
        "PrivateTrain round 2/4  10.00s  ε 2.25  recall@FAR=1e-3 0.2500  40s left",
    ]
    terminal = _Terminal()
    progress = console.RoundProgress(2, stream=terminal)
    progress(_record(1, 1.0, float("inf")))
    progress(_record(2, 1.0, float("inf")))
    # One line rewritten in place, ended after the last round.
    assert terminal.getvalue() == (
        "\r\x1b[Kround 1/2  1.00s  ε inf (non-private)  1s left"
        "\r\x1b[Kround 2/2  1.00s  ε inf (non-private)  0s left\n"
    )


def test_tf_datas_cancelled_optimisation_line_is_noise():
    """Seen on stderr of a loaded machine only (issue 37, item 9): a console test must
    not depend on the machine's load."""
    line = (
        "2026-11-26 10:01:02.345678: W tensorflow/core/data/root_dataset.cc:297] "
        "Optimization loop failed: CANCELLED: Operation was cancelled"
    )
    assert console.is_noise(line)
    assert not console.is_noise("tensorflow/core/data/root_dataset.cc:297] something else")


def test_a_full_disk_stops_the_log_copy_not_the_command(tmp_path, capfd):
    from tests import small_fs

    with small_fs.small_filesystem(str(tmp_path / "disk"), 16) as disk:
        with console.QuietStderr() as quiet:
            console.keep_log_in(disk, "test")
            for _ in range(200):  # far more than the disk holds
                os.write(2, b"x" * 200 + b"\n")
            os.write(2, f"{UNKNOWN}\n".encode())
        err = capfd.readouterr().err
        assert "the full log" in err and "stops here: No space left on device" in err
        assert f"{UNKNOWN}\n" in err  # the console still shows what the command says
        assert os.path.getsize(quiet.log_path) > 0
        # A disk that takes no new folder: one warning, and the command goes on.
        small_fs.remount(disk, "ro")
        with console.QuietStderr():
            console.keep_log_in(os.path.join(disk, "other"), "test2")
            os.write(2, f"{UNKNOWN}\n".encode())
        err = capfd.readouterr().err
        assert "dp-fedemb test2: warning: could not keep the full log" in err
        assert f"{UNKNOWN}\n" in err


_FULL_CHECKPOINT = """
import sys
import tensorflow as tf
from pipeline import console

with console.QuietStderr():
    console.keep_log_in(sys.argv[2], "test")
    try:
        tf.train.Checkpoint(v=tf.Variable(tf.zeros([1 << 20]))).write(sys.argv[1])
    except tf.errors.OpError as e:
        print("refused:", type(e).__name__)
"""


def test_tensorflows_op_requires_line_of_a_full_disk_stays_off_the_console(tmp_path):
    """Issue 63: a checkpoint or export on a full disk added TensorFlow's kernel line
    `W tensorflow/core/framework/op_kernel.cc ... OP_REQUIRES failed ...` to the console;
    the command's own error line says what to do. It stays in the full log."""
    from tests import small_fs

    with small_fs.small_filesystem(str(tmp_path / "disk"), 64) as disk:
        done = subprocess.run(
            [sys.executable, "-c", _FULL_CHECKPOINT, f"{disk}/ckpt", str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
        )
    assert "refused:" in done.stdout, done.stdout
    assert "OP_REQUIRES" not in done.stderr, done.stderr
    (log,) = os.listdir(tmp_path / console.LOG_DIR)
    logged = (tmp_path / console.LOG_DIR / log).read_text()
    assert "OP_REQUIRES failed" in logged and "No space left on device" in logged

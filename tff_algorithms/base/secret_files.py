"""Files and directories that hold secrets: the schedule seed (OUTPUT/train_job.json),
the noise state (OUTPUT/checkpoints) and the privacy and budget ledgers.

Files are readable by their owner only (0600), directories by their owner only
(0700). A write goes to a new temporary file in the target's directory, is synced,
and replaces the target in one rename, so a crash leaves the old content or the new,
never a mix. No path is followed through a symbolic link: another local user who
plants one at a secret's path could otherwise have the secret written into a file of
their choosing (or an existing file of ours overwritten), so a symlink is refused.

Local paths only; cloud paths ("gs://...") have no modes or symlinks, their access is
the bucket's (callers keep `tf.io.gfile` for those).
"""

from __future__ import annotations

import contextlib
import os
import uuid

FILE_MODE = 0o600
DIR_MODE = 0o700


def _refuse_symlink(path: str) -> None:
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; refusing to follow it for a secret file")


def private_dir(path: str, *, tighten_existing: bool = False) -> None:
    """Creates directory `path` (and missing parents) with the leaf 0700.

    An existing directory keeps its mode unless `tighten_existing` (for directories
    this project names and owns, such as OUTPUT/checkpoints; never a directory the
    user chose, which might be shared, e.g. /tmp). A symlink is refused either way.
    """
    _refuse_symlink(path)
    try:
        os.makedirs(path, mode=DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    if created or tighten_existing:
        # Through a descriptor opened without following links: a symlink swapped in
        # after the check above fails here instead of having its target chmod-ed.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, DIR_MODE)  # makedirs' mode is narrowed by the umask only
        finally:
            os.close(fd)


def read_text(path: str) -> str | None:
    """The file's text, or None when it does not exist; a symlink is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:
        _refuse_symlink(path)  # O_NOFOLLOW on a link fails with ELOOP: say why
        raise
    with os.fdopen(fd, encoding="utf-8") as f:
        return f.read()


def open_lock(path: str) -> int:
    """A descriptor for lock file `path`, created 0600, never through a symlink."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
    except OSError:
        _refuse_symlink(path)
        raise


def write_text(path: str, text: str) -> None:
    """Replaces `path`'s content with `text` atomically and durably, as a 0600 file."""
    _refuse_symlink(path)
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    # O_EXCL: the temporary name is new, so nothing planted there is written through.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise
    # The rename itself is durable only once the directory is.
    directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)

"""Image folders ROOT/<user_id>/<identity>/<file>.{png,jpg,jpeg}: the one reader of every
command that reads image files (ingest's `ReadImageFolder`, `dp-fedemb evaluate --data`).

It imports no Beam, so the evaluation side (tff_algorithms) uses it too. Every file
comes back as a `CheckedImage` or a `BadInput` with its reason, never an exception:
- names: user, identity and file names must pass `schema.check_name` (control,
  line-separator and bidirectional-override characters, undecodable bytes), else
  invalid_name. Local folders are listed with bytes names, so no name can break the
  listing itself.
- file type, before opening: only regular files are read. A symbolic link is judged by
  what it points to: to a regular file it is read, to a FIFO, device, socket, folder or
  nothing it is unreadable_file and never opened. The file is then opened non-blocking
  and checked again on the open descriptor (the path may have been swapped since).
- size, before reading: 0 bytes is empty_image; over `max_encoded_bytes(max_pixels)` is
  image_too_large. The read stops one byte past that bound, so a growing file is caught.
- content: `schema.validate` (magic bytes, pixel limit from the header, decoding).
Remote folders (gs://...) go through tf.io.gfile, with the same checks of size and read
bound; they hold no FIFOs or devices.
"""

import dataclasses
import os
import stat
from collections.abc import Iterator

import tensorflow as tf

from beam_jobs import schema

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")

# Bad-input reasons beyond the schema's own (missing_field, corrupt_image, ...).
EMPTY_USER = "empty_user"
UNREADABLE_FILE = "unreadable_file"
MISPLACED_FILE = "misplaced_file"
# A hidden entry (a name with a leading ".": .git, .DS_Store, a sync tool's folder) is
# skipped without being read, and counted apart from bad inputs: it is not a bad share.
HIDDEN_ENTRY = "hidden_entry"
SKIPPED_REASONS = frozenset({HIDDEN_ENTRY})

FILE_NAME_FIELD = "file name"
# No PNG or JPEG within the pixel limit needs more than this many bytes per pixel
# (16-bit RGBA, uncompressed); a bigger file is refused before it is read.
_MAX_ENCODED_BYTES_PER_PIXEL = 8
_SPECIAL_FILE_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


@dataclasses.dataclass(frozen=True)
class BadInput:
    reason: str
    source: str  # file, folder or "database#client", non-printable characters escaped
    detail: str


@dataclasses.dataclass(frozen=True)
class CheckedImage:
    record: schema.CanonicalRecord
    mode: str  # the image's own PIL mode; modes other than L and RGB are converted


def printable(text: str) -> str:
    """`text` with control characters and undecodable bytes escaped, for reports and logs."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in text)


def bad_input(reason: str, source: str | bytes, detail: str) -> BadInput:
    if isinstance(source, bytes):
        source = os.fsdecode(source)
    return BadInput(reason, printable(source), printable(detail))


def check_record(
    record: schema.CanonicalRecord, source: str | bytes, max_pixels: int
) -> CheckedImage | BadInput:
    """The record with its image's mode if it validates (`schema.validate`), else why not."""
    try:
        return CheckedImage(record, schema.validate(record, max_pixels))
    except schema.RecordError as e:
        return bad_input(e.reason, source, str(e))


def max_encoded_bytes(max_pixels: int) -> int:
    """The largest image file read for a pixel limit; bigger files are image_too_large."""
    return max_pixels * _MAX_ENCODED_BYTES_PER_PIXEL


def _is_remote(path: bytes) -> bool:
    return b"://" in path


def _entries(folder: bytes) -> list[bytes]:
    """Names in `folder`, sorted, hidden ones (`HIDDEN_ENTRY`) included."""
    if _is_remote(folder):
        names = [os.fsencode(n.rstrip("/")) for n in tf.io.gfile.listdir(os.fsdecode(folder))]
    else:
        names = os.listdir(folder)
    return sorted(names)


def _hidden(path: bytes) -> BadInput:
    return bad_input(HIDDEN_ENTRY, path, "a hidden name (leading '.'): skipped, not read")


def _is_folder(path: bytes) -> bool:
    if _is_remote(path):
        return tf.io.gfile.isdir(os.fsdecode(path))
    return os.path.isdir(path)


def _special_kind(mode: int) -> str | None:
    """What a file is when it is not a regular file, else None."""
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _SPECIAL_FILE_KINDS if is_kind(mode)), "not a file")


def _size_error(path: bytes, size: int, max_pixels: int) -> BadInput | None:
    if size == 0:
        return bad_input(schema.EMPTY_IMAGE, path, "image file is empty (0 bytes)")
    if size > max_encoded_bytes(max_pixels):
        return bad_input(
            schema.IMAGE_TOO_LARGE,
            path,
            f"{size} bytes cannot hold an image within {max_pixels} pixels",
        )
    return None


def _read_local(path: bytes, max_pixels: int) -> bytes | BadInput:
    # stat follows a symbolic link: the link is judged by what it points to.
    kind = _special_kind(os.stat(path).st_mode)
    if kind is not None:
        return bad_input(UNREADABLE_FILE, path, f"is {kind}, not a regular file")
    # Non-blocking: a FIFO swapped in after the check above opens at once, and is
    # refused by the check on the descriptor below instead of waiting for a writer.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with open(descriptor, "rb", closefd=True) as opened:
        status = os.fstat(descriptor)
        kind = _special_kind(status.st_mode)
        if kind is not None:
            return bad_input(UNREADABLE_FILE, path, f"is {kind}, not a regular file")
        size_error = _size_error(path, status.st_size, max_pixels)
        if size_error is not None:
            return size_error
        data = opened.read(max_encoded_bytes(max_pixels) + 1)
    return _size_error(path, len(data), max_pixels) or data


def _read_remote(path: bytes, max_pixels: int) -> bytes | BadInput:
    name = os.fsdecode(path)
    size_error = _size_error(path, tf.io.gfile.stat(name).length, max_pixels)
    if size_error is not None:
        return size_error
    with tf.io.gfile.GFile(name, "rb") as opened:
        data = opened.read(max_encoded_bytes(max_pixels) + 1)
    return _size_error(path, len(data), max_pixels) or data


def read_image(
    path: bytes, user_id: str, identity: str, max_pixels: int
) -> CheckedImage | BadInput:
    """The image file at `path` as the checked record (user_id, identity, its bytes)."""
    try:
        read = _read_remote if _is_remote(path) else _read_local
        data = read(path, max_pixels)
    except (OSError, tf.errors.OpError) as e:
        message = getattr(e, "strerror", None) or str(e).splitlines()[0]
        return bad_input(UNREADABLE_FILE, path, message)
    if isinstance(data, BadInput):
        return data
    return check_record(schema.CanonicalRecord(user_id, identity, data), path, max_pixels)


def _name_error(name: str, field: str) -> schema.RecordError | None:
    try:
        schema.check_name(name, field)
    except schema.RecordError as e:
        return e
    return None


def list_user_folders(root: str) -> list[bytes]:
    """The user folders under `root` as bytes paths: a name with undecodable bytes must
    survive to be counted (Beam's string coder would refuse it as str)."""
    root_bytes = os.fsencode(root)
    paths = (os.path.join(root_bytes, name) for name in _entries(root_bytes))
    # Hidden ones too, so that reading them counts them (`read_user_folder`).
    return [path for path in paths if _is_folder(path)]


def read_user_folder(user_folder: bytes, max_pixels: int) -> Iterator[CheckedImage | BadInput]:
    """One user's folder -> a CheckedImage or BadInput per file; a file directly in the
    user folder is misplaced_file, a user folder without image files empty_user.

    Files with an invalid user, identity or file name are invalid_name and never read;
    files that are not .png/.jpg/.jpeg are unsupported_image_format. A hidden user
    folder, identity folder or file is `HIDDEN_ENTRY`, never read.
    """
    if os.path.basename(user_folder.rstrip(b"/")).startswith(b"."):
        yield _hidden(user_folder)
        return
    user_id = os.fsdecode(os.path.basename(user_folder.rstrip(b"/")))
    user_error = _name_error(user_id, schema.USER_ID_KEY)
    images = 0
    for identity in _entries(user_folder):
        folder = os.path.join(user_folder, identity)
        if identity.startswith(b"."):
            yield _hidden(folder)
            continue
        if not _is_folder(folder):
            yield bad_input(MISPLACED_FILE, folder, "files must sit in ROOT/<user_id>/<identity>/")
            continue
        identity_name = os.fsdecode(identity)
        folder_error = user_error or _name_error(identity_name, schema.IDENTITY_KEY)
        for name in _entries(folder):
            path = os.path.join(folder, name)
            if name.startswith(b"."):
                yield _hidden(path)
                continue
            file_name = os.fsdecode(name)
            if not file_name.lower().endswith(IMAGE_EXTENSIONS):
                yield bad_input(schema.UNSUPPORTED_IMAGE_FORMAT, path, "not a .png/.jpg/.jpeg file")
                continue
            images += 1  # an image file, good or bad: the user is not empty
            name_error = folder_error or _name_error(file_name, FILE_NAME_FIELD)
            if name_error is not None:
                yield bad_input(name_error.reason, path, str(name_error))
                continue
            yield read_image(path, user_id, identity_name, max_pixels)
    if images == 0:
        yield bad_input(EMPTY_USER, user_folder, "user folder holds no images")


def read_image_folder(root: str, max_pixels: int) -> Iterator[CheckedImage | BadInput]:
    """Every user folder of `root` in turn (`read_user_folder`), users in name order."""
    for user_folder in list_user_folders(root):
        yield from read_user_folder(user_folder, max_pixels)


def bad_share_error(
    what: str, records: int, bad_by_reason: dict[str, int], max_bad_fraction: float, setting: str
) -> str | None:
    """The one-line error when bad inputs are over `max_bad_fraction` of all, else None;
    `setting` names the limit as the user sets it. Skipped entries (`SKIPPED_REASONS`)
    are neither bad nor inputs."""
    bad_by_reason = {r: n for r, n in bad_by_reason.items() if r not in SKIPPED_REASONS}
    bad = sum(bad_by_reason.values())
    total = records + bad
    if total == 0 or bad / total <= max_bad_fraction:
        return None
    reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(bad_by_reason.items()))
    return (
        f"{what}: {bad} of {total} inputs are bad ({bad / total:.1%} > {setting} "
        f"{max_bad_fraction:.1%}): {reasons}"
    )

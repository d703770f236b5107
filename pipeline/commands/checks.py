"""Checks every command runs on its flags before anything heavy is imported or started.

Nothing here imports TensorFlow, TFF, Beam or TFX: `dp-fedemb COMMAND ...` with a bad
flag, a missing input or an output it cannot write answers with one line in about a
second (issue 29). Each check raises `ValueError` with one line naming the flag and
what to change; `pipeline.cli` prints it and exits non-zero.
"""

from __future__ import annotations

import difflib
import math
import os
import tempfile
from collections.abc import Iterable
from typing import Any


def shown(text: Any) -> str:
    """`text` for a one-line message: escaped when it holds control characters."""
    text = str(text)
    return text if text.isprintable() else ascii(text)


def closest(value: str, choices: Iterable[str]) -> str | None:
    """The choice closest to `value` (difflib), or None when none is close."""
    matches = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(value: str, choices: Iterable[str], prefix: str = "") -> str:
    """'; did you mean X?' for the closest choice, or '' when none is close."""
    match = closest(value, choices)
    return f"; did you mean {prefix}{match}?" if match else ""


def required(flag_values: Any, *names: str) -> None:
    for name in names:
        value = flag_values[name].value
        if value is None or value == "" or value == []:
            raise ValueError(f"--{name} is required")


def no_arguments(args: Iterable[str]) -> None:
    args = list(args)
    if args:
        raise ValueError(
            f"unexpected arguments: {shown(' '.join(args))}; give values as --flag=value"
        )


def _path_text(flag: str, path: str) -> None:
    if not path:
        raise ValueError(f"--{flag} must not be empty")
    if "\x00" in path:
        raise ValueError(f"--{flag} {shown(path)} holds a NUL character; give a real path")


def _is_remote(path: str) -> bool:
    return "://" in path


def _resolves(flag: str, path: str) -> None:
    """Refuse symlink loops (and paths too long to resolve) with one line."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise ValueError(
            f"--{flag} {shown(path)}: a part of the path is a file, not a directory"
        ) from None
    except OSError as e:
        raise ValueError(f"--{flag} {shown(path)}: {e.strerror or type(e).__name__}") from None


def _probe_writable(flag: str, path: str) -> None:
    """Create and remove one empty file in directory `path` (root passes every
    permission bit, so `os.access` cannot tell; read-only mounts neither)."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".dp-fedemb-write-check-", dir=path)
        os.close(handle)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"--{flag} {shown(path)} is not writable ({e.strerror or type(e).__name__}); "
            "give a writable directory"
        ) from None


def output_dir(flag: str, path: str, *, create: bool = True) -> None:
    """`path` is a writable directory, or is made one (with its parents) when `create`;
    without `create` nothing is written and its nearest existing ancestor must be a
    writable directory (`os.access`: exact for read-only mounts, not for root's
    permission bits)."""
    _path_text(flag, path)
    if _is_remote(path):
        return
    _resolves(flag, path)
    if os.path.lexists(path) and not os.path.exists(path):
        raise ValueError(f"--{flag} {shown(path)} is a broken link; give a directory")
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(
                f"--{flag} {shown(path)} is an existing file, not a directory; give a directory"
            )
        if create:
            _probe_writable(flag, path)
        elif not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--{flag} {shown(path)} is not writable; give a writable directory")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        if os.path.islink(parent):
            raise ValueError(f"--{flag} {shown(path)}: {shown(parent)} is a broken link")
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(
            f"--{flag} {shown(path)}: {shown(parent)} is a file, so the directory cannot be "
            "made; give another path"
        )
    if not create:
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(
                f"--{flag} {shown(path)} cannot be made: {shown(parent)} is not writable"
            )
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--{flag} {shown(path)} cannot be made ({e.strerror or type(e).__name__}); "
            "give a writable directory"
        ) from None
    _probe_writable(flag, path)


def output_file(flag: str, path: str, *, create: bool = True) -> None:
    """`path` is a file that can be written: not a directory, and its directory exists
    or is made (without `create`: could be made, see `output_dir`)."""
    _path_text(flag, path)
    if _is_remote(path):
        return
    _resolves(flag, path)
    if os.path.isdir(path):
        raise ValueError(f"--{flag} {shown(path)} is a directory; give a file name")
    # Its directory is made now (the command would make it next): what cannot be made
    # (e.g. under /proc, where `os.access` says yes) is refused before any work.
    output_dir(flag, os.path.dirname(os.path.abspath(path)), create=create)


def input_path(flag: str, path: str, kind: str = "any") -> None:
    """`path` exists (kind: any, dir or file). Patterns and remote paths are left to the
    job that reads them."""
    _path_text(flag, path)
    if _is_remote(path) or any(c in path for c in "*?["):
        return
    _resolves(flag, path)
    if not os.path.exists(path):
        raise ValueError(f"--{flag} {shown(path)} does not exist")
    if kind == "dir" and not os.path.isdir(path):
        raise ValueError(f"--{flag} {shown(path)} is not a directory")
    if kind == "file" and not os.path.isfile(path):
        raise ValueError(f"--{flag} {shown(path)} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"--{flag} {shown(path)} is not readable")


def number(
    flag: str,
    value: float | int | None,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A finite number within [low, high] (or open ends); None (not given) passes."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"--{flag} must be a finite number, got {value}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return
    if high is None:
        bound = f"{'>' if low_open else '>='} {_number_text(low)}"
    elif low is None:
        bound = f"{'<' if high_open else '<='} {_number_text(high)}"
    else:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        bound = f"in {left}{_number_text(low)}, {_number_text(high)}{right}"
    raise ValueError(f"--{flag} must be {bound}, got {_number_text(value)}")


def _number_text(value: float | int) -> str:
    """A number for a message, without float conversion of huge integers."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
        return text if len(text) <= 24 else f"{text[:8]}...({len(text)} digits)"
    return f"{value:g}"

"""What a command created in its output directory: the only files it may remove or replace.

A user's output directory may hold their own files (a project folder given as
`--output .`, images kept under OUTPUT/data). So a command that writes OUTPUT first
`claim`s it: OUTPUT/.dp-fedemb-owned.json lists each top-level entry the product
created there (`create_entry` records a name before the entry is made, so a crash
between the two leaves nothing unrecorded). A directory holding any entry that is not
recorded is refused in one line naming that entry, before anything is written. An
output directory written before this record existed (it holds `legacy_marker`) adopts
the entries of the product's own names.

Inside its own directories the product removes a tree only through `remove_tree`, which
first checks every path below it against the layout of what the product writes there
(`TreeLayout`: a SavedModel, a data preparation's Beam outputs) and refuses, naming the
first path that does not belong, without removing anything. So a user's file put inside
OUTPUT/data or OUTPUT/saved_model is never deleted.

No TensorFlow: the CLI's checks use this before heavy imports. Local paths only (a
bucket path has no such record; its access control applies).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable

from tff_algorithms.base import secret_files

OWNED_FILE = ".dp-fedemb-owned.json"
OWNED_FORMAT = "dp-fedemb-owned/1"
# The atomic writes' temporaries (`secret_files.write_text`) of a recorded file.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9a-f]{32}$")


class ForeignEntryError(ValueError):
    """A path the product did not create is where it would write or remove."""


def is_local(path: str) -> bool:
    return "://" not in path


def _shown(path: str) -> str:
    return path if path.isprintable() else ascii(path)


def _read_owned(directory: str) -> list[str] | None:
    try:
        text = secret_files.read_text(os.path.join(directory, OWNED_FILE))
    except ValueError:
        raise ForeignEntryError(
            f"{_shown(os.path.join(directory, OWNED_FILE))} is a symbolic link; "
            "give an output directory dp-fedemb created, or a new one"
        ) from None
    if text is None:
        return None
    try:
        data = json.loads(text)
        created = data["created"] if data.get("format") == OWNED_FORMAT else None
    except (ValueError, TypeError, AttributeError, KeyError):
        created = None
    if not isinstance(created, list) or not all(isinstance(n, str) for n in created):
        raise ForeignEntryError(
            f"{_shown(os.path.join(directory, OWNED_FILE))} is not dp-fedemb's record of "
            "what it created; give a new output directory"
        )
    return created


def _write_owned(directory: str, created: Iterable[str]) -> None:
    record = {"format": OWNED_FORMAT, "created": sorted(set(created))}
    secret_files.write_text(os.path.join(directory, OWNED_FILE), json.dumps(record, indent=1))


def _is_ours(name: str, created: set[str]) -> bool:
    if name == OWNED_FILE or name in created:
        return True
    temporary = _TEMPORARY.match(name)
    return bool(temporary and temporary.group("name") in created)


def refuse_symlink(directory: str, setting: str) -> None:
    """An output that is a symbolic link is refused: what it points to may be anyone's."""
    if os.path.islink(directory):
        raise ForeignEntryError(
            f"{setting} {_shown(directory)} is a symbolic link; give the directory it points "
            "to, or a new one"
        )


def claim(
    directory: str, command: str, legacy_marker: str = "", legacy_names: Iterable[str] = ()
) -> None:
    """Makes `directory` (0700 when new) an output directory of the product, or refuses it.

    Refused (ForeignEntryError, one line, nothing written): a symbolic link, a file, or
    a directory holding an entry the product did not create. `legacy_marker` /
    `legacy_names`: a directory written before the record existed holds
    `legacy_marker`; its entries among `legacy_names` are adopted as the product's.
    """
    if not is_local(directory):
        return
    refuse_symlink(directory, "output")
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise ForeignEntryError(f"output {_shown(directory)} is not a directory")
    entries = os.listdir(directory) if os.path.isdir(directory) else []
    created = _read_owned(directory) if entries else None
    if created is None:
        adopted = set(legacy_names) if legacy_marker and legacy_marker in entries else set()
        foreign = sorted(name for name in entries if not _is_ours(name, adopted))
        if foreign:
            raise ForeignEntryError(
                f"output {_shown(directory)} already holds {_shown(foreign[0])}"
                f"{f' and {len(foreign) - 1} other entries' if len(foreign) > 1 else ''}, "
                f"which dp-fedemb {command} did not create; give an empty or new directory "
                "(the product never writes over or removes files it did not create)"
            )
        secret_files.private_dir(directory)
        _write_owned(directory, [n for n in entries if n != OWNED_FILE])
        return
    foreign = sorted(name for name in entries if not _is_ours(name, set(created)))
    if foreign:
        raise ForeignEntryError(
            f"output {_shown(directory)} holds {_shown(foreign[0])}, which dp-fedemb did not "
            f"create; move it out of {_shown(directory)} and re-run"
        )


def claim_whole(directory: str, command: str) -> None:
    """Claims `directory` for a job whose writer names its own files and removes none
    (a Beam job's `--out`): it must be new, empty, or one the same command wrote before
    (re-running it writes the same names again). Else refused in one line naming an
    entry, before anything is written."""
    if not is_local(directory):
        return
    refuse_symlink(directory, "output")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, OWNED_FILE)
    entries = sorted(n for n in os.listdir(directory) if n != OWNED_FILE)
    try:
        text = secret_files.read_text(path)
        owner = json.loads(text).get("command") if text else None
    except (ValueError, AttributeError):
        owner = None
    if entries and owner != command:
        raise ForeignEntryError(
            f"output {_shown(directory)} already holds {_shown(entries[0])}, which "
            f"dp-fedemb {command} did not write; give an empty or new directory"
        )
    if owner is None:
        secret_files.write_text(
            path, json.dumps({"format": OWNED_FORMAT, "created": [], "command": command})
        )


def created_entries(directory: str) -> list[str]:
    """The top-level entries recorded as the product's in claimed `directory`."""
    if not is_local(directory):
        return []
    return _read_owned(directory) or []


def create_entry(directory: str, name: str) -> str:
    """Records top-level `name` in claimed `directory` as the product's; returns its path.

    Recorded before the caller creates it. An existing entry that was not recorded is
    refused: it is the user's.
    """
    path = os.path.join(directory, name)
    if not is_local(directory):
        return path
    created = _read_owned(directory)
    if created is None:
        raise ForeignEntryError(
            f"{_shown(directory)} was not claimed as an output directory; a bug: claim it first"
        )
    if name in created:
        return path
    if os.path.lexists(path):
        raise ForeignEntryError(
            f"{_shown(path)} exists but dp-fedemb did not create it; move it away and re-run"
        )
    _write_owned(directory, [*created, name])
    return path


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """The relative paths (with '/' separators) the product writes under one directory.

    files / directories: full-match regular expressions; `name` names the layout in
    messages.
    """

    name: str
    files: str
    directories: str

    def foreign_entry(self, root: str) -> str | None:
        """The first path under `root` that is not part of this layout (symbolic links,
        FIFOs and devices never are), or None."""
        files, directories = re.compile(self.files), re.compile(self.directories)
        for current, subdirs, names in os.walk(root):
            relative = os.path.relpath(current, root)
            prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"
            for name in sorted(subdirs):
                path = os.path.join(current, name)
                if os.path.islink(path) or not directories.fullmatch(prefix + name):
                    return path
            for name in sorted(names):
                path = os.path.join(current, name)
                if (
                    os.path.islink(path)
                    or not os.path.isfile(path)
                    or not files.fullmatch(prefix + name)
                ):
                    return path
        return None


# A SavedModel, and what TensorFlow's saver leaves of one it was writing when stopped
# (variables/variables_temp/part-*, `.tempstate<n>` and `.tmp<hex>` files).
_SHARD = r"\d{5}-of-\d{5}"
_SAVED_MODEL_FILES = (
    r"(saved_model\.pb|fingerprint\.pb|keras_metadata\.pb"
    rf"|variables/variables\.(index|data-{_SHARD})"
    rf"|variables/variables_temp/part-{_SHARD}\.(index|data-{_SHARD}))"
    r"(\.tempstate\d+|\.tmp[0-9a-f]{32})?"
)
SAVED_MODEL = TreeLayout(
    "a SavedModel",
    _SAVED_MODEL_FILES,
    r"(assets|variables|variables/variables_temp|assets\.extra)",
)


def remove_tree(path: str, layout: TreeLayout) -> None:
    """Removes directory `path` if everything in it is what the product writes there
    (`layout`); else removes nothing and raises ForeignEntryError naming the first
    path that is not. A missing `path` is nothing to do."""
    if not is_local(path):
        import tensorflow as tf  # bucket paths: no links or foreign files to tell apart

        if tf.io.gfile.exists(path):
            tf.io.gfile.rmtree(path)
        return
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise ForeignEntryError(
            f"{_shown(path)} should be {layout.name} written by dp-fedemb but is not a "
            "directory; move it away and re-run"
        )
    foreign = layout.foreign_entry(path)
    if foreign is not None:
        raise ForeignEntryError(
            f"{_shown(foreign)} is not part of {layout.name} dp-fedemb wrote, and removing "
            f"{_shown(path)} would delete it; move it out and re-run"
        )
    shutil.rmtree(path)


def overlapping(inside: str, outside: str) -> bool:
    """Whether path `inside` is `outside` or lies below it, links resolved."""
    inner, outer = os.path.realpath(inside), os.path.realpath(outside)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)

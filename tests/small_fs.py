"""A small real filesystem for disk-full tests: a tmpfs mounted for the test (root only).

CI runs as root; elsewhere the tests that need it are skipped with the reason.
"""

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def small_filesystem(path: str, size_kib: int) -> Iterator[str]:
    """Mounts a tmpfs of `size_kib` KiB at `path` (created), yields it, unmounts it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    os.makedirs(path, exist_ok=True)
    mounted = _mount("-t", "tmpfs", "-o", f"size={size_kib}k,mode=0755", "tmpfs", path)
    assert mounted.returncode == 0, f"cannot mount a tmpfs at {path}: {mounted.stderr}"
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def remount(path: str, options: str) -> None:
    """Remounts the tmpfs at `path` with `options` (e.g. "ro", "size=4096k")."""
    remounted = _mount("-o", f"remount,{options}", path)
    assert remounted.returncode == 0, remounted.stderr


def resize(path: str, size_kib: int) -> None:
    """Gives the mounted tmpfs at `path` a new size (the space a user frees)."""
    remount(path, f"size={size_kib}k")

"""Finds worker_binary processes that carry a test session's environment marker."""

import os
import signal

MARKER_ENV = "DP_FEDEMB_TEST_SESSION"


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:  # exited meanwhile, or not ours to read
        return {}
    return dict(item.split(b"=", 1) for item in items if b"=" in item)


def _is_worker_binary(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"worker_binary"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def worker_binaries_with_marker(marker: str) -> list[int]:
    """PIDs of live worker_binary processes whose environment has the marker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if _is_worker_binary(pid) and not _is_zombie(pid):
            if _environ(pid).get(MARKER_ENV.encode()) == marker.encode():
                found.append(pid)
    return sorted(found)


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass

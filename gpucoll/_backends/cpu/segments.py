"""The names of the CPU backend's shared-memory segments, and removing the ones left
behind.

A segment is ``/dev/shm/gpucoll-<pid namespace>-<creator pid>-<16 hex digits>``, a
regular file of this user. It is unlinked as soon as every rank has mapped it; a job
whose ranks are killed before that leaves it behind, and two parties remove it then:
the launcher, for the ranks it started, once they have exited
(:func:`remove_segments_of`); and the next group to create a segment on the host, for
any creator that is dead (:func:`sweep_orphans`). Only names of exactly this form, of
this user, whose creator is dead, are ever removed: never a file gpucoll did not make.

Plain ``os`` calls only: the launcher imports this module.
"""

from __future__ import annotations

import os
import platform
import re
import secrets
import stat
import sys
from typing import Callable

__all__ = ["PREFIX", "supported", "new_name", "sweep_orphans", "remove_segments_of", "unlink_ours"]

DIR = "/dev/shm"
PREFIX = DIR + "/gpucoll-"
_NAME = re.compile(r"gpucoll-(\d+)-(\d+)-[0-9a-f]{16}")


def supported() -> bool:
    """Whether this host can run the shared-memory transport at all."""
    # The shared-memory protocol relies on x86-64's total store order (flags are plain
    # stores after the data) and on Linux futexes for sleeping.
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def _pidns() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def new_name() -> str:
    """A fresh segment path for this process to create."""
    return f"{PREFIX}{_pidns()}-{os.getpid()}-{secrets.token_hex(8)}"


def _creator(name: str, ns: str) -> int | None:
    """The creator pid of a segment name of this pid namespace, else None."""
    m = _NAME.fullmatch(name)
    if m is None or m.group(1) != ns:
        return None
    return int(m.group(2))


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # another user's process: alive as far as we can tell
    return False


def unlink_ours(path: str) -> bool:
    """Remove ``path`` if it is a segment name and a regular file of this user."""
    if not path.startswith(PREFIX) or _NAME.fullmatch(path[len(DIR) + 1:]) is None:
        return False
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


def _remove(keep: Callable[[int], bool]) -> list[str]:
    ns = _pidns()
    removed: list[str] = []
    try:
        names = os.listdir(DIR)
    except OSError:
        return removed
    for name in names:
        pid = _creator(name, ns)
        if pid is not None and not keep(pid) and unlink_ours(f"{DIR}/{name}"):
            removed.append(f"{DIR}/{name}")
    return removed


def sweep_orphans() -> list[str]:
    """Unlink this user's segments (this pid namespace) whose creator is dead; return them."""
    return _remove(lambda pid: not _dead(pid))


def remove_segments_of(pids: list[int]) -> list[str]:
    """Unlink the segments created by ``pids`` (processes this caller started, all of
    which have exited); return them."""
    wanted = set(pids)
    return _remove(lambda pid: pid not in wanted or not _dead(pid))

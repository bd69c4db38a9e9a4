"""The processes behind a FileStore's log: who each is (machine, pid, start time), whether
it is certainly gone, and who holds the log's lock (Linux /proc; elsewhere, nothing is
proven and every process counts as alive)."""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

__all__ = ["User", "me", "machine", "proven_dead", "lock_holders", "procs"]


class User(NamedTuple):
    machine: str
    pid: int
    start: str
    host: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def machine() -> str:
    """This kernel boot and pid namespace: where a pid names the same process as here."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    if not boot:
        return ""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}"


def _start_time(pid: int) -> tuple[str, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``, None if it has none."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    parts = text.rsplit(")", 1)[-1].split()
    if len(parts) < 20:
        return None
    return parts[19], parts[0]


def me() -> User:
    pid = os.getpid()
    st = _start_time(pid)
    return User(machine(), pid, st[0] if st else "", socket.gethostname())


def proven_dead(user: User, machine: str) -> bool:
    """True only when ``user``'s process certainly no longer runs (same machine and pid
    namespace; its pid is gone, a zombie, or now another process)."""
    if not machine or user.machine != machine:
        return False  # another host (shared filesystem) or unknown: assume alive
    st = _start_time(user.pid)
    if st is None:
        try:
            os.kill(user.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    start, state = st
    return state in ("Z", "X") or (bool(user.start) and start != user.start)


def lock_holders(fd: int) -> str:
    """Who holds the flock on ``fd``'s file, from /proc/locks (Linux): "pid N (name,
    state S)"; "another process" when that cannot be told."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "another process"
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found = []
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK" or parts[5] != ident:
            continue  # "->" marks a waiter, not a holder
        pid = parts[4]
        name = _read_text(f"/proc/{pid}/comm") or "?"
        st2 = _start_time(int(pid)) if pid.isdigit() else None
        state = f", state {st2[1]}" if st2 else ""
        found.append(f"pid {pid} ({name}{state})")
    return " and ".join(found) if found else "another process"


def procs(users: list[User]) -> str:
    if not users:
        return "no live process"
    shown = ", ".join(u.describe() for u in users[:8])
    return f"{len(users)} process{'es' if len(users) > 1 else ''} ({shown})"

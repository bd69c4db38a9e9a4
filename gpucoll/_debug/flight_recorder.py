"""The flight recorder: the last N ops of one process group, dumped as JSON.

Every op a :class:`~gpucoll._group.group.ProcessGroup` issues gets an entry (sequence
number, op, backend, shape, dtype, bytes, peer, state, times). The ring keeps the
newest ``GPUCOLL_FLIGHT_RECORDER_SIZE`` entries (default 2000; 0 turns recording
off). The group's watchdog dumps it to a file when an op times out; the error
message names the file. ``group.dump_flight_recorder()`` returns the same JSON on
request. Comparing the dumps of all ranks shows which rank stopped at which op.

Files go to ``GPUCOLL_FLIGHT_RECORDER_DIR`` (default: ``<tempdir>/gpucoll-flight-recorder``)
as ``<group>-rank<global rank>-pid<pid>-<ms>.json``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time
from typing import Any

from .._buffer import Buffer
from . import package_dir, thread_stacks
from .._work import Work

__all__ = ["FlightRecorder", "recorder_capacity", "SIZE_ENV", "DIR_ENV", "DEFAULT_CAPACITY"]

from .._env import FLIGHT_RECORDER_DIR_ENV as DIR_ENV
from .._env import FLIGHT_RECORDER_SIZE_ENV as SIZE_ENV

DEFAULT_CAPACITY = 2000
FORMAT_VERSION = 1


def recorder_capacity() -> int:
    """The ring size from ``GPUCOLL_FLIGHT_RECORDER_SIZE`` (default 2000; 0 = off).

    Raises:
        ValueError: the variable is set but not a non-negative integer.
    """
    raw = os.environ.get(SIZE_ENV, "").strip()
    if not raw:
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{SIZE_ENV} must be a non-negative integer; got {raw!r}")
    return value


class _Entry:
    """One op; filled at issue, completed by :meth:`finish` from ``Work._finish``.

    Entries are reused round the ring rather than made per op: an object made per op
    and kept for ``capacity`` ops survives into the garbage collector's oldest
    generation, and enough of those make Python run full collections, which cost
    every op more than the entry itself.
    """

    __slots__ = ("seq", "op_type", "backend", "shape", "dtype", "nbytes", "peer",
                 "time_started", "state", "time_finished", "active_duration", "error", "where")
    seq: int
    op_type: str
    backend: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    peer: int
    time_started: float
    state: str
    time_finished: float | None
    active_duration: float | None
    error: str | None
    where: str  # the caller's file:line, at debug level INFO and above

    def finish(self, work: Work) -> None:
        if self.seq != work.seq:
            return  # reused for a newer op while this one was still running
        exc = work.exception()
        self.state = "completed" if exc is None else "failed"
        self.time_finished = work.time_finished
        self.active_duration = work.active_duration
        self.error = None if exc is None else f"{type(exc).__name__}: {exc}"

    def fail(self, error: str, active_duration: float) -> None:
        """Mark the op failed with ``error`` ``active_duration`` seconds after it started
        (an op with no Work: its backend's record of it failed)."""
        self.state = "failed"
        self.time_finished = self.time_started + active_duration
        self.active_duration = active_duration
        self.error = error

    def complete(self, active_duration: float) -> None:
        """Mark the op completed ``active_duration`` seconds after it started (an op that
        ran to its end on the issuing thread, with no Work)."""
        self.state = "completed"
        self.time_finished = self.time_started + active_duration
        self.active_duration = active_duration

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "op_type": self.op_type, "backend": self.backend,
            "shape": list(self.shape) if self.shape is not None else None,
            "dtype": self.dtype, "nbytes": self.nbytes,
            "peer": self.peer if self.peer >= 0 else None,
            "state": self.state, "time_started": self.time_started,
            "time_finished": self.time_finished, "active_duration": self.active_duration,
            "error": self.error, "where": self.where or None,
        }


class FlightRecorder:
    """A ring of the newest ``capacity`` ops of one group.

    Args:
        group_name: the group's name (in the dump and the file name).
        rank: this process's rank in the group.
        global_rank: its rank in the default group.
        size: the group's size.
        capacity: entries kept; must be > 0 (a group with capacity 0 keeps no recorder).
    """

    def __init__(self, group_name: str, rank: int, global_rank: int, size: int, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0; got {capacity}")
        self.group_name = group_name
        self.rank = rank
        self.global_rank = global_rank
        self.size = size
        self.capacity = capacity
        self._ring: list[_Entry | None] = [None] * capacity
        self._next = 0      # the slot the next op takes
        self._count = 0     # slots in use
        self.group_desc = ""  # set by the group

    def record(self, work: Work, backend: str, buf: Buffer | None, peer: int = -1) -> None:
        """Add ``work`` (already numbered) to the ring, in place of the oldest entry once
        full; its completion updates the entry."""
        self.attach(self.begin(work.seq, work.op_type, backend, buf, peer, work.time_started), work)

    def begin(self, seq: int, op_type: str, backend: str, buf: Buffer | None, peer: int = -1,
              time_started: float | None = None) -> _Entry:
        """Add an op about to start (state "scheduled"), before its Work exists: a backend
        that runs the op on the caller's thread returns the Work only when it is over,
        and a dump (or the control plane) taken meanwhile must show the op."""
        i = self._next
        entry = self._ring[i]
        if entry is None:
            entry = self._ring[i] = _Entry()
            self._count += 1
        # Every field, written here rather than in a method of the entry: this runs once
        # per op of every group.
        entry.seq = seq
        entry.op_type = op_type
        entry.backend = backend
        if buf is not None:
            entry.shape, entry.dtype, entry.nbytes = buf.shape, buf.dtype.name, buf.nbytes
        else:
            entry.shape = entry.dtype = None
            entry.nbytes = 0
        entry.peer = peer
        entry.time_started = time.time() if time_started is None else time_started
        entry.state = "scheduled"
        entry.time_finished = entry.active_duration = entry.error = None
        entry.where = ""
        self._next = i + 1 if i + 1 < self.capacity else 0
        return entry

    def attach(self, entry: _Entry, work: Work) -> None:
        """Tie ``entry`` (from :meth:`begin`) to the op's Work; its completion updates the entry."""
        entry.op_type = work.op_type
        work._fr_entry = entry
        if work._done.is_set():  # it may have finished before the entry was attached
            entry.finish(work)

    def snapshot(self, reason: str = "") -> dict[str, Any]:
        """The recorder's content as a JSON-ready dict (oldest entry first)."""
        return {
            "version": FORMAT_VERSION, "group": self.group_name, "group_desc": self.group_desc,
            "rank": self.rank,
            "global_rank": self.global_rank, "size": self.size, "capacity": self.capacity,
            "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "reason": reason, "entries": [e.as_dict() for e in self._in_order()],
        }

    def _in_order(self) -> list[_Entry]:
        """The entries, oldest first."""
        ring, i = list(self._ring), self._next
        return [e for e in (ring[i:] + ring[:i] if self._count == self.capacity else ring[:self._count])
                if e is not None]

    def to_json(self, reason: str = "") -> str:
        """:meth:`snapshot` as JSON text."""
        return json.dumps(self.snapshot(reason), indent=1)

    def dump(self, path: str | None = None, reason: str = "") -> str:
        """Write the JSON to ``path`` (default: a new file under ``GPUCOLL_FLIGHT_RECORDER_DIR``).

        Returns:
            The path written.

        Raises:
            OSError: the file could not be written.
        """
        if path is None:
            directory = os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                                "gpucoll-flight-recorder")
            os.makedirs(directory, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.group_name)
            path = os.path.join(directory, f"{safe}-rank{self.global_rank}-pid{os.getpid()}-"
                                           f"{int(time.time() * 1000)}.json")
        data = self.snapshot(reason)
        data["stacks"] = thread_stacks()  # what every thread of the process was doing at the dump
        data["package_dir"] = package_dir()  # tells the reader which frames are gpucoll's own
        text = json.dumps(data, indent=1)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

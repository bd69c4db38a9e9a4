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

import itertools
import json
import operator
import os
import re
import socket
import tempfile
import time
from typing import Any, Callable

from .._buffer import Buffer
from . import package_dir, thread_stacks
from .._work import Work

__all__ = ["FlightRecorder", "Kind", "recorder_capacity", "SIZE_ENV", "DIR_ENV", "DEFAULT_CAPACITY"]

from .._env import FLIGHT_RECORDER_DIR_ENV as DIR_ENV
from .._env import FLIGHT_RECORDER_SIZE_ENV as SIZE_ENV

DEFAULT_CAPACITY = 2000
_SEQ = operator.attrgetter("seq")
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


class Kind:
    """What an entry shows of its op's arrays and peer, shared by every op of one kind
    (a group's planned run of one array kind makes it once; other ops make one per op)."""

    __slots__ = ("backend", "shape", "dtype", "nbytes", "peer")

    def __init__(self, backend: str, buf: Buffer | None, peer: int = -1) -> None:
        self.backend = backend
        if buf is not None:
            self.shape: tuple[int, ...] | None = buf.shape
            self.dtype: str | None = buf.dtype.name
            self.nbytes = buf.nbytes
        else:
            self.shape = self.dtype = None
            self.nbytes = 0
        self.peer = peer


def clock_offset() -> float:
    """Wall-clock time (``time.time()``) less the performance counter's reading, now: what
    turns a start read from ``time.perf_counter()`` into wall-clock seconds."""
    return time.time() - time.perf_counter()


class _Entry:
    """One op; filled at issue, completed by :meth:`finish` from ``Work._finish`` (or by
    :meth:`complete`/:meth:`fail` for an op with no Work).

    Entries are made with the ring and reused round it rather than made per op: an
    object made per op and kept for ``capacity`` ops survives into the garbage
    collector's oldest generation, and enough of those make Python run full
    collections, which cost every op more than the entry itself; making them with the
    ring also spares the first ``capacity`` ops of a group the making. An op writes
    five fields (sequence number, op, :class:`Kind`, start time, ``done``); its state,
    end time, duration and error are derived from ``done`` when the ring is read
    (:meth:`as_dict`): None while it is scheduled, its duration (a float) once
    completed with no Work, else the tuple (state, time finished, duration, error).

    The start time is the wall clock's (``time.time()``) in ``time_started``, or, for an
    op of a group's planned NumPy run (which reads the performance counter for its
    duration anyway), 0.0 there and the performance counter's reading in ``t0``: the
    ring's reader turns it into wall-clock time with the offset between the two clocks
    read at that moment (:func:`clock_offset`). Such a start is then off by however much
    the wall clock was adjusted (slewed or stepped) between the op and the reading:
    none when it was not, a few milliseconds per hour of NTP slewing at most.
    """

    __slots__ = ("seq", "op_type", "kind", "time_started", "t0", "done", "where")
    seq: int  # -1 until the entry's first op
    op_type: str
    kind: Kind
    time_started: float  # 0.0: the start is ``t0``, read from time.perf_counter()
    t0: float
    done: float | tuple[str, float | None, float | None, str | None] | None
    where: str  # the caller's file:line, at debug level INFO and above (unset below)

    def __init__(self) -> None:
        self.seq = -1
        self.time_started = 0.0
        self.t0 = 0.0
        self.done = None

    def started(self, offset: float) -> float:
        """The op's start, wall-clock seconds (``offset``: :func:`clock_offset`'s, for a
        start read from the performance counter)."""
        ts = self.time_started
        return ts if ts else self.t0 + offset

    def finish(self, work: Work) -> None:
        if self.seq != work.seq:
            return  # reused for a newer op while this one was still running
        exc = work.exception()
        self.done = ("completed", work.time_finished, work.active_duration, None) if exc is None else \
            ("failed", work.time_finished, work.active_duration, f"{type(exc).__name__}: {exc}")

    def fail(self, error: str, active_duration: float) -> None:
        """Mark the op failed with ``error`` ``active_duration`` seconds after it started
        (an op with no Work: its backend's record of it failed)."""
        self.done = ("failed", self.started(clock_offset()) + active_duration, active_duration, error)

    def complete(self, active_duration: float) -> None:
        """Mark the op completed ``active_duration`` seconds after it started (an op that
        ran to its end on the issuing thread, with no Work)."""
        self.done = active_duration

    @property
    def state(self) -> str:
        """"scheduled", "completed" or "failed"."""
        done = self.done
        return "scheduled" if done is None else "completed" if isinstance(done, float) else done[0]

    def as_dict(self, offset: float | None = None) -> dict[str, Any]:
        """The entry as the dump shows it (``offset``: :func:`clock_offset`'s, read once
        per dump; read here when not given)."""
        done, kind = self.done, self.kind
        started = self.started(clock_offset() if offset is None else offset)
        state: str
        finished: float | None
        active: float | None
        error: str | None
        if done is None:
            state, finished, active, error = "scheduled", None, None, None
        elif isinstance(done, float):
            state, finished, active, error = "completed", started + done, done, None
        else:
            state, finished, active, error = done
        return {
            "seq": self.seq, "op_type": self.op_type, "backend": kind.backend,
            "shape": list(kind.shape) if kind.shape is not None else None,
            "dtype": kind.dtype, "nbytes": kind.nbytes,
            "peer": kind.peer if kind.peer >= 0 else None,
            "state": state, "time_started": started,
            "time_finished": finished, "active_duration": active,
            "error": error, "where": getattr(self, "where", "") or None,
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
        # Every entry made now (see _Entry); one not used yet has seq -1.
        self._ring: list[_Entry] = [_Entry() for _ in range(capacity)]
        # The entry the next op fills, round the ring: one call in C per op (the hot paths
        # call it without a frame of their own). The ring's order is its entries' seqs.
        self.take: Callable[[], _Entry] = itertools.cycle(self._ring).__next__
        self.group_desc = ""  # set by the group
        self._last_kind: Kind | None = None  # begin()'s last Kind

    def record(self, work: Work, backend: str, buf: Buffer | None, peer: int = -1) -> None:
        """Add ``work`` (already numbered) to the ring, in place of the oldest entry once
        full; its completion updates the entry."""
        self.attach(self.begin(work.seq, work.op_type, backend, buf, peer, work.time_started), work)

    def begin(self, seq: int, op_type: str, backend: str, buf: Buffer | None, peer: int = -1,
              time_started: float | None = None) -> _Entry:
        """Add an op about to start (state "scheduled"), before its Work exists: a backend
        that runs the op on the caller's thread returns the Work only when it is over,
        and a dump (or the control plane) taken meanwhile must show the op."""
        kind = self._last_kind
        # An op of the last op's kind (ops of the general path make a Buffer per op)
        # shares its Kind: nothing is allocated and kept per op.
        if kind is None or kind.backend != backend or kind.peer != peer or (
                kind.shape is not None if buf is None else
                kind.nbytes != buf.nbytes or kind.shape != buf.shape or kind.dtype != buf.dtype.name):
            kind = self._last_kind = Kind(backend, buf, peer)
        entry = self.begin_kind(seq, op_type, kind)
        if time_started is not None:
            entry.time_started = time_started
        return entry

    def begin_kind(self, seq: int, op_type: str, kind: Kind) -> _Entry:
        """:meth:`begin` for an op of a :class:`Kind` made once (a planned run's): five
        stores and a clock read."""
        entry = self.take()
        entry.seq = seq
        entry.op_type = op_type
        entry.kind = kind
        entry.time_started = time.time()
        entry.done = None
        return entry

    def attach(self, entry: _Entry, work: Work) -> None:
        """Tie ``entry`` (from :meth:`begin`) to the op's Work; its completion updates the entry."""
        entry.op_type = work.op_type
        work._fr_entry = entry
        if work._done.is_set():  # it may have finished before the entry was attached
            entry.finish(work)

    def snapshot(self, reason: str = "") -> dict[str, Any]:
        """The recorder's content as a JSON-ready dict (oldest entry first)."""
        offset = clock_offset()
        return {
            "version": FORMAT_VERSION, "group": self.group_name, "group_desc": self.group_desc,
            "rank": self.rank,
            "global_rank": self.global_rank, "size": self.size, "capacity": self.capacity,
            "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "reason": reason, "entries": [e.as_dict(offset) for e in self._in_order()],
        }

    def _in_order(self) -> list[_Entry]:
        """The entries that hold an op, oldest first (by seq: the group numbers its ops
        in the order they take their entries)."""
        return sorted([e for e in self._ring if e.seq != -1], key=_SEQ)

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

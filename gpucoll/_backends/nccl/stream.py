"""A backend's communication stream and the events its ops record.

The stream (non-blocking: it never serialises with the legacy default stream) runs
the ops that do not run on the caller's stream: async ops, ops under a completion
hook, ops with local steps, captured ops. Alongside it: the pool of raw events the
Work-less synchronous ops record (events.py), whether ops record timed events (a
completion hook asked), the last timed op's end (the other start of an op's
``active_duration``), and the end of the last op issued on this stream until an op on
the caller's stream has waited for it (every op of a group runs in issue order).
And what must live as long as the backend: allocations the stream's ops use (the
barrier's scratch word), the arrays and temporaries of an op that failed part-way
through being queued, and those of ops captured into a CUDA graph (a replay uses
them), with whether any op was captured (shutdown then does not wait for
``ncclCommDestroy``).
"""

from __future__ import annotations

from typing import Any, Iterable

from .events import EventPool
from .protocols import Event, Runtime

__all__ = ["CommStream"]


class CommStream:
    """The communication stream (None until the communicator exists) and its events.

    ``timing``, ``last_end`` and ``tail`` are the issue path's (hot.py, ``NCCLBackend._launch``),
    which reads and writes them directly under the backend's issue lock: a method call
    per op would cost the synchronous op more than the rest of its Python. The rest is
    read-only outside this class."""

    __slots__ = ("stream", "ptr", "events", "timing", "last_end", "tail", "kept", "captured", "caller_max", "ready",
                 "work_classes")

    def __init__(self, caller_max: int = 0) -> None:
        self.stream: Any = None
        self.ptr = 0
        self.events: EventPool | None = None
        self.timing = False             # record timed events (a completion hook asked: time_ops)
        self.last_end: Event | None = None
        self.tail: Event | None = None
        self.kept: list[Any] = []       # held for the backend's life (read-only outside)
        self.captured = False           # an op was captured into a CUDA graph (read-only outside)
        # Async hot ops up to this many bytes, untimed, run on the caller's stream instead
        # (hot._issue_on_caller; GPUCOLL_NCCL_CALLER_STREAM_MAX). Read-only outside.
        self.caller_max = caller_max
        # The raw event an untimed op on this stream records on the caller's stream and
        # makes this stream wait on (0 until the first): cudaStreamWaitEvent takes the
        # event's state when it is called, so each op records the same event again, and
        # no event is taken and given back per op. Read-only outside.
        self.ready = 0
        # The Work classes of the async ops a group's DeviceRun issues on this stream
        # (work.device_run_work_class), by op name, device and timeout: made once.
        self.work_classes: dict[tuple[str, int, float], Any] = {}

    def time_ops(self) -> None:
        """Record later ops' events with timing (for active_duration)."""
        self.timing = True

    def keep(self, objs: Iterable[Any]) -> None:
        """Hold ``objs`` as long as the backend lives."""
        self.kept.extend(objs)

    def keep_for_graphs(self, objs: Iterable[Any]) -> None:
        """An op was captured: hold its temporaries ``objs`` for the backend's life."""
        self.kept.extend(objs)
        self.captured = True

    def open(self, stream: Any, rt: Runtime, device: int) -> None:
        """Take ``stream`` (the runtime's, on ``device``) and an event pool of ``device``."""
        self.stream = stream
        self.ptr = int(stream.ptr)
        self.events = EventPool(rt, device)

    def ready_event(self, rt: Runtime, device: int) -> int:
        """:attr:`ready`, taken from the pool on first use (kept for the stream's life)."""
        if not self.ready:
            self.ready = self.pool(rt, device).take()
        return self.ready

    def pool(self, rt: Runtime, device: int) -> EventPool:
        """The event pool (made on first use where :meth:`open` was not called)."""
        pool = self.events
        if pool is None:
            pool = self.events = EventPool(rt, device)
        return pool

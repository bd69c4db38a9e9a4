"""NCCLWork: the Work of an op on the GPU, completed by CUDA events.

Two events bound each op: ``ready``, recorded on the caller's stream(s) and waited
on by the communication stream before the op, and ``end``, recorded on the
communication stream after it. The op is complete when ``end`` has fired.

* :meth:`NCCLWork.wait` makes the current stream, and the producer streams the Work
  holds alive (CuPy's), wait for ``end`` and returns at once (torch's semantics: the
  host is not blocked); with an explicit ``timeout`` it also blocks the host until
  completion, as torch does, and so it does for memory whose producer works on a
  stream gpucoll can neither name nor hold (``Buffer.foreign_stream``).
* :meth:`NCCLWork.synchronize` blocks the host until ``end`` fires.
* :meth:`NCCLWork.is_completed` and :meth:`NCCLWork._poll` (the group's watchdog)
  query ``end`` without blocking; the first to see it fire completes the Work, which
  releases the arrays it kept alive and fires completion hooks.

``active_duration`` is the time from the op's start on the communication stream to
``end``: the op starts once both its ``ready`` event and the previous op's ``end``
have fired, so the duration is the smaller of the two elapsed times.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Protocol, Sequence

from ..._timeouts import Backoff, to_seconds
from ...errors import DistBackendError, DistError
from ..._work import _PENDING, Work
from .ending import Ending
from .events import EventPool, Handle
from .runtime import CAPTURE_THREAD_LOCAL, Event, Runtime, enter_device, leave_device

__all__ = ["NCCLWork", "HotWork", "WorkOwner", "query_outside_capture", "DeviceRunWork", "device_run_work_class"]

# The hot path's Works share one lock (held for a few field writes, never while another
# Work's lock is taken or user code runs): one fewer object made and freed per op.
_HOT_LOCK = threading.Lock()


def query_outside_capture(rt: Runtime, event: int) -> bool:
    """``cudaEventQuery`` in thread-local capture mode: from a thread of ours (the
    watchdog), while another thread captures a CUDA graph in global mode (torch's
    default), a query in global mode fails with error 900 and invalidates that capture.
    torch's watchdog sets the same mode (CUDAStreamCaptureModeGuard)."""
    prev = rt.exchange_capture_mode(CAPTURE_THREAD_LOCAL)
    try:
        return rt.query(event)
    finally:
        rt.exchange_capture_mode(prev)


class WorkOwner(Protocol):
    """What an NCCLWork needs from its backend (read-only)."""

    runtime: Runtime
    ending: Ending

    def failure(self) -> str | None:
        """Why every pending op fails (abort, asynchronous NCCL error), or None."""
        ...

    def abort(self, reason: str) -> None: ...

    def complete_earlier(self, work: NCCLWork) -> None:
        """Complete, in issue order, the works issued before ``work`` (its stream ran
        them first), so that completions and hooks follow issue order."""
        ...


class NCCLWork(Work):
    """Work of one NCCL op (or one coalesced batch of ops); see the module docstring.

    Args:
        op_type: the op's name.
        owner: the backend that issued it.
        keepalive: arrays, Buffers and temporaries to hold until the op completes.
        result: what :meth:`result` returns.
        default_timeout: seconds :meth:`synchronize` waits when given no timeout.
    """

    # Set by _issued/_doom; class-level defaults keep the per-op constructor short.
    _device: int = 0
    _ready: Event | None = None
    _end: Event | None = None
    _prev: Event | None = None
    _streams: tuple[int, ...] = ()
    # The caller's stream the op itself ran on (hot.py's small async ops), else -1:
    # wait() on that stream has nothing to add.
    _on_stream: int = -1
    _doomed: str | None = None
    # Producer streams' objects (CuPy's Streams), held for the Work's life: wait() may
    # run after completion released the arrays, and must find them alive.
    _stream_owners: tuple[Any, ...] = ()
    # A barrier is a host-side promise: its wait() blocks the host.
    host_wait: bool = False
    # A posted send or receive not issued yet: what issues it (NCCLBackend.flush_p2p).
    _flush: Callable[[], None] | None = None

    def __init__(self, op_type: str, owner: WorkOwner, *, keepalive: Sequence[Any] = (),
                 result: list[Any] | None = None, default_timeout: float | None = None) -> None:
        super().__init__(op_type, keepalive=keepalive, result=result, default_timeout=default_timeout)
        self._owner = owner

    # ----- set by the backend -----

    def hold_stream(self, owner: Any) -> None:
        """Hold ``owner``, a producer stream's object, for the Work's life; :meth:`wait`
        makes that stream wait too."""
        self._stream_owners = (*self._stream_owners, owner)

    def issued(self, device: int, ready: Event | None, end: Event, prev: Event | None, captured: bool) -> None:
        """The op was queued on ``device``: ``end`` fires once it finished; ``ready`` and
        ``prev`` (timed ops) start its active duration; ``captured``: into a CUDA graph."""
        self._device = device
        owners = self._stream_owners
        # wait() makes the producer streams held wait; never a bare handle its owner
        # may have destroyed since.
        self._streams = tuple(int(o.ptr) for o in owners) if owners else ()
        if captured:
            # Inside CUDA graph capture nothing runs until the graph is launched, and
            # captured events cannot be queried: the op is complete as far as the
            # host can ever tell. The caller's streams already wait for it.
            self._set_result(active_duration=0.0)
            return
        self._ready, self._prev = ready, prev
        self._end = end

    def post(self, flush: Callable[[], None] | None) -> None:
        """The op is posted, not issued: ``flush()`` issues it (and the ops posted with
        it); every look at the Work calls it first. None: issued (or failed) since."""
        self._flush = flush

    def doom(self, reason: str) -> None:
        """Fail this Work the first time anyone looks at it (the ProcessGroup assigns
        its sequence number after the backend returns it, and the error names it)."""
        self._doomed = reason

    def keep_also(self, objs: Sequence[Any]) -> None:
        """Also hold ``objs`` (the op's temporaries) until the op completes."""
        if objs:
            self._keepalive = [*(self._keepalive or ()), *objs]

    def fail(self, reason: str) -> None:
        """Fail the Work for ``reason`` (nothing once complete)."""
        self._set_exception(DistBackendError(f"{self._name()} failed: {reason}"))

    def name(self) -> str:
        """The op, its sequence number and group, for errors."""
        return self._name()

    def poll(self) -> bool:
        """Complete or fail the Work if its op finished or its backend failed; True once it has."""
        return self._poll()

    def swept(self, rt: Runtime, now: float, pool: EventPool | None, unheld: bool) -> None:
        """The backend's sweep saw the op's end fire (or a later one on its stream), as of
        ``now`` (``time.perf_counter()``): give a pooled end (a :class:`~.events.Handle`)
        back to ``pool``, then complete the Work. When ``unheld`` (nobody holds it: the
        sweep drops it, its arrays with it), the Work itself is not completed where
        nothing could tell: with nothing looking at its completion (no flight-recorder
        entry, callback or future), nothing is done; with only its flight-recorder entry
        looking (no finaliser, untimed), the entry is marked completed as of ``now``, as a
        Work-less op's is (``hot.Quiet``; the dump reads the same).

        Once complete, every look at the Work stops at its flag, so its end is not used
        again; a ``wait()`` racing with this completion may make its stream wait on the
        event's next use, later on a stream: more order, never less."""
        end = self._end
        if type(end) is Handle and pool is not None:
            pool.give_handle(end)
        if unheld and self._callbacks is None and self._future is None:
            entry = self._fr_entry
            if entry is None:
                return
            if self._finalize is None and self._ready is None and self._prev is None:
                if entry.seq == self.seq:  # (the ring may have reused the entry)
                    entry.done = now - self._t0
                return
        self.fired(rt, now)

    def number(self, seq: int, group_name: str, result: Any, entry: Any) -> None:
        """Number the Work of an op a group issued through a DeviceRun: op ``seq`` of group
        ``group_name``, whose ``result()`` is ``[result]``, tied to flight-recorder
        ``entry`` (``FlightRecorder.attach`` without its frame; None: no recorder)."""
        self.seq = seq
        self.group_name = group_name
        self._result.append(result)
        if entry is not None:
            self._fr_entry = entry
            if self._done.is_set():  # the watchdog's sweep completed it meanwhile
                entry.finish(self)

    def has_fired(self, rt: Runtime) -> bool:
        """Whether the op is complete or its end event has fired (one query; raises
        what the query raises)."""
        end = self._end
        return self._done.is_set() or (end is not None and rt.query(end.ptr))

    def stand_for(self, t0: float, time_started: float, seq: int, group_name: str, entry: Any) -> None:
        """Stand for an op issued without a Work (hot.Quiet.as_work): its start times,
        sequence number, group and flight-recorder entry; it keeps nothing alive."""
        self._keepalive = None
        self._t0, self.time_started = t0, time_started
        self.seq, self.group_name, self._fr_entry = seq, group_name, entry

    # ----- completion -----

    def _poll(self) -> bool:
        if self._done.is_set():
            return True
        if self._flush is not None:
            self._flush()
        if self._doomed is not None:
            self.fail(self._doomed)
            return True
        reason = self._owner.failure()
        if reason is not None:
            self.fail(reason)
            return True
        return self._check_event()

    def _check_event(self, mode_set: bool = False) -> bool:
        """Complete the Work if its end event has fired; True once complete.
        ``mode_set``: the caller (the backend's completion sweep, which pops this Work
        and every earlier one itself) set thread-local capture mode for the query already."""
        if self._done.is_set():
            return True
        end = self._end
        if end is None:
            return False  # a member of a coalescing batch that has not been issued yet
        rt = self._owner.runtime
        try:
            prev_device = -1 if rt.get_device() == self._device else enter_device(rt, self._device)
            try:
                if not (rt.query(end.ptr) if mode_set else query_outside_capture(rt, end.ptr)):
                    # The sweep may have completed it meanwhile, its pooled end given back
                    # and recording a later op since: the flag says so.
                    return self._done.is_set()
                duration = self._active_ms(rt, end)
            finally:
                leave_device(rt, prev_device)
        except Exception as exc:
            # A failed query means a sticky CUDA error (a kernel faulted): the
            # communicator cannot be trusted after it.
            why = f"CUDA reported {type(exc).__name__}: {exc} while checking {self._name()}"
            self._owner.abort(why)
            self.fail(why)
            return True
        self._ready = self._prev = None
        if not mode_set:  # the sweep completes earlier works itself, in order
            self._owner.complete_earlier(self)
        self._set_result(active_duration=None if duration is None else duration / 1000.0)
        return True

    def fired(self, rt: Runtime, now: float) -> None:
        """Complete the Work, whose end event has fired (the backend's sweep saw it or a
        later one fire), as of ``now`` (``time.perf_counter()``)."""
        if self._ready is not None or self._prev is not None:  # timed: the events say how long
            end = self._end
            assert end is not None
            duration = self._active_ms(rt, end)
            self._ready = self._prev = None
            self._finish(None, None if duration is None else duration / 1000.0, None, now)
            return
        self._finish(None, None, None, now)

    def _active_ms(self, rt: Runtime, end: Event) -> float | None:
        try:
            ms = float("inf")
            for start in (self._ready, self._prev):
                if start is not None:
                    ms = min(ms, rt.elapsed_ms(start.ptr, end.ptr))
            return None if ms == float("inf") else max(ms, 0.0)
        except Exception:
            return None  # no timing (e.g. an event recorded on another device): host clock

    def _raise_if_failed(self) -> None:
        exc = self._exc
        if exc is None:
            return
        if isinstance(exc, DistError):
            raise exc
        raise DistBackendError(f"{self._name()} failed: {exc}") from exc

    # ----- the public surface -----

    def is_completed(self) -> bool:
        """True once the op finished on the GPU (or failed); never blocks."""
        return self._poll()

    def wait(self, timeout: float | timedelta | None = None) -> Any:
        """Make the current stream (and the producer streams this Work holds alive)
        wait for the op; the host is not blocked, except for memory of a producer whose
        stream gpucoll cannot make wait (``Buffer.foreign_stream``): then it blocks until
        the op completed.

        Args:
            timeout: when given, additionally block the host until the op completes,
                at most this many seconds (torch's behaviour for an explicit timeout).

        Returns:
            True.

        Raises:
            DistBackendError: the op failed or was aborted (or, with ``timeout``, did
                not complete in time).
        """
        if self._flush is not None:
            self._flush()
        if timeout is not None or self.host_wait:
            self.synchronize(timeout)
            return self._waited()
        # Only flags here: the hot path of every synchronous op queries no event and
        # no NCCL state (the watchdog does that).
        if self._done.is_set() or self._doomed is not None or self._owner.ending.aborted is not None:
            self._poll()
            self._raise_if_failed()
            return self._waited()
        end = self._end
        if end is None:
            return self._waited()  # not issued yet: the batch's own Work carries the wait
        rt = self._owner.runtime
        try:
            # The caller's current stream of the op's device (no cudaGetDevice, no
            # device switch: a stream waits on an event of any device).
            current = rt.current_stream_of(self._device)
            streams = self._streams
            if streams:
                for stream in streams:
                    rt.wait_event(stream, end.ptr)
            if current not in streams and current != self._on_stream:
                rt.wait_event(current, end.ptr)
        except Exception as exc:
            raise DistBackendError(f"{self._name()}: making the caller's stream wait failed: {exc}") from exc
        return self._result if self._wait_gives_result else True

    def synchronize(self, timeout: float | timedelta | None = None) -> None:
        """Block the host until the op completed on the GPU.

        Args:
            timeout: seconds (or timedelta); None uses the group's timeout.

        Raises:
            DistBackendError: the op failed, was aborted, or did not complete in time.
        """
        limit = (to_seconds(timeout, default=self._default_timeout)
                 if timeout is not None or self._default_timeout is not None else None)
        # Short sleeps for short ops, then backing off so that a long op costs no CPU.
        wait = Backoff(limit, first=2e-5, cap=1e-3)
        while not self._poll():
            if self._end is None:
                raise DistBackendError(f"{self._name()} was never issued: it is inside a coalescing "
                                       "block that has not ended")
            if not wait.sleep():
                raise DistBackendError(f"{self._name()} did not complete within {limit:.3g} s "
                                       "(Work.synchronize)")
        self._raise_if_failed()


class HotWork(NCCLWork):
    """The Work of an op issued by the hot path (hot.py), made and marked issued in one
    step: it keeps ``buf`` alive (nothing when None), holds no producer stream, was not
    captured, is never posted or doomed, and shares one lock with the other hot Works
    (held for a few field writes, never while another Work's lock is taken or user code
    runs: one fewer object made and freed per op)."""

    _lock = _HOT_LOCK

    def __init__(self, op_type: str, owner: WorkOwner, buf: Any, default_timeout: float, device: int,
                 end: Event, ready: Event | None, prev: Event | None, on_stream: int = -1) -> None:
        # Work.__init__'s fields, without its lock and list. ``on_stream``: the caller's
        # stream the op ran on itself (hot._issue_on_caller), -1 for the communication stream.
        self.op_type = op_type
        self._t0 = time.perf_counter()
        self.time_started = time.time()
        self._default_timeout = default_timeout
        self._keepalive = (buf,) if buf is not None else None
        self._result = []
        self._done = _PENDING  # (never blocked on: _work._Pending)
        self._owner = owner
        self._device = device
        self._end = end
        if on_stream != -1:
            self._on_stream = on_stream
        if ready is not None:
            self._ready, self._prev = ready, prev

    def wait(self, timeout: float | timedelta | None = None) -> Any:
        """:meth:`NCCLWork.wait`; see there. The common case first: no timeout, not
        complete, the backend not aborted (a hot Work is never posted, doomed, a
        barrier, or holding producer streams): the caller's current stream of the op's
        device waits for ``end``, unless the op ran on that stream itself."""
        if timeout is None and self._done is _PENDING:  # (not complete: the shared pending state)
            owner = self._owner
            if owner.ending.aborted is None:
                rt = owner.runtime
                end = self._end
                try:
                    current = rt.current_stream_of(self._device)
                    if current != self._on_stream:
                        rt.wait_event(current, end.ptr)  # type: ignore[union-attr]  # (a hot Work's end is set)
                except Exception as exc:
                    raise DistBackendError(f"{self._name()}: making the caller's stream wait failed: {exc}") from exc
                return self._result if self._wait_gives_result else True
        return NCCLWork.wait(self, timeout)


class DeviceRunWork(HotWork):
    """The :class:`HotWork` of an async op a group issued through a DeviceRun on the
    communication stream (hot.start_async), made numbered: op ``seq`` of group
    ``group_name``, ``result()`` ``[keep]`` (``keep``, the array, held for the Work's
    life: no separate keepalive), ``end`` a pooled :class:`~.events.Handle`, tied
    to flight-recorder ``entry`` (None: no recorder), whose start time it takes (the
    entry read the wall clock a moment ago). Made before the op is queued as
    outstanding, so no sweep can complete it meanwhile. It is never posted, doomed,
    timed, captured or a barrier, holds no producer stream, and never ran on the
    caller's stream (``_on_stream`` is -1).

    Its per-backend class (:func:`device_run_work_class`) holds as class attributes
    what every op of that backend shares: the op's name, the backend (``_owner``), its
    device and timeout, and the shared pending completion state (``_done``, set on the
    instance once the op completes): five attribute writes fewer per op."""

    _keepalive = None  # (the result holds the array)
    _done = _PENDING   # (the class's until the op completes: Work._finish sets the instance's)

    def __init__(self, keep: Any, end: Event, seq: int, group_name: str, entry: Any) -> None:
        self._t0 = _perf_counter()
        self.time_started = _time() if entry is None else entry.time_started
        self._keep = keep
        self._end = end
        self.seq = seq
        self.group_name = group_name
        self._fr_entry = entry  # (set even when None: every such Work's fields in one order)

    @property  # (read-only here: nothing writes a DeviceRunWork's results)
    def _result(self) -> list[Any]:  # type: ignore[override]
        """What :meth:`result` returns, ``[keep]``, made when asked: no list per op."""
        return [self._keep]

    def swept(self, rt: Runtime, now: float, pool: EventPool | None, unheld: bool) -> None:
        """:meth:`NCCLWork.swept` for such a Work: its end is always a pooled
        :class:`~.events.Handle` (hot.start_async takes one) and it is untimed (no
        ``ready`` or ``prev`` event: nothing sets them on it), so neither is checked."""
        if pool is not None:
            pool.handles.append(self._end)  # type: ignore[arg-type]  # (pool.give_handle, without its frame)
        if unheld and self._callbacks is None and self._future is None:
            entry = self._fr_entry
            if entry is None:
                return
            if self._finalize is None:
                if entry.seq == self.seq:  # (the ring may have reused the entry)
                    entry.done = now - self._t0
                return
        self.fired(rt, now)


def device_run_work_class(owner: WorkOwner, op_type: str, device: int, default_timeout: float) -> type[DeviceRunWork]:
    """The :class:`DeviceRunWork` class of ``owner``'s ``op_type`` ops on ``device``
    (hot.start_async's, one per backend and op name), whose ``wait()`` reads the backend's
    runtime and ending from its closure.

    ``wait()`` without a timeout on a pending Work of a backend not aborted makes the
    caller's *current* stream of the op's device (looked up per call: the caller may
    have switched streams since the op) wait for ``end``; the op ran on the
    communication stream, never the caller's, so there is nothing to compare. Anything
    else (a timeout, a completed or failed Work, an aborted backend) is
    :meth:`NCCLWork.wait`'s. ``rt.wait_event`` and ``rt.current_stream_of`` are looked up
    per call (never bound once: whoever holds the runtime may replace them)."""
    rt = owner.runtime
    ending = owner.ending

    class _DeviceRunWork(DeviceRunWork):
        def wait(self, timeout: float | timedelta | None = None) -> Any:
            """:meth:`NCCLWork.wait`; see :func:`device_run_work_class` for its common case."""
            if timeout is None and self._done is _PENDING and ending.aborted is None:
                try:
                    rt.wait_event(rt.current_stream_of(device), self._end.ptr)  # type: ignore[union-attr]
                except Exception as exc:
                    raise DistBackendError(f"{self._name()}: making the caller's stream wait failed: {exc}") from exc
                return True  # (never a coalesced op's Work: _wait_gives_result is False)
            return NCCLWork.wait(self, timeout)

    cls = _DeviceRunWork
    cls.__name__ = cls.__qualname__ = "DeviceRunWork"
    cls.op_type = op_type
    cls._owner = owner
    cls._device = device
    cls._default_timeout = default_timeout
    return cls


_perf_counter = time.perf_counter
_time = time.time

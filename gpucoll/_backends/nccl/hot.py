"""The NCCL backend's hot path: a repeated op issued with only the calls it needs, and
completion of finished ops in bulk. Functions over an :class:`NCCLBackend`'s state
(declared in its ``__init__``), as lifecycle.py's are.

**Issuing.** An op whose plan is one NCCL call and nothing else (no copy, kernel,
temporary or PreMul operator) gets a :class:`Hot` the first time it is issued through
the general path (``NCCLBackend._issue``), under the same key as its cached plan: the
bound NCCL call and its arguments. A later call with that key goes through
:func:`issue`, which makes only the runtime calls the op needs (the communication stream's one
``ready`` event recorded on the caller's stream and waited on, the NCCL call, the end
event's record) and one Work. It gives up,
before it has done anything, whenever the general path has more to do: the producer's
stream is held or foreign, the array is not on the communicator's device, that device
is not current, the caller's stream is being captured, or the backend is aborted or
closed. The general path then issues the op, with every check it makes.

**Synchronous ops without a Work.** A group's synchronous op with no completion hook
needs no Work: the caller gets nothing back, and its stream is made to wait for the op
as ``NCCLWork.wait`` would. :func:`issue` given the op's sequence number makes a
:class:`Quiet` instead, the backend's record of the op (its end event, the array it
keeps alive, its flight-recorder entry) until it completes; the watchdog's timeout
gets a Work made from it (:meth:`Quiet.as_work`) only when it asks.

**Completing.** The communication stream runs its ops in issue order, so their end
events fire in that order: when one has fired, every earlier one has too.
:func:`complete_until` finds the newest finished op among the pending ones with a
binary search (a few event queries, not one per op) and completes everything before
it in order, each with a few field writes (:meth:`NCCLWork.fired`).
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from ..._buffer import Buffer
from ...errors import BackendUnavailableError, DistBackendError
from .plan import Plan
from .outstanding import PRUNE_AT, PRUNE_WORKS_AT
from .runtime import CAPTURE_THREAD_LOCAL
from .phases import on_comm
from .lifecycle import abort_comm as _abort_comm
from .posting import Posted
from .work import DeviceRunWork, HotWork, NCCLWork, device_run_work_class

if TYPE_CHECKING:
    from ..._debug.flight_recorder import _Entry
    from .state import BackendState

__all__ = ["Hot", "Quiet", "Pending", "PRUNE_AT", "PRUNE_WORKS_AT", "make", "issue", "issue_quiet", "start_async",
           "run_work_class",
           "issue_failed", "complete_until", "poll"]

# A finished Work that only the sweep holds (its list of works, the pending queue, its loop
# variable, and getrefcount's own argument) is not completed, only dropped: nothing can
# see the difference, and its arrays go with it. Anyone holding it still sees it complete
# when they look (its end event has fired), so a count that is off only costs time.
_refs = sys.getrefcount
_UNHELD = 4


class Hot:
    """A cached op's one NCCL call, bound to its arguments: ``call(stream)``."""

    __slots__ = ("op_type", "call")

    def __init__(self, op_type: str, call: Callable[[int], Any]) -> None:
        self.op_type = op_type
        self.call = call


class Quiet:
    """The backend's record of a synchronous op issued with no Work (see the module
    docstring): what completing it, failing it and timing it out need. ``stream`` is
    the caller's stream the op ran on, ``end`` the raw event recorded after it there
    (the backend's :class:`~.events.EventPool`'s, given back once the op completed).
    Its fields are read-only outside this class."""

    __slots__ = ("op_type", "seq", "group_name", "_t0", "time_started", "stream", "end", "_keepalive",
                 "_fr_entry", "_owner", "done")

    def __init__(self, op_type: str, seq: int, group_name: str, owner: BackendState, stream: int, end: int,
                 keep: Any, entry: _Entry | None) -> None:
        self.op_type = op_type
        self.seq = seq
        self.group_name = group_name
        self._t0 = time.perf_counter()
        # The flight recorder's entry read the wall clock a moment ago: one clock read fewer.
        self.time_started = time.time() if entry is None else entry.time_started
        self.stream = stream
        self.end = end
        self._keepalive: Any = keep
        self._fr_entry = entry
        self._owner = owner
        self.done = False

    def fired(self, rt: Any, now: float) -> None:
        """The op's end event fired (or a later one on its stream did): complete it as of ``now``."""
        self._settle(None, now)

    def fail(self, reason: str) -> None:
        """Fail the op for ``reason`` (nothing once complete)."""
        self._settle(f"DistBackendError: {self.name()} failed: {reason}", time.perf_counter())

    def has_fired(self, rt: Any) -> bool:
        """Whether the op is complete or its end event has fired (one query)."""
        return self.done or rt.query(self.end)

    def _settle(self, error: str | None, now: float) -> None:
        """Complete (``error`` None) or fail the op once; its flight-recorder entry says so."""
        if self.done:
            return
        self.done = True
        self._keepalive = None
        entry = self._fr_entry
        if entry is not None and entry.seq == self.seq:
            if error is None:
                entry.done = now - self._t0  # (entry.complete, without its frame)
            else:
                entry.fail(error, now - self._t0)

    def poll(self) -> bool:
        """Complete or fail the op if it finished or its backend failed; True once it has."""
        if not self.done:
            reason = self._owner.failure()
            if reason is not None:
                self.fail(reason)
            else:
                complete_until(self._owner, None)
        return self.done

    def name(self) -> str:
        group = f" on group {self.group_name!r}" if self.group_name else ""
        return f"{self.op_type} (seq {self.seq}){group}"

    def as_work(self) -> NCCLWork:
        """A Work standing for this op (for the watchdog: its timeout fails that Work,
        which updates the op's flight-recorder entry, and aborts the backend)."""
        b = self._owner
        w = HotWork(self.op_type, b, None, b.timeout, b.device_index, _Handle(self.end), None, None)
        w.stand_for(self._t0, self.time_started, self.seq, self.group_name, self._fr_entry)
        return w


class _Handle:
    """A raw event handle as an :class:`~.runtime.Event` (for :meth:`Quiet.as_work`)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


Pending = Union[NCCLWork, Quiet]


def make(b: BackendState, op_type: str, plan: Plan) -> Hot | None:
    """The Hot of a cached ``plan`` (calls only), or None when it is not a single call."""
    comm = b.comm_slot.comm
    if len(plan) != 1 or comm is None:
        return None
    pre, calls, post = plan[0]
    if pre or post or len(calls) != 1:
        return None
    step = calls[0]
    return Hot(op_type, functools.partial(getattr(comm, step[0]), *step[1:]))


def issue_quiet(b: BackendState, hot: Hot, buf: Buffer, seq: int, entry: _Entry | None, group_name: str) -> bool:
    """Issue ``hot`` on ``buf`` for a synchronous caller, with no Work, on the caller's
    current stream of the communicator's device: True once issued; False, having done
    nothing, where the general path must issue it. The backend keeps a :class:`Quiet`
    (op number ``seq`` of group ``group_name``, flight-recorder ``entry``) until the op
    completes.

    In steady state this is one NCCL call and two CUDA calls: ``cudaStreamIsCapturing``
    on the stream (a capture may begin between any two ops) and the end event's
    record. The device is not asked for: the stream is CuPy's current one *of the
    communicator's device* (a thread on another device gets that device's stream, as
    torch's ``getCurrentCUDAStream(device)``), NCCL makes its own device current for
    the call, and an event records on a stream of its own device whatever is current."""
    where = buf.device
    if buf.foreign_stream or where.index != b.device_index or where.type != "cuda":
        return False
    return issue_quiet_on(b, hot, buf.stream, buf, seq, entry, group_name)


def issue_quiet_on(b: BackendState, hot: Hot, given: int | None, keep: Any, seq: int, entry: _Entry | None,
                   group_name: str) -> bool:
    """:func:`issue_quiet` once the array is known to be on the communicator's device
    with no foreign stream: ``given`` is the stream its producer named (None: the
    caller's), ``keep`` what holds its memory until the op completes (its Buffer, or
    the array itself)."""
    stream = b.runtime.current_stream_of(b.device_index)
    if given is not None and given != stream:
        return False  # a producer stream other than the caller's: the general path orders it
    return issue_quiet_at(b, hot, stream, keep, seq, entry, group_name)


def issue_quiet_at(b: BackendState, hot: Hot, stream: int, keep: Any, seq: int, entry: _Entry | None,
                   group_name: str) -> bool:
    """:func:`issue_quiet_on` once ``stream`` is known to be the caller's current stream
    of the communicator's device and the one the array's producer named."""
    device = b.device_index
    rt = b.runtime
    if rt.is_capturing(stream):
        return False  # the general path captures it, joined back to the caller's stream
    with b.issue_lock:
        if b.ending.over is not None:
            return False
        cs = b.comm_stream
        pool = cs.pool(rt, device)
        end = pool.take()
        issuing = False
        try:
            tail = cs.tail
            if tail is not None:
                # The last op went on the communication stream: this one, on the caller's
                # stream, comes after it (every op of a group runs in issue order).
                rt.wait_event(stream, tail.ptr)
                cs.tail = None
            issuing = True
            on_comm(b, hot.call, stream)
            rt.record(end, stream)
        except Exception as exc:
            failed = issue_failed(b, hot.op_type, exc, issuing, (keep,), [])
            if failed is exc:
                raise
            raise failed from exc
        cs.last_end = None
        work = Quiet(hot.op_type, seq, group_name, b, stream, end, keep, entry)
        # No lock (outstanding.py): an abort's snapshot that misses this op leaves it
        # to fail when polled, since the backend is aborted.
        if b.outstanding.add(work):
            complete_until(b, work)
            b.outstanding.batch_done()
    return True


def issue(b: BackendState, hot: Hot, buf: Buffer) -> NCCLWork | None:
    """Issue ``hot`` on ``buf`` on the communication stream: its Work; None, having done
    nothing, where the general path must issue it. The communication stream waits for
    the caller's stream (a ``ready`` event), runs the op, records ``end``; the Work's
    ``wait()`` makes the caller's stream wait for ``end``."""
    device = b.device_index
    where = buf.device
    if buf.stream_owner is not None or buf.foreign_stream or where.index != device or where.type != "cuda":
        return None
    rt = b.runtime
    stream = given = buf.stream
    if stream is None:
        stream = rt.current_stream_of(device)
    if rt.is_capturing(stream):
        return None
    if buf.nbytes <= b.comm_stream.caller_max and not b.comm_stream.timing and (
            given is None or given == rt.current_stream_of(device)):
        return _issue_on_caller(b, hot, buf, stream)
    return issue_on_comm(b, hot, stream, buf)


def issue_on_comm(b: BackendState, hot: Hot, stream: int, keep: Any) -> NCCLWork | None:
    """:func:`issue` once the array is known to be on the communicator's device with no
    held or foreign stream, and ``stream`` (the stream its producer named, or the
    caller's) is not being captured: the op on the communication stream, after
    ``stream``'s work; its Work, which keeps ``keep`` (the array's Buffer, or the array)
    alive until the op completes. None, having done nothing, once the backend ended."""
    rt = b.runtime
    device = b.device_index
    with b.issue_lock:
        if b.ending.over is not None:
            return None
        cs = b.comm_stream
        timing = cs.timing
        comm_stream = cs.ptr
        # An untimed op's ready event is the stream's one (CommStream.ready_event: a wait
        # takes an event's state when it is made, so the next op may record it again);
        # a timed op keeps its own, for its duration.
        ready = rt.event(True, True, device) if timing else None
        issuing = False
        try:
            mark = ready.ptr if ready is not None else cs.ready or cs.ready_event(rt, device)
            rt.record(mark, stream)
            rt.wait_event(comm_stream, mark)
            issuing = True
            on_comm(b, hot.call, comm_stream)
            # Untimed: a Handle of the backend's pool, given back by the sweep (complete_until).
            end = rt.event(True, True, device) if timing else cs.pool(rt, device).take_handle()
            rt.record(end.ptr, comm_stream)
        except Exception as exc:
            failed = issue_failed(b, hot.op_type, exc, issuing, (keep,), [])
            if failed is exc:
                raise
            raise failed from exc
        cs.tail = end
        if timing:
            prev, cs.last_end = cs.last_end, end
            work: NCCLWork = HotWork(hot.op_type, b, keep, b.timeout, device, end, ready, prev)
        else:
            cs.last_end = None
            work = HotWork(hot.op_type, b, keep, b.timeout, device, end, None, None)
        if b.outstanding.add_work(work):
            complete_until(b, work)
            b.outstanding.batch_done()
    return work


def run_work_class(b: BackendState, op_type: str) -> type[DeviceRunWork]:
    """The class of the Works :func:`start_async` makes for ``b``'s ``op_type`` ops
    (:func:`~.work.device_run_work_class`), made once per backend, op name, device and timeout."""
    key = (op_type, b.device_index, b.timeout)
    classes = b.comm_stream.work_classes
    cls: type[DeviceRunWork] | None = classes.get(key)
    if cls is None:
        cls = classes[key] = device_run_work_class(b, op_type, b.device_index, b.timeout)
    return cls


def start_async(b: BackendState, posted: Posted, hot: Hot, nbytes: int, work_class: type[DeviceRunWork], stream: int,
                keep: Any, seq: int, entry: _Entry | None, group_name: str) -> NCCLWork | None:
    """A DeviceRun's async runner (quiet.py): :func:`issue` of an async op for a caller
    that has checked the array as :func:`issue_quiet_at` says (``stream``: the caller's
    current stream of the communicator's device, the one the array's producer named;
    ``keep``: the array, which its Work holds and ``wait()`` returns), op number ``seq``
    of group ``group_name`` with flight-recorder ``entry``, on the communication stream
    (a small untimed one on ``stream`` itself where ``comm_stream.caller_max`` says so);
    its Work, numbered and tied to ``entry``. None, having done nothing, where the usual
    way must issue it (posted sends and receives, a capture, an ended backend).

    The untimed op on the communication stream, the default, is :func:`issue_on_comm`
    written out in one frame: the ``ready`` event recorded on ``stream`` and waited on
    by the communication stream, the NCCL call, the end event (a pooled
    :class:`~.events.Handle`) recorded after it, and a Work made numbered
    (:class:`~.work.DeviceRunWork`)."""
    if posted.ops:
        return None
    rt = b.runtime
    if rt.is_capturing(stream):
        return None
    cs = b.comm_stream
    if cs.timing or nbytes <= cs.caller_max:
        work = issue_on_comm(b, hot, stream, keep) if cs.timing else _issue_on_caller(b, hot, keep, stream)
        if work is not None:
            work.number(seq, group_name, keep, entry)
        return work
    device = b.device_index
    with b.issue_lock:
        if b.ending.over is not None:
            return None
        comm_stream = cs.ptr
        pool = cs.events or cs.pool(rt, device)
        handles = pool.handles
        end = handles.pop() if handles else pool.take_handle()
        issuing = False
        try:
            mark = cs.ready or cs.ready_event(rt, device)
            rt.record(mark, stream)
            rt.wait_event(comm_stream, mark)
            issuing = True
            # on_comm(b, hot.call, comm_stream), written out (two frames fewer): the call
            # under the communicator's lock, an abort meanwhile carried out here.
            slot = b.comm_slot
            with slot.lock:
                if slot.gone:
                    raise RuntimeError("the communicator is gone")
                hot.call(comm_stream)
            if b.ending.aborted is not None:
                _abort_comm(b, blocking=True)
                raise RuntimeError("the communicator was aborted while this op was being issued")
            rt.record(end.ptr, comm_stream)
        except Exception as exc:
            if not issuing:
                handles.append(end)  # nothing was queued with it
            failed = issue_failed(b, hot.op_type, exc, issuing, (keep,), [])
            if failed is exc:
                raise
            raise failed from exc
        cs.tail = end
        cs.last_end = None
        # Its op's name, backend, device, timeout and pending state are its class's (run_work_class).
        made = work_class(keep, end, seq, group_name, entry)
        if b.outstanding.add_work(made):
            complete_until(b, made)
            b.outstanding.batch_done()
    return made


def _issue_on_caller(b: BackendState, hot: Hot, buf: Any, stream: int) -> NCCLWork | None:
    """:func:`issue` of a small async op (up to ``comm_stream.caller_max`` bytes, untimed) on
    the caller's current stream ``stream`` itself, as a synchronous op is issued
    (:func:`issue_quiet_on`): one event, no ``ready`` event and no wait of the
    communication stream. Its Work's ``wait()`` makes the caller's current stream wait
    only when that is another stream than ``stream`` (on ``stream`` the op already comes
    first); ``is_completed()`` and the watchdog query its ``end`` event as usual."""
    rt = b.runtime
    device = b.device_index
    with b.issue_lock:
        if b.ending.over is not None:
            return None
        cs = b.comm_stream
        issuing = False
        try:
            tail = cs.tail
            if tail is not None:
                # The last op went on the communication stream: this one comes after it.
                rt.wait_event(stream, tail.ptr)
                cs.tail = None
            issuing = True
            on_comm(b, hot.call, stream)
            end = cs.pool(rt, device).take_handle()  # given back by the sweep (complete_until)
            rt.record(end.ptr, stream)
        except Exception as exc:
            failed = issue_failed(b, hot.op_type, exc, issuing, (buf,), [])
            if failed is exc:
                raise
            raise failed from exc
        cs.last_end = None
        work = HotWork(hot.op_type, b, buf, b.timeout, device, end, None, None, stream)
        if b.outstanding.add_work(work):
            complete_until(b, work)
            b.outstanding.batch_done()
    return work


def issue_failed(b: BackendState, op_type: str, exc: Exception, issuing: bool, bufs: Sequence[Any],
                 temps: list[Any]) -> Exception:
    """The error to raise for an op that failed while being issued, after what that
    failure requires: once any part of it may be queued on the stream (``issuing``),
    its arrays and temporaries are kept for the backend's life, and the communicator,
    out of step with its peers, is aborted."""
    if isinstance(exc, (DistBackendError, BackendUnavailableError)):
        return exc
    aborted = b.ending.aborted
    why = f"the communicator was aborted: {aborted}" if aborted else f"{type(exc).__name__}: {exc}"
    if issuing:
        b.comm_stream.keep([*bufs, *temps])
        if aborted is None:
            b.abort(f"{op_type} failed while being issued ({why})")
    return DistBackendError(f"{op_type} on group {b.group_name!r} failed: {why}")


# Which backends each thread has been set up to poll for (poll): by id, the value
# whether its capture mode could be set.
_watch_threads = threading.local()


def poll(b: BackendState) -> NCCLWork | None:
    """``NCCLBackend.poll_pending`` (the watchdog's timer): notice an asynchronous NCCL
    error, complete the ops that finished, and return the oldest one still running (a
    Work standing for it when it has none), or None. The calling thread is set up once
    per backend: its device made current if it has no CUDA context, its capture mode
    thread-local for good."""
    if b.failure() is None and b.outstanding:
        ready: dict[int, bool] | None = getattr(_watch_threads, "ready", None)
        if ready is None:
            ready = _watch_threads.ready = {}
        if id(b) not in ready:
            rt = b.runtime
            if not rt.has_context():
                rt.set_device(b.device_index)
            rt.exchange_capture_mode(CAPTURE_THREAD_LOCAL)
            ready[id(b)] = rt.can_exchange_capture_mode
        oldest = complete_until(b, None, mode_set=ready[id(b)])
    else:
        oldest = b.outstanding.oldest()
    return oldest.as_work() if isinstance(oldest, Quiet) else oldest


def complete_until(b: BackendState, stop: Pending | None, mode_set: bool = False) -> Pending | None:
    """Complete, in issue order, the pending works that finished, up to ``stop`` (not
    included); the oldest one still running, or None. ``mode_set``: the calling thread
    (the watchdog's) is in thread-local capture mode already; otherwise the queries are
    made in that mode, set for the sweep (see work.query_outside_capture). Event
    queries need no particular device current."""
    works = b.outstanding.snapshot()
    if stop is not None:
        try:
            works = works[:works.index(stop)]
        except ValueError:
            pass  # completed (and popped) meanwhile: every earlier one was too
    if not works:
        return None
    rt = b.runtime
    mode = -1 if mode_set else rt.exchange_capture_mode(CAPTURE_THREAD_LOCAL)
    try:
        done = _finished_prefix(b, works)
        if done > 0:
            aborted = b.ending.aborted
            if aborted is not None:  # issued as the abort came: its end may fire, the op failed
                for w in works[:done]:
                    w.fail(aborted)
            else:
                now = time.perf_counter()
                pool = b.comm_stream.events
                for i in range(done):
                    w = works[i]
                    if type(w) is Quiet:
                        if not w.done:
                            w.fired(rt, now)
                            if pool is not None:
                                pool.give(w.end)
                        continue
                    # Its pooled end given back; if nobody holds it, dropped below, its
                    # arrays with it (if only its flight-recorder entry looks, the entry
                    # is completed instead of the Work).
                    unheld = _refs(w) <= _UNHELD
                    w.swept(rt, now, pool, unheld)
    finally:
        if mode >= 0:
            rt.exchange_capture_mode(mode)
    if done < 0:
        return None  # a query failed: the backend was aborted, and every pending work failed
    if done:
        b.outstanding.drop_finished(works[:done])
    return works[done] if done < len(works) else None


def _finished_prefix(b: BackendState, works: list[Pending]) -> int:
    """How many of ``works`` (in issue order) have finished. Ops on one stream finish
    in issue order, so each run of consecutive ops on one stream (the caller's, for
    Work-less ops; the communication stream for the rest) takes a binary search over
    their end events; the next run is looked at only once this one has finished. -1
    when a query failed (then the backend is aborted, and the work that failed names why)."""
    n = len(works)
    if Quiet not in map(type, works):
        return _finished_run(b, works, 0, n)  # Works only (async ops): one run, found without a loop of ours
    comm = b.comm_stream.ptr
    first = 0
    while first < n:
        w = works[first]
        stream = w.stream if type(w) is Quiet else comm
        last = first + 1
        while last < n:
            w = works[last]
            if (w.stream if type(w) is Quiet else comm) != stream:
                break
            last += 1
        done = _finished_run(b, works, first, last)
        if done < last:
            return done
        first = last
    return n


def _finished_run(b: BackendState, works: list[Pending], lo: int, hi: int) -> int:
    """The end of the finished prefix of ``works[lo:hi]`` (one stream's run), or -1."""
    rt = b.runtime
    probe = hi - 1          # the newest first: when the GPU keeps up, one query settles it
    while lo < hi:
        w = works[probe]
        try:
            fired = w.has_fired(rt)
        except Exception as exc:
            # A failed query means a sticky CUDA error (a kernel faulted): the
            # communicator cannot be trusted after it.
            why = f"CUDA reported {type(exc).__name__}: {exc} while checking {w.name()}"
            b.abort(why)
            w.fail(why)
            return -1
        if fired:
            lo = probe + 1
        else:
            hi = probe
        probe = (lo + hi) // 2
    return lo

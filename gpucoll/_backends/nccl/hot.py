"""The NCCL backend's hot path: a repeated op issued with only the calls it needs, and
completion of finished ops in bulk. Functions over an :class:`NCCLBackend`'s state
(declared in its ``__init__``), as lifecycle.py's are.

**Issuing.** An op whose plan is one NCCL call and nothing else (no copy, kernel,
temporary or PreMul operator) gets a :class:`Hot` the first time it is issued through
the general path (``NCCLBackend._issue``), under the same key as its cached plan: the
bound NCCL call and its arguments. A later call with that key goes through
:func:`issue`, which makes only the runtime calls the op needs (two events, a record
and a stream wait, the NCCL call, the end event's record) and one Work. It gives up,
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
it in order, each with a few field writes (:meth:`NCCLWork._fired`).
"""

from __future__ import annotations

import functools
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union, overload

from ..._buffer import Buffer
from ...errors import BackendUnavailableError, DistBackendError
from .plan import Plan
from .runtime import CAPTURE_THREAD_LOCAL, enter_device, leave_device
from .phases import on_comm
from .work import NCCLWork

if TYPE_CHECKING:
    from ..._debug.flight_recorder import _Entry
    from .backend import NCCLBackend

__all__ = ["Hot", "Quiet", "Pending", "PRUNE_AT", "make", "issue", "issue_failed", "complete_until"]

PRUNE_AT = 64  # outstanding works kept before the issue path completes finished ones itself
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
    docstring): what completing it, failing it and timing it out need."""

    __slots__ = ("op_type", "seq", "group_name", "_t0", "time_started", "_end", "_keepalive", "_fr_entry",
                 "_owner", "done")

    def __init__(self, op_type: str, seq: int, group_name: str, owner: NCCLBackend, end: Any, keep: Buffer,
                 entry: _Entry | None) -> None:
        self.op_type = op_type
        self.seq = seq
        self.group_name = group_name
        self._t0 = time.perf_counter()
        self.time_started = time.time()
        self._end = end
        self._keepalive: Buffer | None = keep
        self._fr_entry = entry
        self._owner = owner
        self.done = False

    def _fired(self, rt: Any, now: float) -> None:
        """The op's end event fired (or a later one did): complete it as of ``now``."""
        self._settle(None, now)

    def _fail(self, reason: str) -> None:
        self._settle(f"DistBackendError: {self._name()} failed: {reason}", time.perf_counter())

    def _settle(self, error: str | None, now: float) -> None:
        """Complete (``error`` None) or fail the op once; its flight-recorder entry says so."""
        if self.done:
            return
        self.done = True
        self._keepalive = None
        entry = self._fr_entry
        if entry is not None and entry.seq == self.seq:
            if error is None:
                entry.complete(now - self._t0)
            else:
                entry.fail(error, now - self._t0)

    def _poll(self) -> bool:
        """Complete or fail the op if it finished or its backend failed; True once it has."""
        if not self.done:
            reason = self._owner._failure()
            if reason is not None:
                self._fail(reason)
            else:
                complete_until(self._owner, None)
        return self.done

    def _name(self) -> str:
        group = f" on group {self.group_name!r}" if self.group_name else ""
        return f"{self.op_type} (seq {self.seq}){group}"

    def as_work(self) -> NCCLWork:
        """A Work standing for this op (for the watchdog: its timeout fails that Work,
        which updates the op's flight-recorder entry, and aborts the backend)."""
        b = self._owner
        w = NCCLWork._hot(self.op_type, b, None, b._timeout, b._device, self._end, None, None)
        w._keepalive = None
        w._t0, w.time_started = self._t0, self.time_started
        w.seq, w.group_name, w._fr_entry = self.seq, self.group_name, self._fr_entry
        return w


Pending = Union[NCCLWork, Quiet]


def make(b: NCCLBackend, op_type: str, plan: Plan) -> Hot | None:
    """The Hot of a cached ``plan`` (calls only), or None when it is not a single call."""
    if len(plan) != 1 or b._comm is None:
        return None
    pre, calls, post = plan[0]
    if pre or post or len(calls) != 1:
        return None
    step = calls[0]
    return Hot(op_type, functools.partial(getattr(b._comm, step[0]), *step[1:]))


@overload
def issue(b: NCCLBackend, hot: Hot, buf: Buffer) -> NCCLWork | None: ...


@overload
def issue(b: NCCLBackend, hot: Hot, buf: Buffer, seq: int, entry: _Entry | None, group_name: str) -> Pending | None:
    ...


def issue(b: NCCLBackend, hot: Hot, buf: Buffer, seq: int = -1, entry: _Entry | None = None,
          group_name: str = "") -> Pending | None:
    """Issue ``hot`` on ``buf``: its Work; None, having done nothing, where the general
    path must issue it. Given ``seq``, for a synchronous caller, with no Work: the
    caller's stream waits for the op, and the backend keeps a :class:`Quiet` (op number
    ``seq`` of group ``group_name``, flight-recorder ``entry``) until it completes."""
    device = b._device
    where = buf.device
    if buf.stream_owner is not None or buf.foreign_stream or where.index != device or where.type != "cuda":
        return None
    rt = b._rt
    if rt.get_device() != device:
        return None
    stream = buf.stream
    if stream is None:
        stream = rt.current_stream()
    if rt.is_capturing(stream):
        return None
    with b._lock:
        if b._aborted is not None or b._closed is not None:
            return None
        timing = b._timing
        comm_stream = b._stream_ptr
        ready = rt.event(True, timing)
        issuing = False
        try:
            rt.record(ready.ptr, stream)
            rt.wait_event(comm_stream, ready.ptr)
            issuing = True
            on_comm(b, hot.call, comm_stream)
            end = rt.event(True, timing)
            rt.record(end.ptr, comm_stream)
        except Exception as exc:
            failed = issue_failed(b, hot.op_type, exc, issuing, (buf,), [])
            if failed is exc:
                raise
            raise failed from exc
        work: Pending
        if seq >= 0:
            b._last_end = end if timing else None
            work = Quiet(hot.op_type, seq, group_name, b, end, buf, entry)
        elif timing:
            prev, b._last_end = b._last_end, end
            work = NCCLWork._hot(hot.op_type, b, buf, b._timeout, device, end, ready, prev)
        else:
            b._last_end = None
            work = NCCLWork._hot(hot.op_type, b, buf, b._timeout, device, end, None, None)
        # Appending needs no lock (a deque's append is atomic; only the sweep, under
        # _state, pops from the other end); abort's snapshot under _state may miss a
        # work appended meanwhile, as it may miss one issued a moment later: either way
        # the work fails when waited on or polled, since the backend is aborted.
        pending = b._pending
        pending.append(work)
        if len(pending) > b._prune_next:
            complete_until(b, work)
            b._prune_next = len(pending) + PRUNE_AT
    if seq >= 0:
        # What NCCLWork.wait does: the caller's current stream waits for the op (the
        # producer's stream, named by the array but not held, is left alone as there).
        try:
            rt.wait_event(stream if buf.stream is None else rt.current_stream(), end.ptr)
        except Exception as exc:
            raise DistBackendError(f"{work._name()}: making the caller's stream wait failed: {exc}") from exc
    return work


def issue_failed(b: NCCLBackend, op_type: str, exc: Exception, issuing: bool, bufs: Sequence[Buffer],
                 temps: list[Any]) -> Exception:
    """The error to raise for an op that failed while being issued, after what that
    failure requires: once any part of it may be queued on the stream (``issuing``),
    its arrays and temporaries are kept for the backend's life, and the communicator,
    out of step with its peers, is aborted."""
    if isinstance(exc, (DistBackendError, BackendUnavailableError)):
        return exc
    aborted = b._aborted
    why = f"the communicator was aborted: {aborted}" if aborted else f"{type(exc).__name__}: {exc}"
    if issuing:
        b._keep.extend([*bufs, *temps])
        if aborted is None:
            b.abort(f"{op_type} failed while being issued ({why})")
    return DistBackendError(f"{op_type} on group {b._group_name!r} failed: {why}")


def complete_until(b: NCCLBackend, stop: Pending | None) -> Pending | None:
    """Complete, in issue order, the pending works that finished, up to ``stop`` (not
    included); the oldest one still running, or None."""
    pending = b._pending
    with b._state:
        works = list(pending)
    if stop is not None:
        try:
            works = works[:works.index(stop)]
        except ValueError:
            pass  # completed (and popped) meanwhile: every earlier one was too
    if not works:
        return None
    rt = b._rt
    # Event queries in thread-local capture mode (see work.query_outside_capture), set
    # once for the sweep; on the communicator's device, entered once for the sweep.
    mode = rt.exchange_capture_mode(CAPTURE_THREAD_LOCAL)
    try:
        prev_device = -1 if rt.get_device() == b._device else enter_device(rt, b._device)
        try:
            done = _finished_prefix(b, works)
            if done > 0:
                aborted = b._aborted
                if aborted is not None:  # issued as the abort came: its end may fire, the op failed
                    for w in works[:done]:
                        w._fail(aborted)
                else:
                    now = time.perf_counter()
                    for i in range(done):
                        w = works[i]
                        if (type(w) is NCCLWork and w._fr_entry is None and w._callbacks is None
                                and w._future is None and _refs(w) <= _UNHELD):
                            continue  # nobody holds it: dropped below, its arrays with it
                        w._fired(rt, now)
        finally:
            leave_device(rt, prev_device)
    finally:
        rt.exchange_capture_mode(mode)
    if done < 0:
        return None  # a query failed: the backend was aborted, and every pending work failed
    if done:
        with b._state:
            for w in works[:done]:
                if pending and pending[0] is w:
                    pending.popleft()
    return works[done] if done < len(works) else None


def _finished_prefix(b: NCCLBackend, works: list[Pending]) -> int:
    """How many of ``works`` (in issue order) have finished: a binary search over their
    end events, which fire in order. -1 when a query failed (then the backend is
    aborted, and the work that failed names why)."""
    rt = b._rt
    lo, hi = 0, len(works)  # works[:lo] finished; works[hi:] have not
    probe = hi - 1          # the newest first: when the GPU keeps up, one query settles it
    while lo < hi:
        w = works[probe]
        end = w._end
        try:
            fired = (w.done if isinstance(w, Quiet) else w._done._flag) or (end is not None and rt.query(end.ptr))
        except Exception as exc:
            # A failed query means a sticky CUDA error (a kernel faulted): the
            # communicator cannot be trusted after it.
            why = f"CUDA reported {type(exc).__name__}: {exc} while checking {w._name()}"
            b.abort(why)
            w._fail(why)
            return -1
        if fired:
            lo = probe + 1
        else:
            hi = probe
        probe = (lo + hi) // 2
    return lo

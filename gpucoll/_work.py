"""Work (the handle of an issued op) and WorkInfo (the record a completion hook gets).

A backend creates one Work per op and completes it exactly once with
:meth:`Work._set_result` or :meth:`Work._set_exception`. Device backends subclass
Work and override :meth:`is_completed`, :meth:`wait` and :meth:`synchronize` to
use CUDA events (DESIGN.md, Streams).
"""

from __future__ import annotations

import threading
import time
import concurrent.futures
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

from ._timeouts import to_seconds
from .errors import DistBackendError, DistError
from .futures import Future

__all__ = ["Work", "WorkInfo"]


@dataclass(frozen=True)
class WorkInfo:
    """What a completion hook receives about one finished op.

    Same fields as torch's ``WorkInfo``, in seconds (float) rather than timedelta:

    Attributes:
        op_type: the op's name, e.g. ``"all_reduce"``, ``"send"``, ``"barrier"``.
        seq: the op's sequence number in its group (1, 2, ...; same on every rank
            for collectives).
        time_started: wall-clock time (``time.time()``) when the op was issued.
        time_finished: wall-clock time when it was seen complete.
        active_duration: seconds the op actually ran (CUDA events on GPUs; the
            backend's own clock on CPU).
        group_name: the process group's name.
        success: False when the op raised or was aborted.
    """

    op_type: str
    seq: int
    time_started: float
    time_finished: float
    active_duration: float
    group_name: str = ""
    success: bool = True


class Work:
    """Handle of an asynchronous op (``async_op=True``), as in torch.distributed.

    Args:
        op_type: op name for errors, hooks and the flight recorder.
        keepalive: objects (arrays, Buffers) to hold until the op completes.
        result: what :meth:`result` returns once complete (typically the output arrays).
    """

    # Class-level defaults for what most Works never change: a Work is made per op,
    # and every attribute set in __init__ costs the issuing thread.
    seq: int = 0
    group_name: str = ""
    peer: int = -1  # a send's or recv's peer (group rank): a timeout names it
    time_finished: float | None = None
    active_duration: float | None = None
    _source_rank: int = -1
    # Made on first use: a small op's Work is created, completed and dropped in
    # microseconds, and an Event plus a Future would cost more than the op itself.
    _future: WorkFuture | None = None
    _exc: BaseException | None = None
    _callbacks: list[Callable[[Work], None]] | None = None
    # The group's flight-recorder entry for this op (see gpucoll._debug.flight_recorder);
    # updated on completion so the recorder needs no callback of its own.
    _fr_entry: Any = None
    # all_reduce_coalesced(async_op=True): torch hands back a Future whose wait() gives the
    # reduced arrays; such a Work's wait() returns result() instead of True.
    _wait_gives_result: bool = False
    # A backend that runs ops on a thread of its own may let a thread about to block in
    # wait() run the ops queued up to this one instead (``helper(work, limit)``, limit:
    # the seconds wait() would block, None for no limit): no thread wake-up to pay for.
    _helper: Callable[[Work, float | None], None] | None = None
    # What must happen when the op succeeds, before anyone can see it complete: the copy of
    # results into the caller's non-contiguous output arrays (gpucoll._collectives).
    _finalize: Callable[[list[Any]], None] | None = None

    def __init__(self, op_type: str, *, keepalive: Sequence[Any] = (), result: list[Any] | None = None,
                 default_timeout: float | None = None) -> None:
        self.op_type = op_type
        self.time_started = time.time()
        self._t0 = time.perf_counter()
        self._default_timeout = default_timeout
        self._keepalive: Sequence[Any] | None = keepalive
        self._result = result if result is not None else []
        self._lock = threading.Lock()
        self._done = _Completion(self._lock)

    @classmethod
    def _completed(cls, op_type: str, seq: int, group_name: str, result: list[Any], time_started: float,
                   t0: float, active_duration: float) -> Work:
        """A Work for an op that already ran to its end on the issuing thread (a small
        ``async_op=True`` host op started at ``time.perf_counter()`` ``t0``): complete from
        birth, so ``wait()`` is a flag check. Built without ``__init__``, whose clocks and
        completion state cost more than the rest of the op's issue path; every field
        ``__init__`` sets is set (``_keepalive`` to None, as completion does)."""
        work = cls.__new__(cls)
        work.op_type = op_type
        work.seq = seq
        work.group_name = group_name
        work.time_started = time_started
        work.time_finished = time_started + active_duration
        work.active_duration = active_duration
        work._t0 = t0
        work._default_timeout = None
        work._keepalive = None
        work._result = result
        # Shared by every such Work (as NCCLWork's hot Works share one): it is only held
        # for a few field reads or writes (get_future, _add_done_callback, _finish), never
        # while anything else is called.
        work._lock = _COMPLETED._lock
        work._done = _COMPLETED  # complete, and nothing ever waits on or sets it
        return work

    # ----- completion, called by backends (exactly once) -----
    def _set_result(self, *, active_duration: float | None = None, source_rank: int | None = None) -> None:
        self._finish(None, active_duration, source_rank)

    def _set_exception(self, exc: BaseException) -> None:
        self._finish(exc, None, None)

    def _finish(self, exc: BaseException | None, active: float | None, source_rank: int | None,
                now: float | None = None) -> None:
        with self._lock:
            done = self._done
            if done._flag:
                return
            finalize = self._finalize
            if finalize is not None:
                self._finalize = None
                if exc is None:
                    try:
                        finalize(self._result)
                    except Exception as err:  # noqa: BLE001  (the op fails with it, named)
                        exc = DistBackendError(f"{self._name()}: writing its results into the output arrays "
                                               f"failed: {type(err).__name__}: {err}")
                        exc.__cause__ = err
            if now is None:
                now = time.perf_counter()
            self.time_finished = self.time_started + (now - self._t0)
            self.active_duration = active if active is not None else now - self._t0
            if source_rank is not None:
                self._source_rank = source_rank
            self._exc = exc
            self._keepalive = None
            if done is _PENDING:  # (a state shared until completion: _PENDING says why)
                self._done = _COMPLETED
                event = None
            else:
                event = done._set_locked()
            callbacks = self._callbacks
            future = self._future
        self._finish_rest(event, callbacks, future)

    def _finish_rest(self, event: threading.Event | None, callbacks: list[Callable[[Work], None]] | None,
                     future: WorkFuture | None) -> None:
        """What completion does after the state is set (outside the lock): wake waiters,
        update the flight recorder, resolve the future, run the callbacks."""
        if callbacks is not None:
            self._callbacks = None
        if event is not None:
            event.set()
        entry = self._fr_entry
        if entry is not None:
            entry.finish(self)
        if future is not None:
            _resolve(future, self._result, self._exc, self._name())
        if callbacks:
            for cb in callbacks:
                cb(self)

    def _before_done(self, fn: Callable[[list[Any]], None]) -> None:
        """Run ``fn(results)`` when the op succeeds, before it is seen complete (by ``wait()``,
        ``is_completed()``, its future or its callbacks); at once, on this thread, if it
        has already succeeded; never if it fails. ``results`` is the list :meth:`result`
        returns; ``fn`` may replace its entries."""
        with self._lock:
            if not self._done._flag:
                before = self._finalize
                if before is None:
                    self._finalize = fn
                else:
                    def both(results: list[Any]) -> None:
                        before(results)
                        fn(results)
                    self._finalize = both
                return
        if self._exc is None:
            fn(self._result)

    def _add_done_callback(self, cb: Callable[[Work], None]) -> None:
        """Run ``cb(self)`` once complete (immediately, on this thread, if already complete)."""
        with self._lock:
            if not self._done.is_set():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(cb)
                return
        cb(self)

    def _poll(self) -> bool:
        """Called by the group's watchdog thread: check for completion without blocking and,
        for device work, complete the Work when its end event has fired. Host work is
        completed by its backend's thread, so the base version only reports."""
        return self._done.is_set()

    # ----- the public surface -----
    def is_completed(self) -> bool:
        """True once the op finished (successfully or not); never blocks."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """True if the op completed without error. Raises if it has not completed yet."""
        if not self.is_completed():
            raise RuntimeError(f"{self._name()} has not completed; call wait() first")
        return self._exc is None

    def exception(self) -> BaseException | None:
        """The error the op failed with, or None (also None while still running)."""
        return self._exc

    def wait(self, timeout: float | timedelta | None = None) -> bool | list[Any]:
        """Block until the op completes; re-raise its error.

        Args:
            timeout: seconds (or timedelta); None uses the group's timeout.

        Returns:
            True once completed; for ``all_reduce_coalesced(..., async_op=True)`` the list
            of reduced arrays (torch returns a Future there, whose ``wait()`` gives them).

        Raises:
            DistBackendError: the op failed, was aborted, or did not complete in time.
        """
        if self._done._flag:
            if self._exc is None:  # the common case, first: a completed op
                return self._result if self._wait_gives_result else True
            limit: float | None = 0.0
        else:
            if timeout is not None or self._default_timeout is not None:
                limit = to_seconds(timeout, default=self._default_timeout)
            else:
                limit = None
            helper = self._helper
            if helper is not None:
                helper(self, limit)
        if not self._done.wait(limit):
            raise DistBackendError(
                f"{self._name()} did not complete within {limit:.3g} s (Work.wait timeout)")
        if self._exc is not None:
            if isinstance(self._exc, DistError):
                raise self._exc
            raise DistBackendError(f"{self._name()} failed: {self._exc}") from self._exc
        waited: bool | list[Any] = self._waited()
        return waited

    def _waited(self) -> Any:
        """What wait() returns once the op completed."""
        return self._result if self._wait_gives_result else True

    def synchronize(self) -> None:
        """Block the host until the op completed (same as wait() for host ops)."""
        self.wait()

    def result(self) -> list[Any]:
        """The op's outputs (a list of arrays; empty for ops without outputs)."""
        self.wait()
        return self._result

    def get_future(self) -> WorkFuture:
        """A future of :meth:`result` (torch's ``Work.get_future()``): a
        :class:`gpucoll.futures.Future` (``wait``, ``value``, ``then``, ``add_done_callback``,
        ``done``) that also keeps ``concurrent.futures``' ``result(timeout)`` and
        ``exception(timeout)``. Its error is the one :meth:`wait` raises."""
        with self._lock:
            future = self._future
            if future is None:
                future = self._future = WorkFuture(self)
                done = self._done.is_set()
            else:
                done = False
        if done:
            _resolve(future, self._result, self._exc, self._name())
        return future

    def source_rank(self) -> int:
        """For a recv from any source: the rank the message came from (after wait())."""
        if self.op_type not in ("recv", "irecv", "recv_anysource"):
            raise RuntimeError(f"source_rank() is only defined for recv; this Work is {self.op_type}")
        self.wait()
        return self._source_rank

    def info(self) -> WorkInfo:
        """This op's :class:`WorkInfo` (complete ops only)."""
        if not self.is_completed():
            raise RuntimeError(f"{self._name()} has not completed")
        return WorkInfo(
            op_type=self.op_type, seq=self.seq,
            time_started=self.time_started,
            time_finished=self.time_finished or self.time_started,
            active_duration=self.active_duration or 0.0,
            group_name=self.group_name, success=self._exc is None,
        )

    def _name(self) -> str:
        group = f" on group {self.group_name!r}" if self.group_name else ""
        return f"{self.op_type} (seq {self.seq}){group}"

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<Work {self._name()} {state}>"


def _resolve(future: WorkFuture, result: list[Any], exc: BaseException | None, name: str) -> None:
    future._work = None  # complete: nothing left to wait for (and no Work <-> future cycle)
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(_raised(exc, name))


def _raised(exc: BaseException, name: str) -> BaseException:
    """The error ``wait()`` raises for an op named ``name`` that failed with ``exc``."""
    if isinstance(exc, DistError):
        return exc
    err = DistBackendError(f"{name} failed: {exc}")
    err.__cause__ = exc
    return err


class FutureTimeoutError(DistError, concurrent.futures.TimeoutError):
    """A Work's future did not complete within ``result(timeout)`` / ``exception(timeout)``."""


class WorkFuture(Future[list[Any]]):
    """The future of a :class:`Work`: torch's Future, plus ``concurrent.futures``' two getters.

    ``wait()`` waits as :meth:`Work.wait` does (with the group's timeout, running what the
    op needs to make progress, and, for device arrays, ordering the caller's current
    stream after the op), then gives the value; callbacks run when the op completes, on
    the thread that completes it.
    """

    __slots__ = ("_work",)

    def __init__(self, work: Work) -> None:
        super().__init__()
        self._work: Work | None = work

    def wait(self) -> list[Any]:
        """Wait as the Work's ``wait()`` does; the op's outputs, or raise its error."""
        work = self._work
        if work is not None:
            try:
                work.wait()
            except DistError:
                if not self.done():
                    raise  # timed out: the op itself is still running
            self._work = None
        return super().wait()

    def result(self, timeout: float | None = None) -> list[Any]:
        """``concurrent.futures.Future.result``: the value within ``timeout`` seconds.

        Raises:
            FutureTimeoutError: not complete within ``timeout``.
        """
        if timeout is None:
            return self.wait()
        self._within(timeout)
        return self.value()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """``concurrent.futures.Future.exception``: the error (None on success) within ``timeout``.

        Raises:
            FutureTimeoutError: not complete within ``timeout``.
        """
        if timeout is None:
            try:
                self.wait()
            except BaseException as exc:  # noqa: BLE001  (returned, as concurrent.futures does)
                return exc
            return None
        self._within(timeout)
        return self._error

    def _within(self, timeout: float) -> None:
        if not self.done() and not self._block(timeout):
            raise FutureTimeoutError(f"the future of {self._work._name() if self._work else 'a Work'} "
                                     f"did not complete within {timeout:g} s")


class _Completion:
    """``threading.Event``'s ``is_set``/``wait``/``set``, but the Event (a Condition and a
    lock, ~2 us) is only made when a thread actually has to block."""

    __slots__ = ("_flag", "_event", "_lock")

    def __init__(self, lock: threading.Lock) -> None:
        self._flag = False
        self._event: threading.Event | None = None
        self._lock = lock  # the owning Work's lock

    def is_set(self) -> bool:
        return self._flag

    def _set_locked(self) -> threading.Event | None:
        """Mark complete; the caller holds the lock and sets the returned Event after releasing it."""
        self._flag = True
        return self._event

    def set(self) -> None:
        with self._lock:
            event = self._set_locked()
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        with self._lock:
            if self._flag:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)


_COMPLETED = _Completion(threading.Lock())
"""The completion state every Work made by :meth:`Work._completed` shares: set once, here,
and never waited on (``wait`` and ``is_set`` return at the flag), nor set again (a
completed Work's ``_finish`` returns at the flag)."""
_COMPLETED._flag = True


class _Pending(_Completion):
    """The completion state of a Work that no thread ever blocks on (a device Work:
    its ``wait()`` orders streams and its ``synchronize()`` polls), shared by every such
    Work until it completes: :meth:`Work._finish` then gives it :data:`_COMPLETED`
    instead of setting this one, so no completion object is made per op. Blocking on it,
    or setting it, is a mistake, and raises."""

    __slots__ = ()

    def set(self) -> None:
        raise RuntimeError("the shared pending state of device Works is never set (Work._finish swaps it)")

    def wait(self, timeout: float | None = None) -> bool:
        raise RuntimeError("the shared pending state of device Works cannot be waited on (wait() orders "
                           "streams, synchronize() polls)")

    def _set_locked(self) -> threading.Event | None:
        raise RuntimeError("the shared pending state of device Works is never set (Work._finish swaps it)")


_PENDING = _Pending(threading.Lock())
"""The completion state every Work that nobody blocks on starts with (see :class:`_Pending`)."""

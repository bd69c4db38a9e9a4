"""The CPU backend's execution of ops: one at a time, in issue order, on the caller's
thread or the backend's worker thread. Functions over a ``CPUBackend``'s state (the
queue, its lock, the worker), which the class binds as its methods (``b``: the backend;
typed Any, as backend.py imports this module).

A small op issued while nothing is queued runs at once on the caller's thread (no thread
hand-off, which is most of a small op's cost); anything else goes to the worker thread.
An ``async_op=True`` op of the Work-less path never waits for its peers on the caller's
thread: it runs with ``ctx.patience``, and when a peer is not there after that short spin
the transport raises :class:`~.tcp_algos.Deferred` with the rest of the op, which goes
first into the queue; the issuing thread resumes it at its next op if the worker has not
taken it yet. See docs/cpu-backend.md, "Execution order and async".
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from ...errors import DistBackendError
from ..._work import Work
from ..base import issuing_async
from .tcp_algos import Ctx, Deferred, op_label

__all__ = ["INLINE_MAX", "ASYNC_PATIENCE", "LAZY_DELAY", "ASYNC_RECHECK", "submit", "enqueue", "start_worker", "work_loop",
           "run", "now", "bound", "resume", "help_until"]

INLINE_MAX = 1 << 20
"""Ops whose buffers total at most this many bytes run on the caller's thread when nothing is queued."""

ASYNC_PATIENCE = 10e-6
"""Seconds an ``async_op=True`` op on the caller's thread spins for its peers once its own
part is posted; a peer not there by then: the worker thread finishes the op (Deferred)."""

LAZY_DELAY = 2e-3
"""An async op that could not run on its caller's thread (it cannot defer its wait for
peers) is left to that caller while the caller keeps queueing or running such ops: the
worker takes it only once the caller has done neither for this many seconds. A caller
that waits (or issues a synchronous op) meanwhile runs the queued ops itself
(``help_until``), with no thread hand-off; otherwise the op progresses on the worker while
its caller does other things, as torch's async ops do."""

ASYNC_RECHECK = 1e-9
"""The patience of a deferred op that the issuing thread resumes before its next op (the
peer was late already: one look, no spin)."""


def submit(b: Any, work: Work, fn: Callable[[Ctx], None], nbytes: int, sig: int, patient: bool = False) -> Work:
    """Run ``fn`` now on this thread if nothing is queued and it is small, else queue it
    for the worker. ``patient``: an async op, which must not wait for peers here: run
    with ``ctx.patience`` (the op defers what is left to the worker, see Deferred)."""
    # The op's number for errors, fixed now: the ProcessGroup renumbers work.seq later.
    seq = work.seq
    with b._lock:  # the Condition's own lock: entered without the Condition's Python layer
        if b._error is not None or b._closed:
            err = b._error or DistBackendError(f"group {b.group_name!r}: the CPU backend was shut down")
            work._set_exception(DistBackendError(f"{op_label(work.op_type, seq, b.group_name)}: {err}"))
            return work
        # An async op that cannot defer its wait for peers (only ``patient`` ones can) goes
        # to the worker: on this thread it would wait for them before the call returns.
        lazy = not patient and issuing_async()
        inline = not b._busy and not b._queue and nbytes <= INLINE_MAX and not lazy
        if inline:
            b._busy = True
        else:
            if lazy:
                b._lazy.add(work)
                b._lazy_touch = time.monotonic()
                b._queue.append((work, fn, seq, sig, 0.0))
                if b._worker is None or (b._worker_idle and not b._worker_lazy):
                    b._start_worker()  # (a worker waiting for the head's time wakes then anyway)
            else:
                b._enqueue(work, fn, seq, sig, 0.0)
            if patient:  # the issuing thread may run it (with patience) before the worker does
                b._resumable.add(work)
    if inline:
        try:
            b._run(work, fn, seq, sig, ASYNC_PATIENCE if patient else 0.0)
        finally:
            with b._lock:
                b._busy = False
                if b._queue or b._waiters:
                    b._cv.notify_all()
    return work

def enqueue(b: Any, work: Work, fn: Callable[[Ctx], None], seq: int, sig: int, deadline: float) -> None:
    """Queue an op for the worker thread (started on first use); under ``b._lock``."""
    b._queue.append((work, fn, seq, sig, deadline))
    b._start_worker()

def start_worker(b: Any) -> None:
    """Start the worker thread, or wake it if idle; under ``b._lock``."""
    if b._worker is None:
        b._worker = threading.Thread(target=b._work_loop, daemon=True,
                                        name=f"gpucoll-cpu-{b.group_name}-r{b.rank}")
        b._worker.start()
    elif b._worker_idle:
        b._cv.notify_all()

def work_loop(b: Any) -> None:
    while True:
        with b._cv:
            while True:
                while not b._closed and (not b._queue or b._busy):
                    b._worker_idle = True
                    b._cv.wait()
                b._worker_idle = False
                if not b._queue:
                    return
                # a lazy head: its caller's while the caller keeps queueing or running ops
                lazy = b._queue[0][0] in b._lazy
                left = 0.0 if not lazy or b._closed else b._lazy_touch + LAZY_DELAY - time.monotonic()
                if left <= 0:
                    break
                b._worker_idle = b._worker_lazy = True  # its caller's time: woken at ``due``, or by a new op
                b._cv.wait(left)
                b._worker_lazy = False
            work, fn, seq, sig, deadline = b._queue.popleft()
            b._resumable.discard(work)
            b._lazy.discard(work)
            b._busy = True
        try:
            b._run(work, fn, seq, sig, 0.0, deadline)
        finally:
            with b._cv:
                b._busy = False
                if b._waiters:
                    b._cv.notify_all()

def run(b: Any, work: Work, fn: Callable[[Ctx], None], seq: int, sig: int, patience: float = 0.0,
         deadline: float = 0.0) -> None:
    t0 = time.perf_counter()
    ctx = Ctx(seq, deadline or time.monotonic() + b.timeout, sig, b._check, work.op_type, b.group_name)
    ctx.patience = patience
    try:
        if b._error is not None:
            raise b._error
        fn(ctx)
    except Deferred as d:  # (patience only) the worker finishes it, before any later op
        with b._lock:
            b._queue.appendleft((work, d.finish, seq, sig, ctx.deadline))
            if d.resumable:
                b._resumable.add(work)
            b._start_worker()
        return
    except BaseException as exc:
        work._set_exception(b._failed(exc, ctx.name))
        if not isinstance(exc, Exception):
            raise
        return
    work._set_result(active_duration=time.perf_counter() - t0)

def now(b: Any, op_type: str, fn: Callable[..., None], sig: int, *args: Any, async_op: bool = False,
         keep: Sequence[Any] = ()) -> bool | Work:
    """``fn(ctx, *args)`` on this thread now, with no Work, if nothing is queued ahead of it; else False.

    ``async_op``: the op must not wait for its peers on this thread. It runs here with
    ``ctx.patience``: if every peer is there (within that spin) it completes here (True);
    else the transport defers what is left of it (Deferred) and the worker thread finishes
    it: the Work it completes is returned. With ops queued ahead, it is queued behind them
    (its Work). Never False. ``keep``: what that Work keeps alive (the Buffers behind
    ``args``' views, which do not own their memory)."""
    lock = b._lock
    with lock:
        if b._busy or b._queue or b._error is not None or b._closed:
            if not b._resume(ASYNC_RECHECK if async_op else 0.0):
                if not async_op:
                    return False
                busy = True
            else:
                busy = False
                b._busy = True
        else:
            busy = False
            b._busy = True
    if busy:  # behind queued ops (or refused: a Work holding why)
        return submit(b, b._work(op_type, (*keep, *args)), lambda c: fn(c, *args), 0, sig, patient=True)
    try:
        ctx = b._now_ctx  # one Ctx for every op of this path (one at a time: _busy), refilled
        ctx.seq = b._seq = b._seq + 1
        ctx.deadline = time.monotonic() + b.timeout
        ctx.sig = sig
        ctx.op_type = op_type
        ctx.patience = ASYNC_PATIENCE if async_op else 0.0
        try:
            fn(ctx, *args)
        except Deferred as d:
            # Its own part posted, a peer not there: the worker finishes it, first in line.
            work = Work(op_type, keepalive=(*keep, *args), default_timeout=b.timeout)
            work.seq, work.group_name, work._helper = ctx.seq, b.group_name, b._help
            with lock:
                b._queue.appendleft((work, d.finish, ctx.seq, sig, ctx.deadline))
                if d.resumable:
                    b._resumable.add(work)
                b._start_worker()
            return work
        except BaseException as exc:
            err = b._failed(exc, ctx.name)
            if not isinstance(exc, Exception):
                raise
            raise err  # its cause, if any, was set by _failed
    finally:
        # Cleared before the queue is read, so no lock is needed unless someone waits:
        # an op queued meanwhile saw _busy (under the lock) and notified, or it sees
        # it clear; a thread waiting for _busy to clear is notified below.
        b._busy = False
        if b._queue or b._waiters:
            with lock:
                b._cv.notify_all()
    return True

def bound(b: Any, op_type: str, fn: Callable[..., None], sig: int) -> Callable[..., bool | Work]:
    """:func:`now` of one op bound to ``fn`` and ``sig``: ``run(x, red, async_op=False)``.
    A synchronous op with nothing queued, no error and no other op running runs here with
    nothing between the caller and ``fn`` but the issue-order lock and the Ctx; any other
    case goes through :func:`now` itself."""
    lock, monotonic = b._lock, time.monotonic
    acquire, release = lock.acquire, lock.release
    # Its own Ctx (one op at a time: _busy): the signature, name and patience are this
    # kind's for good; only the number and the deadline change per op.
    ctx = Ctx(0, 0.0, sig, b._check, op_type, b.group_name)

    def run(x: Any, red: Any, async_op: bool = False) -> bool | Work:
        if async_op:
            return now(b, op_type, fn, sig, x, red, async_op=True)
        acquire()  # (not ``with lock``: its context-manager calls cost more than the check)
        try:
            free = not (b._busy or b._queue or b._error is not None or b._closed)
            if free:
                b._busy = True
        finally:
            release()
        if not free:
            return now(b, op_type, fn, sig, x, red)
        try:
            ctx.seq = b._seq = b._seq + 1
            ctx.deadline = monotonic() + b.timeout
            try:
                fn(ctx, x, red)  # (no Deferred: that needs patience)
            except BaseException as exc:
                err = b._failed(exc, ctx.name)
                if not isinstance(exc, Exception):
                    raise
                raise err
        finally:
            b._busy = False  # (as in now)
            if b._queue or b._waiters:
                with lock:
                    b._cv.notify_all()
        return True
    return run

def help_until(b: Any, work: Work, limit: float | None) -> None:
    """``work.wait()``'s helper (``Work._helper``): a thread about to block until ``work``
    completes runs the ops queued up to it itself, in order, rather than wake the worker
    thread for them (a wake-up of an idle thread, on a busy or virtual machine, can cost
    more than a small op). Only when the wait would last at least as long as the op may
    (``limit`` None, or reaching the op's deadline): an op run here waits for its peers up
    to that deadline, and a shorter wait must return at its own limit."""
    lock = b._lock
    with lock:
        while (not work._done._flag and b._queue and not b._busy and b._error is None and not b._closed):
            head, fn, seq, sig, deadline = b._queue[0]
            if limit is not None and limit < (deadline - time.monotonic() if deadline else b.timeout):
                return
            b._queue.popleft()
            b._resumable.discard(head)
            if head in b._lazy:
                b._lazy.discard(head)
                b._lazy_touch = time.monotonic()
            b._busy = True
            lock.release()
            try:
                b._run(head, fn, seq, sig, 0.0, deadline)
            finally:
                lock.acquire()
                b._busy = False
                # the worker (it saw _busy) or shutdown; not a worker that waits for the
                # head's time (a lazy op, left to its caller: this thread, here)
                if b._waiters or (b._queue and not (b._worker_lazy and b._queue[0][0] in b._lazy)):
                    b._cv.notify_all()


def resume(b: Any, patience: float) -> bool:
    """Under ``b._lock``: while the queue's head is a deferred op that the worker has
    not taken yet (``_resumable``), run it on this thread (with ``patience``: an async
    caller's; it defers again rather than wait). True when nothing is queued or running
    afterwards (the caller's op may run now); the lock is held again on return."""
    lock = b._lock
    while (b._queue and not b._busy and b._queue[0][0] in b._resumable
           and b._error is None and not b._closed):
        work, fn, seq, sig, deadline = b._queue.popleft()
        b._resumable.discard(work)
        b._busy = True
        lock.release()
        try:
            b._run(work, fn, seq, sig, patience, deadline)
        finally:
            lock.acquire()
            b._busy = False
            if b._queue or b._waiters:
                b._cv.notify_all()  # the worker (it saw _busy) or shutdown
        if b._queue and b._queue[0][0] is work:
            break  # deferred again: a peer is still not there
    return not b._queue and not b._busy and b._error is None and not b._closed


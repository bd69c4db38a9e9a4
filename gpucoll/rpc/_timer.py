"""The agent's timer: calls' timeouts, and the lazy sweep of replies nobody reads for.

One thread (``rpc-timer``) fails a call whose timeout passed and, every ``LAZY_WAKE``
while any is waiting, wakes the reader of a ``"soon"`` call nobody has read the reply of
and writes deferred frames (see :meth:`Timer.flush_soon`).

A call's deadline costs its sender no lock in the common case: calls with the same
timeout (most use the default) have their deadlines in the order they were sent, so each
timeout value has a queue, appended to without a lock; the timer looks only at each
queue's head. A sender takes the lock only to tell the timer about a deadline earlier
than any it waits for (its own entry became the head of a queue while the timer sleeps:
``_blind``), for a queue's first use, or to drop the entries of calls answered long
ago from a queue grown to ``_QUEUE_MAX``. Other deadlines (more than ``_QUEUES_MAX``
distinct timeouts, a full queue whose head is a call still running) go on a heap.
"""

from __future__ import annotations

import collections
import functools
import heapq
import logging
import threading
import time
from typing import Any

from ._conn import LAZY_WAKE, _Call
from ._info import RpcTimeoutError

__all__ = ["Timer"]

_log = logging.getLogger("gpucoll.rpc")

_QUEUE_MAX = 4096  # deadlines a queue holds (answered calls' included, until the timer or a sender drops them)
_QUEUES_MAX = 8  # distinct timeout values with a queue of their own


class Timer:
    """One agent's timer (``agent.timer``): it reads the agent's ``closed``, ``_pending``,
    ``_out`` and ``by_id`` and fails calls through its ``_pop`` and ``_finish``."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.heap: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.queues: dict[float, collections.deque[tuple[float, int]]] = {}
        self.blind = False  # the timer computes or sleeps on the queues' heads it saw
        # "soon" calls (sent at, id) whose replies nobody may read; connections with deferred frames
        self.lazy: collections.deque[tuple[float, Any]] = collections.deque()
        self.lazy_armed = False

    def deadline(self, timeout: float, mid: int) -> None:
        """Fail call ``mid`` (pending already) if it is still pending ``timeout`` seconds from now."""
        q = self.queues.get(timeout)
        if q is None or len(q) >= _QUEUE_MAX:
            self._deadline_locked(timeout, mid)
            return
        entry = (time.monotonic() + timeout, mid)
        q.append(entry)
        if self.blind and q and q[0] is entry:  # earlier than what the timer waits for, maybe
            with self.cv:
                self.cv.notify()

    def _deadline_locked(self, timeout: float, mid: int) -> None:
        with self.cv:
            q = self.queues.get(timeout)
            if q is None and len(self.queues) < _QUEUES_MAX:
                q = self.queues[timeout] = collections.deque()
            if q is not None:
                pending = self.agent._pending
                while q and q[0][1] not in pending:
                    q.popleft()  # answered calls
                if len(q) < _QUEUE_MAX:
                    q.append((time.monotonic() + timeout, mid))
                    self.cv.notify()
                    return
            self._push(time.monotonic() + timeout, mid)

    def _push(self, when: float, key: int) -> None:
        """Put ``key`` on the heap, holding the timer's lock: a call's id (its timeout), or
        0 (the lazy sweep)."""
        heap = self.heap
        pending = self.agent._pending
        if len(heap) > 4096 and len(heap) > 4 * len(pending):
            # Calls that completed long before their deadline: drop their entries.
            heap[:] = [e for e in heap if e[1] == 0 or e[1] in pending]
            heapq.heapify(heap)
        heapq.heappush(heap, (when, key))
        if heap[0][1] == key:
            self.cv.notify()

    def arm_lazy(self, block: bool) -> None:
        """The lazy sweep runs within LAZY_WAKE (a "soon" call or a flush is waiting).

        Without ``block`` it never waits for the timer's lock, which this very thread may
        hold (an RRef's finalizer, run by the garbage collector inside the timer's code,
        arms it through ``flush_soon``): a pool thread arms it then."""
        if not self.lock.acquire(block):
            self.agent.submit(functools.partial(self.arm_lazy, True))
            return
        try:
            if not self.lazy_armed:
                self.lazy_armed = True
                self._push(time.monotonic() + LAZY_WAKE, 0)
        finally:
            self.lock.release()

    def flush_soon(self, conn: Any, block: bool = True) -> None:
        """Write ``conn``'s deferred frames (or call its ``flush()``) within ``2 * LAZY_WAKE``
        (``block``: see :meth:`arm_lazy`)."""
        self.lazy.append((time.monotonic(), conn))
        if not self.lazy_armed:
            self.arm_lazy(block)

    def _sweep_lazy(self) -> None:
        lazy, pending, out = self.lazy, self.agent._pending, self.agent._out
        cutoff = time.monotonic() - LAZY_WAKE * 0.99
        while lazy and not isinstance(lazy[0][1], int) or lazy and lazy[0][0] <= cutoff:
            item = lazy.popleft()[1]
            if not isinstance(item, int):  # a connection, or anything else with a flush()
                try:
                    item.flush()
                except OSError:  # the connection broke: its reader says so to the calls
                    pass
                continue
            late = pending.get(item)
            conn = out.get(late.peer) if late is not None else None
            if conn is not None and conn.parked:
                conn.wake()
        # (left: nothing, or a call's id younger than LAZY_WAKE at the head)
        self.lazy_armed = False
        if lazy:  # younger ones: look again in LAZY_WAKE (a send may have re-armed already)
            self.arm_lazy(True)  # at most one sweep per LAZY_WAKE

    def loop(self) -> None:
        """The timer thread's body, until the agent closes."""
        agent, cv = self.agent, self.cv
        call: _Call | None
        while not agent.closed:
            with cv:
                self.blind = True  # (before the heads are read: see deadline())
                now = time.monotonic()
                due = []
                heap = self.heap
                while heap and heap[0][0] <= now:
                    due.append(heapq.heappop(heap)[1])
                nxt = heap[0][0] if heap else None
                pending = agent._pending
                for q in self.queues.values():
                    while q:
                        when, mid = q[0]
                        if when > now:
                            if nxt is None or when < nxt:
                                nxt = when
                            break
                        q.popleft()
                        if mid in pending:
                            due.append(mid)
                if not due:
                    cv.wait(None if nxt is None else nxt - now)
                    continue
                self.blind = False
            for mid in due:
                try:
                    if mid == 0:  # the lazy sweep: a "soon" call unread for LAZY_WAKE has its reader woken
                        self._sweep_lazy()
                        continue
                    call = agent._pop(mid)
                    if call is not None:
                        agent._finish(call.fut, None, RpcTimeoutError(
                            f"RPC ran for more than set timeout ({call.timeout * 1000:.0f} ms) and will now be "
                            f"marked with an error: {call.what} to {agent.by_id.get(call.peer, call.peer)}"))
                except Exception:  # noqa: BLE001 -- every later call's timeout needs this thread
                    _log.exception("gpucoll.rpc: the timer's %s failed",
                                   "sweep" if mid == 0 else f"timeout of call {mid}")
                    if mid == 0:  # armed again, or what is left in it would wait for a later sweep forever
                        self.lazy_armed = False
                        if self.lazy:
                            self.arm_lazy(True)
            call = None  # what the callbacks held (an RRef among them) is not kept alive by this loop

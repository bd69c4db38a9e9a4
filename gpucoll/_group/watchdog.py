"""One watchdog thread per process group: completion hooks, device-work polling, timeouts.

The thread starts on first need (an async op, a device op, a registered hook) and
is a daemon, so a forgotten group never keeps the interpreter alive. It runs on a
timer and is never woken per op (an op issued wakes nobody: waking a thread per op
made every op trade the GIL with it, tens of µs on a GPU). On each tick it:

- polls outstanding works (``Work._poll``) and device backends' queues of outstanding
  ops (``PollsPending.poll_pending``, which also asks NCCL for asynchronous errors):
  this completes device work whose end event has fired and releases the arrays it
  keeps alive (the issuing thread completes its ops too, in batches);
- calls ``on_timeout(work, backend)`` once for any op still outstanding after the
  group's timeout; the group aborts the backend and dumps its flight recorder.

The tick is a twentieth of the timeout, between 20 ms and 1 s: timeouts are seconds.
With a completion hook registered and work outstanding it polls every 5 ms (an op
tracked for a hook while the thread sleeps a whole tick wakes it, once), and it
fires the group's hooks with each finished op's WorkInfo, on this thread (never the
caller's), in completion order, as soon as an op is seen complete.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from .._backends.base import Backend, PollsPending
from .._work import Work, WorkInfo

__all__ = ["Watchdog"]

_STOP = object()
_TICK_MAX_S = 1.0   # outstanding work is looked at at least this often
_TICK_MIN_S = 0.02
_HOOK_POLL_S = 0.005  # with a hook registered, device work completes (and its hook fires) this soon


class Watchdog:
    """The watchdog of one group.

    Args:
        group_name: used for the thread's name.
        timeout: seconds an op may stay outstanding.
        on_timeout: called on the watchdog thread with ``(work, backend)`` of an op
            that timed out.
        on_hook_error: called with an exception a hook raised.
    """

    def __init__(self, group_name: str, timeout: float,
                 on_timeout: Callable[[Work, Backend], object],
                 on_hook_error: Callable[[Callable[[WorkInfo], None], BaseException], None]) -> None:
        self.group_name = group_name
        self.timeout = timeout
        self.hooks: list[Callable[[WorkInfo], None]] = []
        self._on_timeout = on_timeout
        self._on_hook_error = on_hook_error
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: list[tuple[Work, Backend, bool]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.tick = min(_TICK_MAX_S, max(_TICK_MIN_S, timeout / 20.0))
        self.ticks = 0  # times the thread looked at outstanding work (tests count them)
        # Device backends whose outstanding ops this thread watches through the backend
        # (:class:`PollsPending`) rather than op by op: nothing is recorded per op, so a
        # synchronous device op leaves no object behind for the watchdog to hold.
        self._backends: list[PollsPending] = []
        self._last_watched: PollsPending | None = None
        # The backend last watched once the thread runs: a caller that issued an op on
        # it may skip :meth:`watch_backend` (the per-op check, without a call).
        self.watched: PollsPending | None = None
        self._slow = False  # the thread sleeps for a whole tick (no hook was waiting when it looked)

    def watch_backend(self, backend: PollsPending) -> None:
        """Watch every op outstanding on device ``backend`` (a :class:`PollsPending`):
        complete them in issue order, time out the oldest. Call after each op is
        issued: it does nothing more than a comparison once the backend is watched."""
        if backend is self._last_watched and self._thread is not None:
            return
        with self._lock:
            if not any(b is backend for b in self._backends):
                self._backends = [*self._backends, backend]
            self._last_watched = backend
        self._ensure_started()
        if self._thread is not None:
            self.watched = backend

    def track(self, work: Work, backend: Backend, device: bool) -> None:
        """Watch ``work`` until it completes or times out. Device work of a backend that
        keeps its own queue of outstanding ops is watched through that queue
        (:meth:`watch_backend`), with nothing recorded per op."""
        if self._slow and self.hooks:
            # A hook waits for this op: switch the thread from its timer to hook polling
            # now (once: it stays there while a hook waits and work is outstanding).
            self._slow = False
            self._queue.put(None)
        if device:
            if backend is self._last_watched and self._thread is not None:
                return
            if isinstance(backend, PollsPending):  # once per backend: then it is _last_watched
                self.watch_backend(backend)
                return
        with self._lock:
            self._pending.append((work, backend, device))
        if self._thread is None:
            self._ensure_started()

    def completed(self, work: Work) -> None:
        """A done-callback: queue ``work`` for the hooks (runs on whichever thread finished it)."""
        self._queue.put(work)
        self._ensure_started()

    def outstanding(self) -> int:
        """Number of works still watched."""
        with self._lock:
            return len(self._pending)

    def stop(self, timeout: float = 5.0) -> None:
        """Deliver the hooks already queued, then end the thread; idempotent."""
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=f"gpucoll-watchdog-{self.group_name}",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            wait = self.tick
            self._slow = True
            if self.hooks:
                with self._lock:
                    outstanding = bool(self._pending)
                if outstanding or any(b.has_pending() for b in self._backends):
                    wait = _HOOK_POLL_S
                    self._slow = False
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            while True:
                if item is _STOP:
                    stopping = True
                elif isinstance(item, Work):
                    self._fire(item)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._poll()

    def _fire(self, work: Work) -> None:
        info = work.info()
        for hook in list(self.hooks):
            try:
                hook(info)
            except Exception as exc:  # handed to the group, which raises it at destroy time
                self._on_hook_error(hook, exc)

    def _poll(self) -> None:
        self.ticks += 1
        now = time.perf_counter()
        for polled in self._backends:
            try:
                oldest = polled.poll_pending()
            except Exception:  # a backend's own failure handling never stops the watchdog
                oldest = None
            if oldest is not None and now - oldest._t0 > self.timeout:
                self._on_timeout(oldest, polled)
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return
        finished: set[int] = set()
        # A device backend runs its ops in order on one stream: once one of its works
        # is still running, its later ones are too, and started later, so they can
        # neither be complete nor time out first. Skip them (no query each).
        running: set[int] = set()
        for work, backend, device in pending:
            if device:
                if id(backend) in running:
                    continue
            try:
                done = work._poll()
            except Exception as exc:  # a device query failed: the op failed
                work._set_exception(exc)
                done = True
            if device and not done:
                running.add(id(backend))
            if done:
                finished.add(id(work))
                if work.exception() is not None and now - work._t0 >= self.timeout:
                    self._on_timeout(work, backend)  # the backend timed out first: dump all the same
            elif now - work._t0 > self.timeout:
                self._on_timeout(work, backend)
                finished.add(id(work))
        if finished:
            with self._lock:
                self._pending = [p for p in self._pending if id(p[0]) not in finished]

"""A backend's NCCL communicator with the lock every call on it holds, and its end.

NCCL forbids concurrent calls on one communicator ("multiple threads should use
separate communicator objects"), and ``ncclCommAbort`` frees the communicator. So
every call — the issue path's NCCL calls, ``ncclCommSplit``, ``ncclCommShrink``, the
asynchronous-error query, ``ncclCommAbort``, ``ncclCommDestroy`` — holds
:attr:`CommSlot.lock`; an abort that finds the lock held (another thread is inside a
call) is left to that thread, which carries it out as soon as its calls return
(phases.on_comm); the asynchronous-error query skips a turn rather than wait.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .protocols import Comm, Runtime
from .runtime import enter_device, leave_device

__all__ = ["CommSlot"]


class CommSlot:
    """One backend's communicator (None until it is created), its lock, and whether it
    is gone (aborted or destroyed: no call may touch it again)."""

    __slots__ = ("comm", "lock", "gone")

    def __init__(self) -> None:
        self.comm: Comm | None = None
        self.lock = threading.Lock()
        self.gone = False

    def put(self, comm: Comm) -> None:
        """Hold ``comm``, the backend's new communicator (once: the slot is empty)."""
        assert self.comm is None and not self.gone
        self.comm = comm

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``, a call (or a group of calls) on the communicator, under the lock.

        Raises:
            RuntimeError: the communicator is gone.
        """
        with self.lock:
            if self.gone:
                raise RuntimeError("the communicator is gone")
            fn(*args)

    def async_error(self) -> tuple[int, str] | None:
        """NCCL's asynchronous error as (code, detail), or None: none, no communicator,
        or a call in flight on another thread (ask again later: this never blocks)."""
        comm = self.comm
        if comm is None or not self.lock.acquire(blocking=False):
            return None
        try:
            if self.gone:
                return None
            try:
                code = comm.async_error()
            except Exception as exc:
                return -1, str(exc)
            if code in (0, 7):  # ncclSuccess, ncclInProgress
                return None
            return code, comm.last_error()
        finally:
            self.lock.release()

    def abort(self, rt: Runtime, device: int, *, blocking: bool) -> str | None:
        """``ncclCommAbort`` once, on ``device``. Not blocking: when another thread is
        inside a call, leave the abort to it. Returns why NCCL's abort failed, or None."""
        comm = self.comm
        if comm is None or self.gone or not self.lock.acquire(blocking=blocking):
            return None
        try:
            if self.gone:
                return None
            self.gone = True
            try:
                prev = enter_device(rt, device)
                try:
                    comm.abort()
                finally:
                    leave_device(rt, prev)
            except Exception as exc:
                return f"ncclCommAbort failed: {exc}"
            return None
        finally:
            self.lock.release()

    def take(self) -> Any:
        """Mark the communicator gone and hand it over, for the ``ncclCommDestroy`` the
        caller makes once no op is running (lifecycle.shutdown, on a thread of its own):
        no call reaches it through the slot again."""
        with self.lock:
            self.gone = True
            return self.comm

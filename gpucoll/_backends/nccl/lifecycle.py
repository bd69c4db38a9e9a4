"""The end of a communicator: abort (from any thread), shutdown, and the asynchronous
errors that abort it. NCCLBackend's; the backend state it uses is declared here."""

from __future__ import annotations

import threading
import time
from collections import deque

from ...errors import DistBackendError
from . import lib as _nccl_lib
from .lib import Features
from .runtime import Comm, Runtime, enter_device, leave_device
from .work import NCCLWork, query_outside_capture

__all__ = ["Lifecycle"]


class Lifecycle:
    """NCCLBackend's :meth:`abort` and :meth:`shutdown`.

    One rule shapes it: NCCL forbids concurrent calls on one communicator, and
    ncclCommAbort frees it. Every call on the communicator holds ``_comm_lock``; an
    abort that finds the lock held (another thread is inside an NCCL call) is left to
    that thread, which carries it out as soon as its calls return.
    """

    _lock: threading.RLock
    _state: threading.Lock
    _comm_lock: threading.Lock
    _comm_gone: bool
    _comm: Comm | None
    _rt: Runtime
    _device: int
    _stream_ptr: int
    _timeout: float
    _group_name: str
    _features: Features
    _pending: deque[NCCLWork]
    _aborted: str | None
    _closed: str | None

    def _failure(self) -> str | None:
        reason = self._aborted
        if reason is not None:
            return reason
        comm = self._comm
        if comm is None or not self._features.async_error:
            return None
        if not self._comm_lock.acquire(blocking=False):
            return None  # a call is in flight on another thread: ask next time
        try:
            if self._comm_gone:
                return self._aborted
            try:
                code = comm.async_error()
            except Exception as exc:
                code, detail = -1, str(exc)
            else:
                if code in (0, 7):  # ncclSuccess, ncclInProgress
                    return None
                detail = comm.last_error()
        finally:
            self._comm_lock.release()
        reason = (f"NCCL reported an asynchronous error on group {self._group_name!r}: "
                  f"{_nccl_lib.result_name(code)}" + (f" ({detail})" if detail else ""))
        self.abort(reason)
        return self._aborted

    def abort(self, reason: str) -> None:
        """Abort the communicator: every pending and later op fails with
        DistBackendError naming itself and ``reason``. Returns once NCCL's abort
        returned; safe to call from any thread, more than once."""
        with self._state:
            if self._aborted is not None:
                return
            self._aborted = reason
            pending = list(self._pending)
            self._pending.clear()
        self._abort_comm(blocking=False)
        for w in pending:
            w._poll()

    def _abort_comm(self, *, blocking: bool) -> None:
        """ncclCommAbort, once. Not blocking: when another thread is inside an NCCL call
        on the communicator, leave the abort to that thread (it checks ``_aborted`` as
        soon as its calls return), rather than free the communicator under it."""
        comm = self._comm
        if comm is None or self._comm_gone:
            return
        if not self._comm_lock.acquire(blocking=blocking):
            return
        try:
            if self._comm_gone:
                return
            self._comm_gone = True
            rt = self._rt
            try:
                prev = enter_device(rt, self._device)
                try:
                    comm.abort()
                finally:
                    leave_device(rt, prev)
            except Exception as exc:
                self._aborted = f"{self._aborted} (and ncclCommAbort failed: {exc})"
        finally:
            self._comm_lock.release()

    def shutdown(self) -> None:
        """Wait (up to the timeout) for queued ops, then destroy the communicator; abort
        it instead if they do not finish. Idempotent; later ops fail."""
        with self._lock:
            if self._closed is not None:
                return
            comm = self._comm
            drained = self._aborted is None and self._drain(self._timeout)
            with self._state:
                pending = list(self._pending)
            for w in pending:
                w._poll()  # complete what finished, before the flag below fails the rest
            self._closed = f"the NCCL backend of group {self._group_name!r} was shut down"
            if comm is None or self._aborted is not None:
                return
            if not drained:
                self.abort(f"{self._closed} while ops were still running after {self._timeout:.3g} s")
                return
            try:
                with self._comm_lock:
                    self._comm_gone = True
                    comm.destroy()
            except Exception as exc:
                raise DistBackendError(f"destroying the NCCL communicator of group {self._group_name!r} "
                                       f"failed: {exc}") from exc

    def _drain(self, timeout: float) -> bool:
        """True once everything queued on the communication stream has finished."""
        if self._comm is None:
            return True
        rt, device = self._rt, self._device
        prev = enter_device(rt, device)
        try:
            marker = rt.event(pooled=False, timing=False)
            rt.record(marker.ptr, self._stream_ptr)
            deadline = time.monotonic() + timeout
            delay = 1e-4
            while not query_outside_capture(rt, marker.ptr):
                if time.monotonic() >= deadline or self._aborted is not None:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
            return True
        finally:
            leave_device(rt, prev)

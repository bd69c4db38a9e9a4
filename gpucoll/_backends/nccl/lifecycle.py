"""The end of a communicator: abort (from any thread), shutdown, and the asynchronous
errors that abort it: functions over an :class:`NCCLBackend`'s state (declared once, in
its ``__init__``), called by the backend's methods of the same names.

One rule shapes them: NCCL forbids concurrent calls on one communicator, and
ncclCommAbort frees it. Every call on the communicator holds its lock (comm.py); an
abort that finds the lock held (another thread is inside an NCCL call) is left to that thread,
which carries it out as soon as its calls return.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ..._timeouts import Backoff
from ...errors import DistBackendError
from . import lib as _nccl_lib
from .runtime import enter_device, leave_device
from .work import query_outside_capture

if TYPE_CHECKING:
    from .state import BackendState

__all__ = ["failure", "abort", "abort_comm", "shutdown", "drain"]


def failure(b: BackendState) -> str | None:
    """Why ``b`` failed (its abort reason), after asking NCCL for an asynchronous error,
    which aborts it; None while it is healthy. Never blocks on a call in flight."""
    ending = b.ending
    reason = ending.aborted
    if reason is not None:
        return reason
    if not b.features.async_error:
        return None
    error = b.comm_slot.async_error()
    if error is None:
        return ending.aborted
    code, detail = error
    reason = (f"NCCL reported an asynchronous error on group {b.group_name!r}: "
              f"{_nccl_lib.result_name(code)}" + (f" ({detail})" if detail else ""))
    abort(b, reason)
    return ending.aborted


def abort(b: BackendState, reason: str) -> None:
    """Abort the communicator: every pending and later op fails with
    DistBackendError naming itself and ``reason``. Returns once NCCL's abort
    returned; safe to call from any thread, more than once."""
    pending = b.ending.abort(reason)
    if pending is None:
        return
    abort_comm(b, blocking=False)
    for w in pending:
        w.poll()


def abort_comm(b: BackendState, *, blocking: bool) -> None:
    """ncclCommAbort, once. Not blocking: when another thread is inside an NCCL call
    on the communicator, leave the abort to that thread (it checks ``ending.aborted``
    as soon as its calls return), rather than free the communicator under it."""
    why = b.comm_slot.abort(b.runtime, b.device_index, blocking=blocking)
    if why is not None:
        b.ending.add_reason(why)


def shutdown(b: BackendState) -> None:
    """Wait (up to the timeout) for queued ops, then destroy the communicator; abort
    it instead if they do not finish. Idempotent; later ops fail."""
    ending, timeout, name = b.ending, b.timeout, b.group_name
    with b.issue_lock:
        if ending.closed is not None:
            return
        comm = b.comm_slot.comm
        drained = ending.aborted is None and drain(b, timeout)
        for w in b.outstanding.snapshot():
            w.poll()  # complete what finished, before the flag below fails the rest
        closed = f"the NCCL backend of group {name!r} was shut down"
        ending.close(closed)
        if comm is None or ending.aborted is not None:
            return
        if not drained:
            abort(b, f"{closed} while ops were still running after {timeout:.3g} s")
            return
        comm = b.comm_slot.take()
        # ncclCommDestroy runs on a thread of its own, and this one waits for it a bounded
        # time. NCCL's teardown (commDestroySync in its src/init.cc, reached from
        # ncclCommDestroy and ncclCommAbort alike) has waits of its own that no timeout
        # bounds: it polls "until all graphs referencing us die", and it stops the proxy,
        # which talks to the peers' proxies (on an H200 a rank whose peer had aborted and
        # exited was still tearing down after 40 s: docs/gpu-verification.md).
        release = _Release(comm)
        release.start(f"gpucoll-nccl-destroy-{name}")
        if b.comm_stream.captured and b.size > 1:
            # The caller may hold a graph that captured an op of this communicator for
            # as long as it likes: do not wait at all. NCCL frees the communicator once
            # the last such graph is gone (a one-rank communicator makes no such graph).
            return
        bound = min(timeout, DESTROY_WAIT_S)
        if not release.done.wait(bound):
            raise DistBackendError(
                f"destroying the NCCL communicator of group {name!r}: ncclCommDestroy did not "
                f"return within {bound:.3g} s (NCCL's teardown waits for its peers' proxies and for "
                "every CUDA graph that captured the communicator); the group is shut down, and the "
                "destroy goes on in the background")
        if release.error is not None:
            raise DistBackendError(f"destroying the NCCL communicator of group {name!r} "
                                   f"failed: {release.error}") from release.error


DESTROY_WAIT_S = 10.0  # the longest shutdown() waits for ncclCommDestroy


class _Release:
    """ncclCommDestroy of a shut-down communicator, on a daemon thread of its own."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.done = threading.Event()
        self.error: Exception | None = None

    def start(self, name: str) -> None:
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self._comm.destroy()
        except Exception as exc:  # read by shutdown() if it still waits; else nobody is left to tell
            self.error = exc
        finally:
            self.done.set()


def drain(b: BackendState, timeout: float) -> bool:
    """True once everything queued on the communication stream, and every op issued on
    a caller's stream, has finished."""
    if b.comm_slot.comm is None:
        return True
    rt, device = b.runtime, b.device_index
    prev = enter_device(rt, device)
    try:
        marker = rt.event(pooled=False, timing=False)
        rt.record(marker.ptr, b.comm_stream.ptr)
        wait = Backoff(timeout, first=1e-4, cap=0.01)
        ending = b.ending
        while not (query_outside_capture(rt, marker.ptr) and b.complete_until(None) is None):
            if ending.aborted is not None or not wait.sleep():
                return False
        return ending.aborted is None
    finally:
        leave_device(rt, prev)

"""Ungrouped sends and receives, posted: :class:`Posted`, the NCCL backend's part that
holds them until they are issued as one NCCL group.

``ncclSend`` and ``ncclRecv`` are "blocking for the GPU" (nccl.h): each may wait on the
device for its match, and sends and receives that must progress together have to be
fused in one group. Two ranks that each isend, then irecv, and wait would put
send-then-receive on both communication streams: a deadlock, or, as an H200 showed with
NCCL 2.32.3 (two ranks on one GPU), a receive that completes with its array unwritten.
So an ungrouped send or receive is posted: its Work, and an event recorded on its
caller's stream (the op is ordered after what the caller queued before posting it,
whichever thread issues it). The ops posted in a row are issued as one NCCL group, as
batch_isend_irecv's are, by the first of: the backend's next other op, ``wait()`` /
``is_completed()`` / ``synchronize()`` of any of their Works, the watchdog's next tick,
shutdown. A capture, or a backend without a communicator yet, issues at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..._buffer import Buffer
from .issuing import caller_streams, check_devices, new_work
from .runtime import enter_device, leave_device
from .work import NCCLWork

if TYPE_CHECKING:
    from .state import BackendState

__all__ = ["Posted"]

# issue(op_type, bufs, build, works=..., readies=...): the backend's general issue path.
Issue = Callable[..., NCCLWork]


class Posted:
    """The sends and receives posted and not issued yet, in order: (kind, Buffer, peer,
    Work, the event recorded on the caller's stream). ``ops`` is read per op by the
    backend's issue path (empty: nothing to issue first); it changes only here."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[str, Buffer, int, NCCLWork, Any]] = []

    def post(self, b: BackendState, kind: str, buf: Buffer, peer: int, flush: Callable[[], None]) -> NCCLWork | None:
        """Post ``kind`` ("send"/"recv") of ``buf`` with ``peer``: its Work, whose every
        look calls ``flush`` first; None, having done nothing, where it must be issued
        at once (a capturing stream, no communicator yet, the backend ended)."""
        rt = b.runtime
        with b.issue_lock:
            if b.ending.over is not None or b.comm_slot.comm is None:
                return None
            check_devices(b.device_index, b.group_name, kind, (buf,))
            device = b.device_index
            prev = -1 if rt.get_device() == device else enter_device(rt, device)
            try:
                callers = caller_streams(rt, (buf,))
                if any(rt.is_capturing(s) for s in callers):
                    return None
                work = new_work(b, kind, (buf,), b.timeout)
                ready = rt.event(pooled=True, timing=False)
                for s in callers:
                    rt.record(ready.ptr, s)
            finally:
                leave_device(rt, prev)
            work.keep_also([ready])
            work.post(flush)
            self.ops.append((kind, buf, peer, work, ready))
        return work

    def flush(self, b: BackendState, issue: Issue) -> None:
        """Issue what was posted as one NCCL group (one call, where one op was posted)
        through ``issue``; their Works complete together."""
        if not self.ops:
            return  # (no lock taken: the watchdog calls this on every tick)
        with b.issue_lock:
            posted, self.ops = self.ops, []
            if not posted:
                return
            ops = [(kind, buf, peer) for kind, buf, peer, _, _ in posted]
            bufs: Sequence[Buffer] = [buf for _, buf, _ in ops]
            try:
                issue(posted[0][0] if len(posted) == 1 else "batch_isend_irecv", bufs, lambda p: p.p2p(ops),
                      works=[w for *_, w, _ in posted], readies=[r for *_, r in posted])
            finally:
                # Only now: a thread that looks at one of these Works meanwhile finds it
                # posted, calls flush, and waits on the lock until it has been issued.
                for *_, work, _ in posted:
                    work.post(None)

    def flush_quietly(self, b: BackendState, issue: Issue) -> None:
        """:meth:`flush` where nobody can take an error (the watchdog, shutdown): a
        failure fails the posted Works, and is raised where they are waited for."""
        posted = list(self.ops)
        try:
            self.flush(b, issue)
        except Exception as exc:  # noqa: BLE001  (the Works carry it)
            for *_, work, _ in posted:
                work.fail(f"issuing it failed: {type(exc).__name__}: {exc}")

    def fail(self, reason: str) -> None:
        """Fail what was posted (the backend is aborted or shrunk: it will never be
        issued). Takes no lock: an abort never waits for the issue path."""
        posted, self.ops = self.ops, []
        for *_, work, _ in posted:
            work.post(None)
            work.fail(reason)

"""The Backend protocol: what a ProcessGroup asks of the CPU and NCCL backends.

Beside :class:`Backend`, which every backend implements, each optional capability
is a Protocol of its own; the group and its watchdog check for it once (with
``isinstance``, when a backend is made or first watched) and are typed against it:

- :class:`SplitsCommunicator`: new groups carved out of this one (``ncclCommSplit``);
- :class:`ReducesInto`: out-of-place all_reduce in one op;
- :class:`PollsPending`: the backend keeps its own queue of outstanding ops, which
  the watchdog polls instead of tracking each op;
- :class:`ShrinksCommunicator`: the backend of a smaller group carved out of this
  one after ranks failed (``ncclCommShrink``), used by ``shrink_group``.

A later capability is one more Protocol here and one ``isinstance`` where the group
uses the backend.

Rules every backend follows (ProcessGroup relies on them):

- Ranks are *group* ranks, 0..size-1. The ProcessGroup has already validated
  arguments that it can check locally (ranks in range, shapes/dtypes of output
  lists consistent with the input, split sizes summing right, writable outputs).
- Every op returns a :class:`~gpucoll._work.Work` at once (it may run in the
  background) and completes it exactly once. Ops are issued in the same order on
  every rank of a group and the backend runs them in issue order.
- Buffers are contiguous (see ``gpucoll._buffer``). Outputs may alias inputs
  only where the op is in-place by definition (``all_reduce``, ``broadcast``,
  ``reduce``) or where the caller passed the same buffer (in-place all_gather:
  input is the rank's slice of the output).
- A failure (peer died, timeout, mismatch detected, abort) completes the Work with
  a ``DistBackendError`` naming the op; after ``abort`` every pending and later op
  fails the same way. Nothing hangs past the backend's timeout.
- ``op`` is a validated ``ReduceOp`` or ``PremulSum`` (never bare PREMUL_SUM).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from .._buffer import Buffer
from .._reduce_op import ReduceOpLike
from .._work import Work
from ..store.base import Store

ISSUING_ASYNC = threading.local()
"""Set (``on``) on the issuing thread while a backend method starts an op its caller asked
``async_op=True`` for: a backend that runs small ops on the caller's thread must not let
such an op wait there for its peers (torch's async ops return at once)."""


def issuing_async() -> bool:
    """Whether the op being started on this thread is an ``async_op=True`` one."""
    return getattr(ISSUING_ASYNC, "on", False)

__all__ = ["Backend", "SplitsCommunicator", "RegistersBuffers", "ReducesInto", "ReducesGathered", "PollsPending", "IssuesQuietly", "ShrinksCommunicator", "KnowsDeadPeers",
           "TimesOps"]


@runtime_checkable
class Backend(Protocol):
    """One group's collectives on one kind of memory."""

    name: str  # "cpu" or "nccl"
    rank: int  # this process's rank in the group
    size: int  # the group's size

    # --- reductions ---
    def all_reduce(self, buf: Buffer, op: ReduceOpLike) -> Work: ...
    def all_reduce_coalesced(self, bufs: Sequence[Buffer], op: ReduceOpLike) -> Work: ...
    def reduce(self, buf: Buffer, dst: int, op: ReduceOpLike) -> Work: ...
    def reduce_scatter(self, out: Buffer, inputs: Sequence[Buffer], op: ReduceOpLike) -> Work:
        """``inputs`` has ``size`` buffers, each shaped like ``out``."""
        ...
    def reduce_scatter_single(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        """``inp`` holds ``size`` consecutive chunks of ``out.nbytes``."""
        ...

    # --- data movement ---
    def broadcast(self, buf: Buffer, src: int) -> Work: ...
    def all_gather(self, outs: Sequence[Buffer], inp: Buffer) -> Work:
        """``outs`` has ``size`` buffers, each shaped like ``inp``."""
        ...
    def all_gather_single(self, out: Buffer, inp: Buffer) -> Work:
        """``out`` is ``size`` consecutive chunks of ``inp.nbytes``."""
        ...
    def all_gather_coalesced(self, outs: Sequence[Sequence[Buffer]], inps: Sequence[Buffer]) -> Work:
        """``outs[k]`` are input k's outputs in rank order (the ProcessGroup transposes
        torch's ``output_tensor_lists[rank][k]``)."""
        ...
    def gather(self, outs: Sequence[Buffer] | None, inp: Buffer, dst: int) -> Work:
        """``outs`` is given (``size`` buffers) on ``dst`` only."""
        ...
    def scatter(self, out: Buffer, inputs: Sequence[Buffer] | None, src: int) -> Work:
        """``inputs`` is given (``size`` buffers) on ``src`` only."""
        ...
    def all_to_all(self, outs: Sequence[Buffer], inputs: Sequence[Buffer]) -> Work: ...
    def all_to_all_single(self, out: Buffer, inp: Buffer,
                          out_counts: Sequence[int], in_counts: Sequence[int]) -> Work:
        """Counts are in *elements* per peer (``size`` entries each); chunks are
        consecutive in rank order."""
        ...

    # --- point to point ---
    def send(self, buf: Buffer, dst: int, tag: int) -> Work: ...
    def recv(self, buf: Buffer, src: int | None, tag: int) -> Work:
        """``src=None`` receives from any source; the Work's source_rank() says who."""
        ...
    def batch_p2p(self, ops: Sequence[tuple[str, Buffer, int, int]]) -> Work:
        """``(kind, buf, peer, tag)`` with kind "send" or "recv"; all posted together
        (NCCL: one group call), one Work for the batch."""
        ...

    # --- control ---
    def barrier(self) -> Work: ...
    def abort(self, reason: str) -> None:
        """Fail every pending and later op with ``DistBackendError(reason)``; returns at once."""
        ...
    def shutdown(self) -> None:
        """Release connections/communicators after the group is done; idempotent."""
        ...


@runtime_checkable
class SplitsCommunicator(Protocol):
    """A backend that makes the backends of new groups out of its own communicator."""

    @property
    def can_split(self) -> bool:
        """True when :meth:`split` can be used now (it may depend on runtime state)."""
        ...

    def split(self, ranks: Sequence[int] | None, *, color: int = 0, store: Store, group_name: str,
              timeout: float, config: Mapping[str, Any] | None = None,
              high_priority: bool = False) -> Backend | None:
        """Collective over this backend's group (every rank calls, in the same order):
        the new group's backend on its members (``ranks``, as ranks of this group),
        None on a rank that joins no new group. ``config``/``high_priority``: the new
        group's NCCLOptions (ncclConfig_t fields by name; stream priority)."""
        ...


@runtime_checkable
class RegistersBuffers(Protocol):
    """A backend that registers device memory with its communicator (NCCL's
    ncclCommRegister and, for symmetric windows, ncclCommWindowRegister)."""

    def register_buffer(self, buf: Buffer, symmetric: bool) -> int:
        """Register ``buf``; a handle for :meth:`deregister_buffer`. ``symmetric``: a
        window, collective over the group (every rank calls, same size).

        Raises:
            RegistrationError: a condition of NCCL's is not met, or NCCL refused.
        """
        ...

    def deregister_buffer(self, handle: int, symmetric: bool) -> None:
        """Undo :meth:`register_buffer` (collective for a window)."""
        ...


@runtime_checkable
class ReducesInto(Protocol):
    """A backend that all-reduces out of place in one op."""

    def all_reduce_into(self, out: Buffer, inp: Buffer, op: ReduceOpLike) -> Work:
        """``out`` = the reduction of every rank's ``inp``; ``inp`` is left alone."""
        ...


class ReducesGathered(Protocol):
    """A backend that all-reduces an input assembled from several arrays, each divided
    on the way in, without a pass of its own over the memory first (the CPU backend)."""

    def all_reduce_gathered(self, out: Buffer, parts: Sequence[Any], divisor: int, op: ReduceOpLike) -> Work:
        """``out`` = the reduction of every rank's concatenation of ``parts`` (1-D host
        arrays, ``out.numel`` elements in all), each element divided by ``divisor`` first:
        the collective ``all_reduce(out, op)`` of that divided concatenation, which a peer
        may issue instead (same signature)."""
        ...

    def all_reduce_gathered_now(self, out: Buffer, parts: Sequence[Any], divisor: int, op: ReduceOpLike, *,
                                async_op: bool = False) -> bool | Work:
        """:meth:`all_reduce_gathered` on this thread now with no Work (as ``RunsNow``'s ops:
        True when it ran, False when ops are queued ahead of a synchronous one, an async
        one's Work when it went on in the backend)."""
        ...


@runtime_checkable
class TimesOps(Protocol):
    """A device backend whose ops are timed only when asked: events with timing cost more
    to record and query, so they are made only once a completion hook reads
    ``active_duration``."""

    def time_ops(self) -> None:
        """Record later ops' events with timing."""
        ...


@runtime_checkable
class RunsNow(Protocol):
    """A backend that can run a small synchronous op on the caller's thread without a
    Work (the group's lean path, used when no hook needs one)."""

    inline_max: int
    """An ``async_op=True`` op whose buffers total at most this many bytes may run through
    the Work-less path too, called with ``async_op=True``; larger async ops go through the
    Work path."""

    def all_reduce_now(self, buf: Buffer, op: ReduceOpLike, *, async_op: bool = False) -> bool | Work:
        """All-reduce ``buf`` now and return True; False (nothing done) when other ops are
        queued ahead of it or it is too large to run inline. ``async_op=True``: the op must
        not wait for peers on this thread: True when it completed here, else the Work the
        backend completes (it finishes the op off this thread, or after the ops queued
        ahead of it); never False.

        Raises:
            DistBackendError: the op failed (the backend is then aborted, as for a Work).
        """
        ...

    def barrier_now(self) -> bool:
        """A barrier now (True), or False as :meth:`all_reduce_now`."""
        ...

    def all_reduce_runner(self, dtype: str, nbytes: int, op: ReduceOpLike) -> tuple[Callable[..., bool | Work], Any] | None:
        """:meth:`all_reduce_now` of one kind the backend planned already, bound:
        ``(run, reducer)``, ``run(flat_array, reducer)`` taking a 1-D NumPy view of the
        caller's array (and ``async_op=`` as :meth:`all_reduce_now`); None when the kind is
        not planned (yet)."""
        ...

    def broadcast_now(self, buf: Buffer, src: int, *, async_op: bool = False) -> bool | Work:
        """Broadcast ``buf`` from group rank ``src`` now (True), or False as :meth:`all_reduce_now`."""
        ...

    def all_gather_single_now(self, out: Buffer, inp: Buffer, *, async_op: bool = False) -> bool | Work:
        """All-gather ``inp`` into ``out`` now (True), or False as :meth:`all_reduce_now`."""
        ...

    def all_gather_runner(self, out: Any, inp: Any) -> Callable[..., bool | Work]:
        """:meth:`all_gather_single_now` bound to two 1-D host arrays the caller keeps and
        reuses: ``run()`` returns True when it ran, False as :meth:`all_reduce_now`."""
        ...


@runtime_checkable
class PollsPending(Backend, Protocol):
    """A backend that keeps its outstanding ops in issue order and lets the group's
    watchdog complete them, so that nothing is recorded per op."""

    def has_pending(self) -> bool:
        """True while ops may still be outstanding (cheap; polled by the watchdog)."""
        ...

    def poll_pending(self) -> Work | None:
        """Complete the finished ops in issue order; the oldest still running (None
        when none is). Never raises."""
        ...


@runtime_checkable
class IssuesQuietly(Protocol):
    """A device backend that issues a synchronous op with no Work: the caller's stream
    waits for the op, and the backend's queue of outstanding ops (:class:`PollsPending`)
    holds its record (sequence number, group, flight-recorder entry) until it completes
    (the group's lean path when no completion hook needs a Work)."""

    def all_reduce_quiet(self, buf: Buffer, op: ReduceOpLike, seq: int, entry: Any, group_name: str) -> bool:
        """Issue ``all_reduce(buf, op)`` so, and return True; False, having done nothing,
        when it must be issued the usual way (a Work)."""
        ...

    def broadcast_quiet(self, buf: Buffer, src: int, seq: int, entry: Any, group_name: str) -> bool:
        """``broadcast(buf, src)`` as :meth:`all_reduce_quiet`."""
        ...


@runtime_checkable
class ShrinksCommunicator(Protocol):
    """A backend that makes the backend of a smaller group out of its own communicator
    after some of its ranks failed (``ncclCommShrink``, NCCL >= 2.27)."""

    @property
    def can_shrink(self) -> bool:
        """True when :meth:`shrink` can be used now."""
        ...

    def shrink(self, exclude: Sequence[int], *, store: Store, group_name: str, timeout: float,
               config: Mapping[str, Any] | None = None, high_priority: bool = False) -> Backend:
        """Collective over this backend's remaining ranks (every rank not in ``exclude``
        calls, each with the same ``exclude``): abort this communicator's pending ops and
        return the new group's backend, its ranks renumbered in order. This backend is
        shut down by the caller afterwards.

        Raises:
            DistBackendError: the shrink failed.
        """
        ...


@runtime_checkable
class KnowsDeadPeers(Protocol):
    """A backend that can tell a peer that died (its connection broke without a goodbye)
    from one that left after an error; ``shrink_group`` uses it where the job's launcher
    records deaths (:mod:`gpucoll._backends.deaths`)."""

    def peer_gone(self, peer: int) -> str | None:
        """Why group rank ``peer`` died, or None when it is not known to have died."""
        ...

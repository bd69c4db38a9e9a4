"""NCCL's first calls, bounded: a check-in through the group's store before the first
collective (every rank) and before the first send/recv with each peer (that peer).

NCCL connects inside those calls and blocks the calling thread until the peers call
in, with no timeout of its own (NCCL's docs, "Communicator" and ncclCommInitRank:
connections are set up lazily, at the first operation): a peer that never arrives
would hang the issuing thread inside NCCL, where no watchdog can see it, since a Work
joins the watchdog only once its call returned. The check-in waits at most the
group's timeout, and a missing peer aborts the communicator, naming the peer.
"""

from __future__ import annotations

from typing import Protocol

from ...errors import DistBackendError, DistStoreError
from ...store.base import Store
from .plan import Plan

__all__ = ["check_in"]


class _Backend(Protocol):
    rank: int
    size: int
    _store: Store
    _timeout: float
    _group_name: str
    _connected: bool
    _p2p_peers: set[int]

    def abort(self, reason: str) -> None: ...


def check_in(backend: _Backend, op_type: str, plan: Plan) -> None:
    """Wait (up to the group's timeout) until the peers that ``plan``'s NCCL calls
    connect to have checked in too; nothing once they all have.

    Raises:
        DistBackendError: a peer did not check in in time (the communicator is aborted).
    """
    coll = False
    peers: set[int] = set()
    for _, calls, _ in plan:
        for step in calls:
            if step[0] == "send" or step[0] == "recv":
                peers.add(step[4])
            else:
                coll = True
    coll = coll and not backend._connected
    peers -= backend._p2p_peers
    if not coll and not peers:
        return
    store, rank = backend._store, backend.rank
    want: list[str] = []
    if coll:
        store.set(f"nccl/connect/all/{rank}", b"1")
        want += [f"nccl/connect/all/{r}" for r in range(backend.size)]
    for p in sorted(peers):
        lo, hi = min(p, rank), max(p, rank)
        store.set(f"nccl/connect/p2p/{lo}-{hi}/{rank}", b"1")
        want.append(f"nccl/connect/p2p/{lo}-{hi}/{p}")
    try:
        store.wait(want, timeout=backend._timeout)
    except DistStoreError as exc:
        try:
            missing = sorted({int(k.rsplit("/", 1)[1]) for k in want if not store.check(k)})
        except DistStoreError:
            missing = []
        what = "its first collective" if coll else "its first send/recv with this rank"
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
               if missing else "some rank")
        reason = (f"{op_type}: {who} of group {backend._group_name!r} did not call {what} within "
                  f"{backend._timeout:.3g} s (NCCL connects there, blocking the caller until every "
                  f"peer arrives)")
        backend.abort(reason)
        raise DistBackendError(f"{op_type} on group {backend._group_name!r} (rank {rank}) failed: "
                               f"{reason}") from exc
    backend._connected = backend._connected or coll
    backend._p2p_peers |= peers


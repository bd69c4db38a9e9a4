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

from typing import Callable

from ...errors import DistBackendError, DistStoreError
from ...store.base import Store
from .plan import Plan

__all__ = ["CheckIn"]


class CheckIn:
    """Which peers a backend's communicator has checked in with: all of them (before
    the first collective), and each peer of a send/recv so far."""

    __slots__ = ("everyone", "peers")

    def __init__(self) -> None:
        self.everyone = False          # read-only outside this class
        self.peers: set[int] = set()   # read-only outside this class

    def needed(self, plan: Plan) -> bool:
        """Whether ``plan``'s NCCL calls connect to a peer not checked in yet (no set is
        built for a plain collective once everyone checked in)."""
        if not self.everyone:
            return True
        peers = self.peers
        for _, calls, _ in plan:
            for step in calls:
                if (step[0] == "send" or step[0] == "recv") and step[4] not in peers:
                    return True
        return False

    def check_in(self, op_type: str, plan: Plan, *, store: Store, rank: int, size: int, timeout: float,
                 group_name: str, abort: Callable[[str], None]) -> None:
        """Wait (up to ``timeout``) until the peers that ``plan``'s NCCL calls connect to
        have checked in through the group's ``store`` too; nothing once they all have.

        Raises:
            DistBackendError: a peer did not check in in time (``abort`` was called).
        """
        coll = False
        peers: set[int] = set()
        for _, calls, _ in plan:
            for step in calls:
                if step[0] == "send" or step[0] == "recv":
                    peers.add(step[4])
                else:
                    coll = True
        coll = coll and not self.everyone
        peers -= self.peers
        if not coll and not peers:
            return
        want: list[str] = []
        if coll:
            store.set(f"nccl/connect/all/{rank}", b"1")
            want += [f"nccl/connect/all/{r}" for r in range(size)]
        for p in sorted(peers):
            lo, hi = min(p, rank), max(p, rank)
            store.set(f"nccl/connect/p2p/{lo}-{hi}/{rank}", b"1")
            want.append(f"nccl/connect/p2p/{lo}-{hi}/{p}")
        try:
            store.wait(want, timeout=timeout)
        except DistStoreError as exc:
            try:
                missing = sorted({int(k.rsplit("/", 1)[1]) for k in want if not store.check(k)})
            except DistStoreError:
                missing = []
            what = "its first collective" if coll else "its first send/recv with this rank"
            who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
                   if missing else "some rank")
            reason = (f"{op_type}: {who} of group {group_name!r} did not call {what} within "
                      f"{timeout:.3g} s (NCCL connects there, blocking the caller until every "
                      f"peer arrives)")
            abort(reason)
            raise DistBackendError(f"{op_type} on group {group_name!r} (rank {rank}) failed: "
                                   f"{reason}") from exc
        self.everyone = self.everyone or coll
        self.peers |= peers

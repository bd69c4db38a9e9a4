"""monitored_barrier: a barrier through the store that names the ranks that did not arrive."""

from __future__ import annotations

import time
from typing import Callable

from ..errors import DistBackendError, DistStoreTimeoutError
from ..store import Store

__all__ = ["monitored_barrier"]


_SLICE = 0.1  # seconds between checks of whether a peer is already known dead


def _wait_for(store: Store, key: str, peer: int, deadline: float, gone: Callable[[int], str | None]) -> str | None:
    """Wait for ``key``; None once it exists, else why not (``peer`` dead, or the deadline)."""
    while True:
        why = gone(peer)
        if why is not None and not store.check([key]):
            return f"rank {peer} {why}"
        left = deadline - time.monotonic()
        if left <= 0:
            return None if store.check([key]) else "timeout"
        try:
            store.wait([key], min(_SLICE, left))
            return None
        except DistStoreTimeoutError:
            continue


def monitored_barrier(store: Store, rank: int, size: int, seq: int, group_name: str, timeout: float,
                      wait_all_ranks: bool, last_release: str | None,
                      gone: Callable[[int], str | None] = lambda peer: None) -> str | None:
    """Run monitored barrier number ``seq`` of group ``group_name`` through ``store``.

    Rank 0 waits up to ``timeout`` for every rank's arrival key, then releases the
    others with "ok" or with the list of missing ranks (so every rank that is still
    alive raises the same error). A rank that ``gone`` reports dead (the group's
    transport saw it die) counts as missing at once, not after the timeout.

    Returns:
        The release key a later barrier deletes (rank 0 only; ``last_release`` elsewhere).

    Raises:
        DistBackendError: some ranks did not arrive in time (named in the message).
    """
    prefix = f"monitored_barrier/{seq}"
    what = f"monitored_barrier (seq {seq}) on group {group_name!r}"
    store.set(f"{prefix}/arrived/{rank}", b"1")
    if rank == 0:
        deadline = time.monotonic() + timeout
        missing: list[int] = []
        notes: list[str] = []
        for r in range(1, size):
            why = _wait_for(store, f"{prefix}/arrived/{r}", r, deadline, gone)
            if why is not None:
                missing.append(r)
                if why != "timeout":
                    notes.append(why)
                if not wait_all_ranks:
                    break
        verdict = "ok" if not missing else ",".join(map(str, missing))
        store.set(f"{prefix}/released", verdict.encode())
        if not missing:
            # Everyone arrived, so everyone has read the previous barrier's release key.
            for r in range(size):
                store.delete_key(f"{prefix}/arrived/{r}")
            if last_release is not None:
                store.delete_key(last_release)
            last_release = f"{prefix}/released"
    else:
        why = _wait_for(store, f"{prefix}/released", 0, time.monotonic() + timeout + 2.0, gone)
        if why is not None:
            cause = "rank 0 may be dead or stuck" if why == "timeout" else why
            raise DistBackendError(f"{_reached(rank)}: {what}: rank 0 did not release the barrier within "
                                   f"{timeout:g} s ({cause})")
        verdict = store.get(f"{prefix}/released").decode()
        notes = []
    if verdict != "ok":
        ranks = [int(r) for r in verdict.split(",")]
        scope = "ranks that did not arrive" if wait_all_ranks else "first rank that did not arrive"
        detail = (f"{what}: {scope} within {timeout:g} s: {ranks}"
                  f"{'' if wait_all_ranks else ' (pass wait_all_ranks=True to list all)'}"
                  + (f" ({'; '.join(notes)})" if notes else ""))
        raise DistBackendError(f"{_failed(ranks, timeout) if rank == 0 else _reached(rank)}: {detail}")
    return last_release


# torch's (gloo's) words lead each message, as torch's tests match them; gpucoll's detail follows.

def _failed(ranks: list[int], timeout: float) -> str:
    """Rank 0's message: who failed to arrive (or, with no time at all, that rank 0 timed out)."""
    ms = int(timeout * 1000)
    if timeout <= 0:
        return f"Rank 0 timed out in monitoredBarrier after {ms} ms"
    if len(ranks) == 1:
        return f"Rank {ranks[0]} failed to pass monitoredBarrier in {ms} ms"
    return f"Ranks {', '.join(map(str, ranks))} failed to pass monitoredBarrier in {ms} ms"


def _reached(rank: int) -> str:
    """A rank other than 0: it arrived, but the barrier failed."""
    return (f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0")

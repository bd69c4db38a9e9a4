"""monitored_barrier: a barrier through the store that names the ranks that did not arrive."""

from __future__ import annotations

import time

from ..errors import DistBackendError
from ..store import Store

__all__ = ["monitored_barrier"]


def monitored_barrier(store: Store, rank: int, size: int, seq: int, group_name: str, timeout: float,
                      wait_all_ranks: bool, last_release: str | None) -> str | None:
    """Run monitored barrier number ``seq`` of group ``group_name`` through ``store``.

    Rank 0 waits up to ``timeout`` for every rank's arrival key, then releases the
    others with "ok" or with the list of missing ranks (so every rank that is still
    alive raises the same error).

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
        for r in range(1, size):
            key = f"{prefix}/arrived/{r}"
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    if not store.check([key]):
                        raise TimeoutError
                else:
                    store.wait([key], left)
            except Exception:
                missing.append(r)
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
        try:
            verdict = store.get(f"{prefix}/released", timeout=timeout + 2.0).decode()
        except Exception as exc:
            raise DistBackendError(f"{what}: rank 0 did not release the barrier within {timeout:g} s "
                                   f"(rank 0 may be dead or stuck)") from exc
    if verdict != "ok":
        ranks = [int(r) for r in verdict.split(",")]
        scope = "ranks that did not arrive" if wait_all_ranks else "first rank that did not arrive"
        raise DistBackendError(f"{what}: {scope} within {timeout:g} s: {ranks}"
                               f"{'' if wait_all_ranks else ' (pass wait_all_ranks=True to list all)'}")
    return last_release

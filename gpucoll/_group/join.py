"""Start-up head count: every rank learns how many of ``world_size`` processes joined.

A wrong ``WORLD_SIZE`` (3 with 2 processes started) must give the same message on
every rank, and soon: each rank adds itself to a counter in the job's store and
waits (parked on the store) until the counter reaches ``world_size``, saying on
stderr after :data:`NOTICE_AFTER` seconds who is missing, and raising on every rank
at the timeout. When the rank hosting the store gives up first, the others lose their
connection; they report the head count they last saw instead of a bare
"connection lost".
"""

from __future__ import annotations

import sys
import time

from ..errors import DistError, DistStoreTimeoutError
from ..store.base import Store

__all__ = ["await_all_joined", "next_generation", "JOIN_KEY", "NOTICE_AFTER"]

JOIN_KEY = "gpucoll/init/joined"
NOTICE_AFTER = 10.0
"""Seconds of waiting before a rank says on stderr that processes are missing."""


def _message(joined: int, world_size: int, waited: float) -> str:
    return (f"only {joined} of world_size={world_size} processes joined within {waited:g} s. "
            f"Check that WORLD_SIZE={world_size} is the number of processes started (gpucoll-run "
            "--nproc-per-node, torchrun, srun -n, mpirun -np) and that every one reaches "
            "init_process_group; a smaller timeout= makes this error come sooner")


def await_all_joined(store: Store, rank: int, world_size: int, timeout: float) -> None:
    """Count this rank in and wait until ``world_size`` ranks are counted.

    Counts in generations of ``world_size`` so that a store that outlives a group
    (one hosted by a launcher) can count the next ``init_process_group`` too. The rank
    that completes a generation sets its key; the others wait for that key parked on
    the store rather than polling it, so a rank costs the store one ``add``, one
    ``wait`` and a count read or two however long the others take (polling ranks of a
    large job would cost its one store server a request each, every few hundred ms).
    The wait wakes once to say who is missing after :data:`NOTICE_AFTER` seconds, and
    once shortly before the deadline to read the count for the message.

    Raises:
        DistStoreTimeoutError: fewer than ``world_size`` joined within ``timeout`` seconds
            (or the store's host gave up waiting first), with the same message on every rank.
    """
    start = time.monotonic()
    deadline = start + timeout
    ticket = store.add(JOIN_KEY, 1)
    target = ((ticket - 1) // world_size + 1) * world_size
    base = target - world_size
    done = f"{JOIN_KEY}/{target}"
    if ticket == target:
        store.set(done, b"1")  # this rank completes the count: it wakes the others
        return
    seen = ticket - base
    notice = start + NOTICE_AFTER
    # The last count is read a little before the deadline: when the store's host (rank 0)
    # times out it closes the store, and the others still name the count they read.
    last_look = deadline - min(1.0, timeout / 4)
    for until in sorted({t for t in (notice, last_look) if start < t < deadline} | {deadline}):
        try:
            left = until - time.monotonic()
            if left > 0:
                store.wait([done], left)
                return
        except DistStoreTimeoutError:
            pass
        except DistError as exc:
            raise _gone(seen, world_size, timeout, exc) from exc
        try:
            seen = min(store.add(JOIN_KEY, 0) - base, world_size)
        except DistError as exc:
            raise _gone(seen, world_size, timeout, exc) from exc
        if seen >= world_size:
            return  # all counted (the key of a rank that died right after its add is not needed)
        if until == notice:
            print(f"gpucoll: rank {rank}: {seen} of world_size={world_size} processes have joined after "
                  f"{time.monotonic() - start:.0f} s; waiting up to {timeout:g} s. If only {seen} were "
                  "started, WORLD_SIZE is wrong", file=sys.stderr, flush=True)
    raise DistStoreTimeoutError(_message(seen, world_size, timeout))


def _gone(seen: int, world_size: int, timeout: float, exc: DistError) -> DistStoreTimeoutError:
    """The store's host (rank 0) timed out and closed it: say what it said."""
    return DistStoreTimeoutError(_message(seen, world_size, timeout) + f" (the store went away: {exc})")


def next_generation(store: Store, name: str, world_size: int) -> int:
    """The number of this ``init_process_group`` of group ``name`` on ``store`` (0, 1, ...).

    Every rank takes a ticket; the ``world_size`` ranks of one init hold consecutive
    tickets, because a rank cannot finish creating a group (and so start the next
    init) before every rank took its ticket for this one. Each generation's keys live
    in their own namespace, so an init never reads what an earlier one wrote.
    """
    ticket = store.add(f"gpucoll/generation/{name}/{world_size}", 1)
    return (ticket - 1) // world_size

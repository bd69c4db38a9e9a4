"""New processes joining a running group (after a shrink, say): tickets and seats.

A joining process takes a ticket (``gpucoll/join/tickets``, a counter in the job's
store), announces it (``gpucoll/join/ticket/<n>``) and waits for its seat
(``gpucoll/join/seat/<n>``). The group's rank 0 takes the next ``k`` tickets for
a ``grow_group(k)`` call, waits for their holders, and writes each a seat: the new
group's name (``<old>.grow<first ticket>``, unique in the job, so its store
namespace holds no stale key), rank and size, and what the joiner needs to act as
a member (backend, timeout, the group counter). The old members read the same plan
from the old group's store. Tickets whose holders did not come in time get a seat
saying so, and the grow fails on every member, leaving the old group as it was.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import Any

from ..errors import DistError, DistStoreError
from ..store import Store
from .group import ProcessGroup

__all__ = ["offer_seats", "take_seat", "JOIN_PREFIX"]

JOIN_PREFIX = "gpucoll/join"

_CALLS: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
"""grow_group calls per group so far (the same on every member): keys each call's plan."""


def take_seat(root: Store, timeout: float) -> dict[str, Any]:
    """The joining side: a ticket, then the seat the group's rank 0 writes for it.

    Raises:
        DistError: no seat within ``timeout`` (no grow_group call took the ticket), or
            the group stopped waiting for this ticket before it was announced.
    """
    ticket = root.add(f"{JOIN_PREFIX}/tickets", 1)
    root.set(f"{JOIN_PREFIX}/ticket/{ticket}", b"1")
    try:
        raw = root.get(f"{JOIN_PREFIX}/seat/{ticket}", timeout=timeout)
    except DistStoreError as exc:
        raise DistError(f"join_process_group: no group took this process (ticket {ticket}) within {timeout:g} s; "
                        "the running ranks must call gpucoll.grow_group() for it") from exc
    seat: dict[str, Any] = json.loads(raw)
    if "error" in seat:
        raise DistError(f"join_process_group (ticket {ticket}): {seat['error']}")
    return seat


def offer_seats(pg: ProcessGroup, root: Store, count: int, timeout: float, info: dict[str, Any]) -> dict[str, Any]:
    """The running side (every member of ``pg``): the plan of the grown group.

    Rank 0 takes ``count`` tickets, waits up to ``timeout`` for their holders, writes
    their seats and the plan; the others read the plan from ``pg``'s store.

    Returns:
        ``{"name": new group name, "size": new size}``.

    Raises:
        DistError: not enough processes joined in time (on every member; ``pg`` unchanged).
    """
    _CALLS[pg] = calls = _CALLS.get(pg, 0) + 1
    key = f"grow/{calls}/plan"
    if pg.rank() == 0:
        last = root.add(f"{JOIN_PREFIX}/taken", count)
        tickets = list(range(last - count + 1, last + 1))
        name = f"{pg.group_name}.grow{tickets[0]}"
        size = pg.size() + count
        deadline = time.monotonic() + timeout
        missing: list[int] = []
        for t in tickets:
            try:
                root.wait([f"{JOIN_PREFIX}/ticket/{t}"], timeout=max(deadline - time.monotonic(), 0.001))
            except DistStoreError:
                missing.append(t)
        if missing:
            error = (f"grow_group of group {pg._label()}: only {count - len(missing)} of {count} new processes "
                     f"joined within {timeout:g} s (start them with gpucoll.join_process_group())")
            for t in tickets:
                root.set(f"{JOIN_PREFIX}/seat/{t}", json.dumps({"error": error}))
            plan: dict[str, Any] = {"error": error}
        else:
            plan = {"name": name, "size": size}
            for i, t in enumerate(tickets):
                root.set(f"{JOIN_PREFIX}/seat/{t}", json.dumps({**info, **plan, "rank": pg.size() + i}))
        pg.store.set(key, json.dumps(plan))
    else:
        try:
            plan = json.loads(pg.store.get(key, timeout=timeout + 5.0))
        except DistStoreError as exc:
            raise DistError(f"grow_group of group {pg._label()}: its rank 0 did not publish the plan in time; "
                            "every member must call grow_group") from exc
    if "error" in plan:
        raise DistError(str(plan["error"]))
    return plan

"""Dynamic groups (``init_rpc(world_size=None)``): workers join and leave one at a time.

Joining and leaving hold a ticket lock in the store, so that membership changes one at a
time: a joiner reads the member list, tells every member about itself (an RPC that adds
it to their tables), then adds itself to the list; a leaver tells every member and
removes itself.
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ..store import Store
from ._agent import Agent
from ._faults import FaultSpec
from ._info import MessageType as M
from ._peers import add_peer, build_agent, remove_peer, store_timeout
from ._rref import current_context

__all__ = ["join_dynamic", "leave_dynamic", "_update_group_membership"]


@contextmanager
def _membership_lock(store: Store, timeout: float) -> Iterator[None]:
    ticket = store.add("members/ticket", 1)
    if ticket > 1:
        store.wait([f"members/turn/{ticket}"], timeout=timeout)
    try:
        yield
    finally:
        store.set(f"members/turn/{ticket + 1}", b"1")


def _members(store: Store) -> list[int]:
    return list(json.loads(store.get("members"))) if store.check(["members"]) else []


def _tell(agent: Agent, rank: int, record: str | None, others: list[int], timeout: float) -> None:
    futs = [agent.send(agent.by_id[r], M.PYTHON_CALL, (_update_group_membership, (rank, record), {}), timeout,
                       "group membership update") for r in others if r in agent.by_id and r != rank]
    for f in futs:
        f.wait()


def join_dynamic(store: Store, name: str, rank: int, record: str, listener: socket.socket, options: Any,
                 faults: FaultSpec | None, unix: socket.socket | None = None) -> Agent:
    timeout = store_timeout(options)
    with _membership_lock(store, timeout):
        members = [r for r in _members(store) if r != rank]
        records = {r: json.loads(store.get(f"worker/{r}")) for r in members}
        records[rank] = json.loads(record)
        agent = build_agent(store, rank, records, listener, options, faults, unix)
        agent.is_static_group = False
        try:
            _tell(agent, rank, record, members, timeout)
        except BaseException:
            agent.close()
            raise
        store.set("members", json.dumps(sorted(members + [rank])))
    return agent


def leave_dynamic(agent: Agent, deadline: float | None) -> None:
    timeout = 60.0 if deadline is None else max(deadline - time.monotonic(), 0.1)
    with _membership_lock(agent.store, timeout):
        members = _members(agent.store)
        _tell(agent, agent.info.id, None, [r for r in members if r != agent.info.id], timeout)
        agent.store.set("members", json.dumps([r for r in members if r != agent.info.id]))


def _update_group_membership(rank: int, record: str | None) -> None:
    """On a member of a dynamic group: add a joining worker, or drop a leaving one."""
    agent = current_context().agent
    if record is None:
        remove_peer(agent, rank)
    else:
        add_peer(agent, rank, json.loads(record))

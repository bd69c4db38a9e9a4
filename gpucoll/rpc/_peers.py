"""The group's table of workers: building an agent from the published records, and
changing it as workers join and leave a dynamic group."""

from __future__ import annotations

import socket
from typing import Any

from ..store import Store
from . import _local
from ._agent import Agent
from ._faults import FaultSpec
from ._info import DuplicateNameError, UnknownWorkerError, WorkerInfo

__all__ = ["build_agent", "unix_address", "add_peer", "remove_peer", "store_timeout"]


def store_timeout(options: Any) -> float:
    """How long joining waits for the others: the RPC timeout, at least a minute (0: half an hour)."""
    t = float(options.rpc_timeout)
    return max(t, 60.0) if t > 0 else 1800.0


def unix_address(rec: dict[str, Any]) -> str | None:
    """A worker's Unix address if it is on this host and network namespace (and both sides
    use the same-host transport); None: dial its TCP port."""
    name, identity = rec.get("unix"), rec.get("local")
    if not isinstance(name, str) or not isinstance(identity, str) or not _local.enabled():
        return None
    return name if identity == _local.host_identity() else None


def build_agent(store: Store, rank: int, records: dict[int, dict[str, Any]], listener: socket.socket,
                options: Any, faults: FaultSpec | None, unix: socket.socket | None = None) -> Agent:
    seen: dict[str, int] = {}
    for r in sorted(records):
        n = records[r]["name"]
        if n in seen:
            raise DuplicateNameError(f"RPC worker name {n!r} is not unique. Workers {seen[n]} and {r} share the same "
                                     "name.")
        seen[n] = r
    peers = {r: WorkerInfo(rec["name"], r) for r, rec in records.items()}
    addresses = {r: (rec["host"], int(rec["port"])) for r, rec in records.items()}
    agent = Agent(store, peers[rank], peers, listener, addresses, options, faults, unix)
    for r, rec in records.items():
        local = unix_address(rec)
        if local is not None and r != rank:
            agent.unix_addresses[r] = local
    agent.peer_maps = {rec["name"]: rec.get("maps", {}) for rec in records.values()}  # type: ignore[attr-defined]
    return agent


def add_peer(agent: Agent, rank: int, rec: dict[str, Any]) -> None:
    info = WorkerInfo(rec["name"], rank)
    if rec["name"] in agent.by_name and agent.by_name[rec["name"]].id != rank:
        raise UnknownWorkerError(f"RPC worker name {rec['name']!r} is not unique")
    agent.by_id[rank] = info
    agent.by_name[info.name] = info
    agent.addresses[rank] = (rec["host"], int(rec["port"]))
    local = unix_address(rec)
    if local is not None:
        agent.unix_addresses[rank] = local
    else:
        agent.unix_addresses.pop(rank, None)
    agent.peer_maps[info.name] = rec.get("maps", {})  # type: ignore[attr-defined]
    agent.lost.pop(rank, None)
    agent.peers_changed()


def remove_peer(agent: Agent, rank: int) -> None:
    info = agent.by_id.pop(rank, None)
    if info is not None:
        agent.by_name.pop(info.name, None)
    agent.peers_changed()

"""The end of a graceful shutdown: every worker's outstanding work drains.

The agreement goes through the job's store. A worker that is gone is found while waiting
(its connection broke, or dialing its port is refused), and shutdown raises naming it
instead of waiting for it.
"""

from __future__ import annotations

import time

from ..errors import DistStoreError
from ._agent import Agent
from ._info import AgentShutDownError, PeerLostError

__all__ = ["join", "barrier"]

_SLICE = 0.1


def join(agent: Agent, deadline: float | None, timeout: float) -> None:
    """torch's ``agent.join(shutdown=True)``: drain this worker's calls, then wait until every
    worker has drained; nobody leaves before all are past (the store's server may live in one)."""
    agent.drain(deadline)
    barrier(agent, "shutdown/drained", deadline, timeout)
    barrier(agent, "shutdown/exit", deadline, timeout)
    left = agent.store.add("shutdown/left", 1)
    if _hosts_server(agent.store):
        # Leaving closes the server: wait (briefly) until every worker has seen the barrier open.
        until = time.monotonic() + 10.0
        while left < len(agent.by_id) and time.monotonic() < until:
            time.sleep(0.005)
            left = agent.store.add("shutdown/left", 0)


def _hosts_server(store: object) -> bool:
    for _ in range(16):
        if getattr(store, "is_master", False) is True:
            return True
        store = getattr(store, "_store", None)
        if store is None:
            return False
    return False


def barrier(agent: Agent, name: str, deadline: float | None, timeout: float) -> None:
    store = agent.store
    world = len(agent.by_id)
    store.set(f"{name}/{agent.info.id}", b"1")
    if store.add(f"{name}/count", 1) == world:
        store.set(f"{name}/done", b"1")
    last_probe = time.monotonic()
    while True:
        try:
            store.wait([f"{name}/done"], timeout=_SLICE)
            return
        except (TimeoutError, DistStoreError):
            pass
        now = time.monotonic()
        if now - last_probe > 0.5:
            last_probe = now
            _probe_missing(agent, name)
        if agent.lost and not store.check([f"{name}/done"]):
            raise PeerLostError(f"shutdown on {agent.info.name} cannot agree with every worker: "
                                + "; ".join(sorted(agent.lost.values())))
        if deadline is not None and now > deadline:
            missing = [w.name for w in agent.worker_infos() if not store.check([f"{name}/{w.id}"])]
            raise AgentShutDownError(f"shutdown on {agent.info.name} timed out after {timeout} s waiting for "
                                     f"{missing} ({name})")


def _probe_missing(agent: Agent, name: str) -> None:
    """Dial each worker that has not arrived: a refused connection marks it lost."""
    for w in agent.worker_infos():
        if w.id != agent.info.id and not agent.store.check([f"{name}/{w.id}"]):
            try:
                agent._conn_to(w)
            except Exception:  # noqa: BLE001 -- recorded in agent.lost when it is gone
                pass

"""The job's store for ranks on Ray: served by the driver (port 0, a fresh token), or,
where the driver cannot be reached from the workers (a Ray Client driver), by a small
actor on the head node that reports the port it got. Death records go into it."""

from __future__ import annotations

import secrets
from typing import Any

from .._backends import deaths

__all__ = ["JobStore", "StoreHost"]

_STORE_TIMEOUT_S = 300.0  # a client's single store call; the job's own bounds are tighter


class StoreHost:
    """The store server inside an actor (made into a Ray actor on the head node)."""

    def __init__(self, token: str) -> None:
        import ray

        from ..store import TCPStore

        from ._actor import node_address

        self.node = node_address()
        self.server = TCPStore("", 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT_S,
                               token=token)

    def address(self) -> tuple[str, int]:
        """Where the ranks reach the store."""
        return self.node, int(self.server.port)

    def record(self, record: dict[str, Any]) -> None:
        """Write a death record (:mod:`gpucoll._backends.deaths`)."""
        deaths.write(self.server, record)

    def close(self) -> None:
        """Stop serving."""
        self.server.close()


class JobStore:
    """The store of one job (or one :func:`gpucoll.ray.init_group` group).

    Args:
        ray: the ``ray`` module.
        loopback: every rank runs on the driver's node: serve on loopback only.
        in_actor: serve from an actor on the head node; None: where the driver is a Ray
            Client (outside the cluster).
    """

    def __init__(self, ray: Any, *, loopback: bool, in_actor: bool | None = None) -> None:
        self.token = secrets.token_hex(16)
        self._ray = ray
        self._actor: Any = None
        self._server: Any = None
        if in_actor is None:
            in_actor = bool(ray.util.client.ray.is_connected())
        if in_actor:
            # A Ray Client driver is outside the cluster: the ranks could not reach it.
            host = ray.remote(num_cpus=0, max_restarts=0, resources={"node:__internal_head__": 0.001})(StoreHost)
            self._actor = host.remote(self.token)
            self.addr, self.port = ray.get(self._actor.address.remote(), timeout=120)
        else:
            from ..store import TCPStore

            from ._actor import node_address

            self.addr = "127.0.0.1" if loopback else node_address()
            # Several nodes: every interface, since the address other nodes use may not be
            # the one this host would pick (as gpucoll-run's agent does).
            self._server = TCPStore("127.0.0.1" if loopback else "", 0, is_master=True, wait_for_workers=False,
                                    timeout=_STORE_TIMEOUT_S, token=self.token)
            self.port = int(self._server.port)

    def record(self, record: dict[str, Any]) -> None:
        """Write a death record the ranks' backends read."""
        if self._server is not None:
            deaths.write(self._server, record)
        else:
            self._ray.get(self._actor.record.remote(record), timeout=30)

    def close(self) -> None:
        """Stop serving (the actor, if any, is killed)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._actor is not None:
            try:
                self._ray.kill(self._actor, no_restart=True)
            except Exception:  # already gone with its node
                pass
            self._actor = None

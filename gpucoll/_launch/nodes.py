"""How the launchers of a multi-node job keep in step, through the job's own store.

Node 0's launcher serves the store; every launcher (node 0's too) connects to it
as a client and:

- watches ``gpucoll-run/failed``: the first launcher whose rank fails writes a
  short description there, and every other launcher stops its ranks;
- writes its node's root cause to ``gpucoll-run/failure/<node>`` (rewritten when a
  better one turns up), and reads the other nodes' when the job has failed, so that
  every launcher names the same root cause and exits with its code: a rank's own
  failure before a DistError it caused elsewhere, then the earliest;
- sets ``gpucoll-run/exited/<node>`` once it has decided; node 0 keeps the store up
  (bounded) until every launcher has, so that they can all read the reports;
- treats losing the store as a failure of node 0, so that ranks on other nodes
  never outlive the job;
- sets ``gpucoll-run/done/<node>`` when its ranks all succeeded. Node 0 keeps
  the store open until every node is done, since ranks elsewhere may still use it.

Each blocking wait runs in its own thread with its own connection, and reports
to the launcher's event queue.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any

from ..errors import DistError, DistStoreTimeoutError
from ..store.base import Store

__all__ = ["NodeLink", "FAILED_KEY", "done_key", "failure_key", "exited_key"]

FAILED_KEY = "gpucoll-run/failed"
_WATCH_SLICE = 60.0
_REQUEST_TIMEOUT = 5.0


def done_key(node: int) -> str:
    return f"gpucoll-run/done/{node}"


def failure_key(node: int) -> str:
    return f"gpucoll-run/failure/{node}"


def exited_key(node: int) -> str:
    return f"gpucoll-run/exited/{node}"


class NodeLink:
    """One launcher's connections to the job's store.

    Args:
        addr, port: the store's address.
        token: the job's store token.
        timeout: seconds to connect, and default timeout of requests.
        nnodes, node_rank: the job's shape and this node's index.
        events: the launcher's event queue (``("remote", info)``,
            ``("store_lost", message)``, ``("all_done",)``, ``("done_timeout", message)``).
    """

    def __init__(self, addr: str, port: int, token: str, timeout: float, nnodes: int, node_rank: int,
                 events: queue.SimpleQueue[tuple[Any, ...]]) -> None:
        self._addr = addr
        self._port = port
        self._token = token
        self._timeout = timeout
        self._nnodes = nnodes
        self._node_rank = node_rank
        self._events = events
        self._clients: list[Store] = []
        self._closing = threading.Event()
        self._control = self._connect()
        # Reports must not hold a launcher up for the whole join timeout when node 0 is
        # unreachable (a network partition): its ranks' stop waits on them.
        self._control.set_timeout(min(timeout, _REQUEST_TIMEOUT))

    def _connect(self) -> Store:
        from ..store import TCPStore

        client = TCPStore(self._addr, self._port, is_master=False, timeout=self._timeout, token=self._token)
        self._clients.append(client)
        return client

    def watch(self) -> None:
        """Start the thread that reports another node's failure (or the store's loss)."""
        threading.Thread(target=self._watch, name="gpucoll-run-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            store = self._connect()
            while not self._closing.is_set():
                try:
                    store.wait([FAILED_KEY], timeout=_WATCH_SLICE)
                except DistStoreTimeoutError:
                    continue
                self._events.put(("remote", json.loads(store.get(FAILED_KEY).decode("utf-8"))))
                return
        except (DistError, OSError, ValueError) as err:
            if not self._closing.is_set():
                self._events.put(("store_lost", f"lost the job's store at {self._addr}:{self._port}: {err}"))

    def report_failure(self, info: dict[str, Any]) -> None:
        """Tell every node that this one failed (its root cause so far, ``info``)."""
        text = json.dumps(info)
        try:
            self._control.set(failure_key(self._node_rank), text)
            self._control.compare_set(FAILED_KEY, "", text)  # the trigger: the first one wins
        except (DistError, OSError):
            pass  # the store is gone: the other launchers notice that by themselves

    def failures(self, settle: float) -> list[dict[str, Any]]:
        """The other nodes' failure reports; waits up to ``settle`` seconds for one that
        is a rank's own failure (not a DistError) when none is there yet."""
        others = [n for n in range(self._nnodes) if n != self._node_rank]
        deadline = time.monotonic() + settle
        found: dict[int, dict[str, Any]] = {}
        while True:
            for n in others:
                try:
                    if self._control.check([failure_key(n)]):
                        found[n] = json.loads(self._control.get(failure_key(n)).decode("utf-8"))
                except (DistError, OSError, ValueError):
                    return list(found.values())
            if any(not r.get("secondary") for r in found.values()) or time.monotonic() >= deadline:
                return list(found.values())
            time.sleep(0.05)

    def report_exited(self) -> None:
        """This launcher has read the reports and decided its exit code."""
        try:
            self._control.set(exited_key(self._node_rank), "1")
        except (DistError, OSError):
            pass

    def wait_exited(self, timeout: float) -> None:
        """Node 0: wait (bounded) until every launcher has read the failure reports."""
        try:
            self._control.wait([exited_key(n) for n in range(self._nnodes)], timeout=timeout)
        except (DistError, OSError):
            pass  # a launcher that is gone reads nothing more

    def report_done(self) -> None:
        """Tell node 0 that this node's ranks all succeeded."""
        try:
            self._control.set(done_key(self._node_rank), "1")
        except (DistError, OSError):
            pass

    def wait_all_done(self) -> None:
        """Node 0: start the thread that waits for every node to report done."""
        threading.Thread(target=self._wait_all_done, name="gpucoll-run-join", daemon=True).start()

    def _wait_all_done(self) -> None:
        keys = [done_key(n) for n in range(self._nnodes)]
        try:
            store = self._connect()
            store.wait(keys, timeout=self._timeout)
            self._events.put(("all_done",))
        except DistStoreTimeoutError as err:
            self._events.put(("done_timeout", f"not every node finished within {self._timeout:.0f} s "
                                              f"after this node's ranks did: {err}"))
        except (DistError, OSError) as err:
            if not self._closing.is_set():
                self._events.put(("store_lost", f"lost the job's store while waiting for the other nodes: {err}"))

    def close(self) -> None:
        """Close every connection (threads blocked on one end quietly)."""
        self._closing.set()
        for client in self._clients:
            try:
                client.close()
            except (DistError, OSError):
                pass

"""A per-rank control-plane HTTP server (torch's ``_WorkerServer`` role), off by default.

With ``GPUCOLL_CONTROL_PLANE=1`` (or ``=HOST`` / ``=HOST:PORT`` to bind elsewhere than
loopback, port 0 by default) ``init_process_group`` starts, in each rank, a small
threaded HTTP server and publishes its address and a fresh token in the job's store
(``gpucoll/control_plane/<rank>``; the store's own token guards that). Every request
must carry ``Authorization: Bearer <token>``; the server answers:

- ``GET /ping``: ``pong``;
- ``GET /stacks``: every thread's Python stack (JSON);
- ``GET /flight_recorder``: every live group's flight recorder and the thread stacks (JSON).

``gpucoll-debug status HOST:PORT`` reads the addresses from the store and asks each rank
(see :func:`collect_job`). Answering runs on the server's own threads, so it works
while the rank's main thread is blocked in a collective.
"""

from __future__ import annotations

import hmac
import http.server
import json
import os
import secrets
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, Sequence

from . import package_dir, thread_stacks

__all__ = ["ControlPlaneServer", "maybe_start", "collect_job", "ENV", "STORE_PREFIX"]

from .._env import CONTROL_PLANE_ENV as ENV

STORE_PREFIX = "gpucoll/control_plane"


class ControlPlaneServer:
    """The HTTP server of one rank.

    Args:
        groups: returns the process's live groups (asked per request).
        host: address to bind (default loopback).
        port: port to bind (0 picks a free one; see :attr:`port`).
        token: the bearer token requests must present (default: a fresh random one).
    """

    def __init__(self, groups: Callable[[], Sequence[Any]], host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        self.token = token or secrets.token_hex(16)
        self._groups = groups
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass  # no request logs on the rank's stderr

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                    self._reply(401, {"error": "missing or wrong token"})
                    return
                path = self.path.split("?", 1)[0]
                if path == "/ping":
                    self._reply(200, "pong")
                elif path == "/stacks":
                    self._reply(200, thread_stacks())
                elif path == "/flight_recorder":
                    self._reply(200, server.flight_recorder())
                else:
                    self._reply(404, {"error": f"no such endpoint {path!r}; try /ping, /stacks, /flight_recorder"})

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gpucoll-control-plane",
                                        daemon=True)
        self._thread.start()

    def flight_recorder(self) -> dict[str, Any]:
        """Every live group's recorder snapshot, each with this process's thread stacks."""
        stacks = thread_stacks()
        dumps = []
        for pg in self._groups():
            recorder = getattr(pg, "_recorder", None)
            if recorder is not None and not getattr(pg, "_destroyed", False):
                snap = recorder.snapshot(reason="control plane request")
                snap["stacks"] = stacks
                snap["package_dir"] = package_dir()
                dumps.append(snap)
        return {"pid": os.getpid(), "dumps": dumps}

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5)
        self._httpd.server_close()


def maybe_start(store: Any, rank: int, world_size: int, groups: Callable[[], Sequence[Any]]) -> ControlPlaneServer | None:
    """Start and publish this rank's server if ``GPUCOLL_CONTROL_PLANE`` asks for one.

    Raises:
        ValueError: the variable is not ``1``, ``HOST`` or ``HOST:PORT``.
        OSError: the address cannot be bound.
    """
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "0"):
        return None
    host, port = "127.0.0.1", 0
    if raw != "1":
        name, _, num = raw.rpartition(":") if ":" in raw else (raw, "", "0")
        if not name or not num.isdigit():
            raise ValueError(f"{ENV} must be 1, HOST or HOST:PORT; got {raw!r}")
        host, port = name, int(num)
    server = ControlPlaneServer(groups, host, port)
    from ..store import PrefixStore

    published = PrefixStore(STORE_PREFIX, store)
    advertised = host if host not in ("0.0.0.0", "::") else _hostname()
    published.set(str(rank), json.dumps({"host": advertised, "port": server.port, "token": server.token}))
    if rank == 0:
        published.set("world_size", str(world_size))
    return server


def _hostname() -> str:
    import socket

    return socket.gethostname()


def collect_job(host: str, port: int, *, token: str | None, timeout: float) -> tuple[list[dict[str, Any]],
                                                                                     list[tuple[int, str]]]:
    """Ask every rank of the job whose store is at ``host:port`` for its flight recorder.

    Returns:
        ``(answers, problems)``: each answering rank's ``/flight_recorder`` reply, and
        ``(rank, why)`` for each rank that published no address or did not answer.

    Raises:
        DistStoreError, DistNetworkError: the store cannot be reached or has no
            control-plane entries (the job was not started with GPUCOLL_CONTROL_PLANE=1).
    """
    from ..errors import DistStoreError
    from ..store import PrefixStore, TCPStore

    client = TCPStore(host, port, is_master=False, timeout=timeout, token=token)
    try:
        published = PrefixStore(STORE_PREFIX, client)
        if not published.check(["world_size"]):
            raise DistStoreError(f"the store at {host}:{port} has no control-plane addresses: start the job "
                                 f"with {ENV}=1")
        world_size = int(published.get("world_size").decode())
        answers, problems = [], []
        for r in range(world_size):
            if not published.check([str(r)]):
                problems.append((r, "published no control-plane address (not started, or before init)"))
                continue
            info = json.loads(published.get(str(r)).decode())
            request = urllib.request.Request(f"http://{info['host']}:{info['port']}/flight_recorder",
                                             headers={"Authorization": f"Bearer {info['token']}"})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as reply:
                    answers.append(json.loads(reply.read().decode()))
            except (OSError, urllib.error.URLError, ValueError) as exc:
                problems.append((r, f"no answer from {info['host']}:{info['port']} ({exc}); dead or unreachable"))
        return answers, problems
    finally:
        client.close()

"""The store server's side of torch's protocol: reading a torch client's unframed
requests and serving them as they complete (see ``_torch_wire``).

Functions of the server (``_server.StoreServer``, which imports this module) rather
than its methods, so that the server's module keeps to the event loop and gpucoll's
frames.
"""

from __future__ import annotations

import socket
from typing import Protocol

from ..errors import DistStoreError
from . import _torch_wire as tw
from . import _wire as w
from ._requests import PIPELINE_SLACK, PREAUTH_MAX_FRAME, Conn, Requests, torch_request

__all__ = ["TorchServer", "process_torch", "read_torch"]


class TorchServer(Protocol):
    """What serving torch's protocol needs of the store server: its request table, its
    shared receive buffer, and sending, serving or dropping a connection."""

    requests: Requests
    _rbuf: bytearray
    _rview: memoryview

    def _process(self, conn: Conn) -> None: ...

    def _send(self, conn: Conn) -> None: ...

    def _drop(self, conn: Conn) -> None: ...


def read_torch(srv: TorchServer, conn: Conn, sock: socket.socket) -> None:
    """Read from a torch client: its requests are not framed, so they are parsed as
    they complete (see _torch_wire); a parked WAIT still lets CANCEL_WAIT through."""
    try:
        n = sock.recv_into(srv._rbuf)
    except (BlockingIOError, InterruptedError):
        return
    except OSError:
        srv._drop(conn)
        return
    if not n:
        srv._drop(conn)
        return
    if conn.inbuf:
        buf = conn.inbuf if isinstance(conn.inbuf, bytearray) else bytearray(conn.inbuf)
        buf += srv._rview[:n]
        conn.inbuf = buf
    else:
        conn.inbuf = bytes(srv._rview[:n])
    process_torch(srv, conn)


def process_torch(srv: TorchServer, conn: Conn) -> None:
    """Serve the torch requests buffered for ``conn``, in order, until one parks."""
    buf = conn.inbuf
    n = len(buf)
    pos = 0
    # Before its PING a torch client has sent nothing but VALIDATE: no long items.
    req = srv.requests
    limit = max(req.max_value_size, req.max_key_size) if conn.pinged else PREAUTH_MAX_FRAME
    try:
        while pos < n and conn.torch and not conn.writing and not conn.closing:
            if conn.waiter is not None and buf[pos] != tw.Q.CANCEL_WAIT:
                if n - pos > PIPELINE_SLACK:
                    raise w.ProtocolError("a torch client flooded a parked request")
                break
            try:
                q, args, end = tw.parse_request(buf, pos, n, limit)
            except tw.Incomplete:
                break
            pos = end
            torch_request(srv.requests, conn, q, args)
            if conn.sock is None:
                return
    except (w.ProtocolError, DistStoreError):
        srv._drop(conn)
        return
    conn.inbuf = buf[pos:] if pos < n else b""
    if conn.out and not conn.writing:
        srv._send(conn)
    if not conn.torch and conn.inbuf and conn.sock is not None:
        srv._process(conn)  # a gpucoll client's probe: its HELLO follows

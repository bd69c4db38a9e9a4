"""The socket-pair fixture of the connection-level RPC tests (imported by them)."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from gpucoll.rpc import _conn


@pytest.fixture()
def pair() -> Iterator[tuple[_conn._Conn, socket.socket]]:
    """A connection (to worker id 1) over one end of a socket pair, and the other end."""
    a, b = socket.socketpair()
    conn = _conn._Conn(a, 1)
    yield conn, b
    conn.close()
    conn.close_pipe()
    b.close()

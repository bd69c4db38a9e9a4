"""Sockets of the TCPStore server: its listeners, the name of its same-host Unix
socket, and the uid of a Unix socket's peer."""

from __future__ import annotations

import socket
import struct

from ..errors import DistNetworkError

__all__ = ["listen", "peer_uid", "unix_socket_name"]


def unix_socket_name(ip: str, port: int) -> str:
    """The abstract Unix socket a server bound to ``ip:port`` also listens on."""
    return f"\0gpucoll-store/{ip}:{port}"


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (-1 if unknown)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return -1
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, 12))
    except OSError:
        return -1
    return int(uid)


def listen(host: str, port: int, backlog: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV)
        family, stype, proto, _, addr = infos[0]
        listener = socket.socket(family, stype, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
    except OSError as e:
        raise DistNetworkError(f"TCPStore server cannot listen on {host!r}:{port}: {e}") from e
    return listener

"""Sockets of the TCPStore server: its listeners, the name of its same-host Unix
socket, the uid of a Unix socket's peer, and the poller its loop waits on."""

from __future__ import annotations

import select
import selectors
import socket
import struct

from ..errors import DistNetworkError

__all__ = ["listen", "peer_uid", "unix_socket_name", "new_poller", "IN", "OUT", "IN_ANY"]


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
        raise DistNetworkError(f"The server socket has failed to listen on any local network address. "
                               f"port: {port}, host: {host!r}: {e}") from e
    return listener


class _Selector:
    """``select.epoll``'s interface over a ``selectors`` set, where there is no epoll."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()

    def register(self, fd: int, events: int) -> None:
        self._sel.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._sel.modify(fd, events)

    def unregister(self, fd: int) -> None:
        self._sel.unregister(fd)

    def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
        return [(key.fd, ev) for key, ev in self._sel.select(None if timeout < 0 else timeout)]

    def close(self) -> None:
        self._sel.close()


if hasattr(select, "epoll"):
    # epoll itself: its events come as (fd, mask) pairs, with no per-event Python object
    # (a selectors set builds one per ready connection).
    new_poller = select.epoll
    IN = select.EPOLLIN
    OUT = select.EPOLLOUT
    IN_ANY = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
else:
    new_poller = _Selector  # type: ignore[assignment,misc]
    IN = selectors.EVENT_READ
    OUT = selectors.EVENT_WRITE
    IN_ANY = selectors.EVENT_READ

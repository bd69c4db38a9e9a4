"""Sockets of the TCPStore server: its listeners, the name of its same-host Unix
socket, the uid of a Unix socket's peer, the poller its loop waits on, and the
descriptor limit it needs."""

from __future__ import annotations

import os
import resource
import select
import selectors
import socket
import struct
import sys
from typing import TYPE_CHECKING

from ..errors import DistNetworkError, DistStoreError

if TYPE_CHECKING:
    from ._requests import Conn

__all__ = ["read_big", "listen", "somaxconn", "peer_uid", "unix_socket_name", "new_poller", "IN", "OUT", "IN_ANY",
           "raise_nofile", "open_files", "nofile_for", "accept_queues", "FD_RESERVE",
           "NODELAY_INHERITED", "CLOSE_UNREGISTERS", "forget"]

_INFINITY = resource.RLIM_INFINITY


def raise_nofile() -> tuple[int, int]:
    """Raise this process's open-file limit (RLIMIT_NOFILE) to its hard limit, as far as
    the kernel allows; return the (soft, hard) limits now in force. Each client of a
    server holds one descriptor of the process it runs in, and the usual soft limit
    (1,024) is far below a large job's rank count."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != _INFINITY and (hard == _INFINITY or soft < hard):
        for want in (hard, 1 << 20):  # an unlimited hard limit: ask for a large finite one
            if want == _INFINITY:
                continue
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
                break
            except (ValueError, OSError):
                continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


FD_RESERVE = 64
"""Descriptors a server's process keeps for other uses than its clients (listeners, its
own files, its host's threads)."""
BURST = 16384
"""Clients connecting at once that the accept queues are sized for when the job's size
is not known."""
MAX_QUEUES = 8


def accept_queues(clients: int | None, backlog: int) -> int:
    """How many accept queues (see :func:`listen`) hold ``clients`` (default BURST)
    connecting at once: one per ``somaxconn`` of them, at most MAX_QUEUES."""
    per = max(1, min(backlog, somaxconn()))
    return max(1, min(MAX_QUEUES, -(-(clients or BURST) // per)))


def nofile_for(expected_clients: int | None, reserve: int = FD_RESERVE) -> int:
    """Raise the open-file limit (see :func:`raise_nofile`) and return the soft limit now
    in force; refuse, naming the limit and the clients, when it cannot hold
    ``expected_clients`` connections besides the descriptors open now and ``reserve``.

    Raises:
        DistStoreError: the limit is too low for ``expected_clients``.
    """
    soft, hard = raise_nofile()
    if expected_clients is not None and 0 < soft != _INFINITY:
        need = expected_clients + open_files() + reserve
        if soft < need:
            raise DistStoreError(
                f"TCPStore server: the open-file limit (RLIMIT_NOFILE) of this process is "
                f"{soft} (hard limit {hard}), too low for {expected_clients} clients: each "
                f"client connection holds one descriptor here, so the server needs at "
                f"least {need}. Raise the hard limit (ulimit -Hn as root, or the "
                f"scheduler's or container's limits)")
    return soft


def open_files() -> int:
    """Descriptors this process has open now (0 where that cannot be counted)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing the folder
    except OSError:
        return 0


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


def somaxconn() -> int:
    """The kernel's cap on one listener's accept queue (128 where it cannot be read)."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(1, int(f.read()))
    except (OSError, ValueError):
        return 128


def listen(host: str, port: int, backlog: int, queues: int = 1) -> list[socket.socket]:
    """Listening sockets on ``host:port``: one, or ``queues`` sharing the port through
    SO_REUSEPORT where the platform has it. The kernel spreads new connections over
    them, so the server can hold ``queues`` times ``net.core.somaxconn`` connections that
    it has not accepted yet: a whole job connecting at once overflows a single queue, and
    each connection the kernel drops costs its client a SYN retransmission (1 s, then
    3 s). Only processes of the same user could join the port's group (the kernel's
    rule), and a gpucoll server does not: it binds the port plainly first."""
    reuse = getattr(socket, "SO_REUSEPORT", None) if queues > 1 else None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV)
        family, stype, proto, _, addr = infos[0]
        if reuse is None:
            return _bind(family, stype, proto, addr, backlog, 1, None)
        for attempt in range(3):
            # First a plain bind: it fails on a port in use, a port another SO_REUSEPORT
            # group holds included (which SO_REUSEPORT sockets would silently join), and
            # it picks the port when port is 0. The group binds it right after.
            with socket.socket(family, stype, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(addr)
                picked = (addr[0], probe.getsockname()[1], *addr[2:])
            try:
                return _bind(family, stype, proto, picked, backlog, queues, reuse)
            except OSError:
                if port or attempt == 2:
                    raise  # a port picked for us may have gone in between: pick again
        raise AssertionError("unreachable")
    except OSError as e:
        raise DistNetworkError(f"The server socket has failed to listen on any local network address. "
                               f"port: {port}, host: {host!r}: {e}") from e


def _bind(family: int, stype: int, proto: int, addr: tuple[object, ...], backlog: int,
          queues: int, reuse: int | None) -> list[socket.socket]:
    listeners: list[socket.socket] = []
    for i in range(queues):
        listener = socket.socket(family, stype, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family in (socket.AF_INET, socket.AF_INET6):
                # Inherited by every accepted connection on Linux (NODELAY_INHERITED).
                listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if reuse is not None:
                listener.setsockopt(socket.SOL_SOCKET, reuse, 1)
            listener.bind(addr)
            listener.listen(backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            if not i:
                raise
            break  # the extra queues are a help, not a need
        listeners.append(listener)
    return listeners


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


NODELAY_INHERITED = sys.platform.startswith("linux")
"""An accepted TCP connection has its listener's TCP_NODELAY: no setsockopt per client."""

if hasattr(select, "epoll"):
    # epoll itself: its events come as (fd, mask) pairs, with no per-event Python object
    # (a selectors set builds one per ready connection).
    new_poller = select.epoll
    IN = select.EPOLLIN
    OUT = select.EPOLLOUT
    IN_ANY = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
    CLOSE_UNREGISTERS = True
    """Closing a descriptor takes it out of the epoll set: no epoll_ctl per client."""
else:
    new_poller = _Selector  # type: ignore[assignment,misc]
    IN = selectors.EVENT_READ
    OUT = selectors.EVENT_WRITE
    IN_ANY = selectors.EVENT_READ
    CLOSE_UNREGISTERS = False


def forget(poller: select.epoll | _Selector, fd: int) -> None:
    """Take ``fd`` out of ``poller`` before it is closed, where closing does not."""
    if not CLOSE_UNREGISTERS:
        try:
            poller.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass


BIG_CHUNK = 1 << 20
"""The least a large frame's receive buffer grows by at a time."""


def read_big(conn: Conn, sock: socket.socket) -> bool | None:
    """Receive more of a large frame into ``conn.big`` (within the connection's
    authenticated frame limit), a buffer that grows as it fills: by at most its size, and
    at least BIG_CHUNK, up to the announced ``conn.big_need``. A client announcing a
    gigabyte and sending a few bytes costs a few bytes. True once the frame is complete
    (it is then ``conn.inbuf``), False while more is to come, None when the peer is gone."""
    big = conn.big
    assert big is not None
    need = conn.big_need
    try:
        while conn.big_have < need:
            if conn.big_have == len(big):
                big += bytes(min(need - len(big), max(len(big), BIG_CHUNK)))
            with memoryview(big) as view:
                got = sock.recv_into(view[conn.big_have:])
            if not got:
                return None
            conn.big_have += got
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return None
    conn.big = None
    conn.inbuf = big
    return True

"""Multiplexed connections: many clients' byte streams over one connection to the server.

A node-local store relay (see ``_relay``) carries all its node's ranks over ONE connection
to the job's store server. That connection says HELLO as any client does (with the
job's token), then carries only two frames, in both directions::

    MUX_DATA   channel (u32, 4 bytes), data      bytes of one client's stream
    MUX_CLOSE  channel (u32, 4 bytes)            that client's stream has ended

A channel is a tunnel of one client's connection, byte for byte: the client says its
own HELLO (its token checked as if it had connected directly), and may speak
gpucoll's protocol or torch's. On the server each channel is a connection like any
other (a :class:`Conn`), whose socket is a :class:`_ChannelSocket`: reading takes the
bytes that MUX_DATA frames brought, sending wraps the bytes in MUX_DATA frames on
the relay's connection. So every request, the parking of ``get``/``wait`` and their
timeouts, are the server's own code, unchanged, and a parked channel blocks only
itself: the others' frames on the shared connection are served as they come, each
reply tagged with its channel.

Frames of a channel are never read through the server's shared receive buffer
(a relay's frame is being served from it), only through the channel's own buffer.
When the relay's connection drops, every channel on it is dropped with it (its
parked requests cancelled).
"""

from __future__ import annotations

import socket
import struct
from typing import Final, Iterable, Protocol, Union, cast

from . import _wire as w
from ._requests import PIPELINE_SLACK, Conn, Requests
from ._sockets import read_big

__all__ = ["MuxHub", "MuxServer", "MUX_DATA", "MUX_CLOSE", "data_frame", "close_frame", "CHANNEL"]

MUX_DATA: Final = 32
MUX_CLOSE: Final = 33
CHANNEL: Final = struct.Struct("<I")
_DATA_HEAD = struct.Struct("<IBI4sI")
"""A MUX_DATA frame's header: length, code, 4, the channel, the data's length."""

Part = Union[bytes, memoryview]


def data_frame(channel: int, data: Part) -> bytes:
    """A MUX_DATA frame carrying ``data`` for ``channel``."""
    return _DATA_HEAD.pack(13 + len(data), MUX_DATA, 4, CHANNEL.pack(channel), len(data)) + data


def close_frame(channel: int) -> bytes:
    """A MUX_CLOSE frame for ``channel``."""
    return w.encode_frame(MUX_CLOSE, [CHANNEL.pack(channel)])


class _ChannelSocket:
    """What a channel's Conn has for a socket: reads come from MUX_DATA frames, sends
    leave as MUX_DATA frames on the relay's connection. Never blocks."""

    __slots__ = ("hub", "parent", "tag", "rx", "ended")

    def __init__(self, hub: MuxHub, parent: Conn, tag: bytes) -> None:
        self.hub = hub
        self.parent = parent
        self.tag = tag
        self.rx = bytearray()
        self.ended = False
        """The relay said MUX_CLOSE (no MUX_CLOSE goes back)."""

    def fileno(self) -> int:
        return -1  # in no poller, in no connection table

    def recv_into(self, buf: memoryview | bytearray, nbytes: int = 0) -> int:
        rx = self.rx
        if not rx:
            raise BlockingIOError
        n = min(len(buf), len(rx))
        buf[:n] = rx[:n]
        del rx[:n]
        return n

    def send(self, data: Part) -> int:
        self.hub.forward(self, (data,), len(data))
        return len(data)

    def sendmsg(self, parts: list[Part]) -> int:
        size = sum(map(len, parts))
        self.hub.forward(self, parts, size)
        return size

    def close(self) -> None:
        self.hub.closed(self)


class _ParentSocket:
    """The relay connection's real socket, with a close that drops its channels first."""

    __slots__ = ("sock", "hub", "conn", "recv_into", "send", "sendmsg", "fileno", "getsockopt")

    def __init__(self, sock: socket.socket, hub: MuxHub, conn: Conn) -> None:
        self.sock, self.hub, self.conn = sock, hub, conn
        # Bound methods of the socket itself: no cost per call on the relay's traffic.
        self.recv_into = sock.recv_into
        self.send = sock.send
        self.sendmsg = sock.sendmsg
        self.fileno = sock.fileno
        self.getsockopt = sock.getsockopt

    def close(self) -> None:
        self.hub.drop_parent(self.conn)
        self.sock.close()


class MuxServer(Protocol):
    """What the hub needs of the store server that holds it (``_server.StoreServer``,
    which imports this module): its request table, and serving or dropping a connection."""

    requests: Requests

    def _process(self, conn: Conn) -> None: ...

    def _process_torch(self, conn: Conn) -> None: ...

    def _drop(self, conn: Conn) -> None: ...


class MuxHub:
    """The server's side of multiplexed connections: registers MUX_DATA and MUX_CLOSE
    with ``server``'s request table and keeps each relay connection's channels."""

    def __init__(self, server: MuxServer) -> None:
        self.server = server
        self.channels: dict[Conn, dict[bytes, Conn]] = {}
        server.requests.register(MUX_DATA, 2, 2, self.on_data)
        server.requests.register(MUX_CLOSE, 1, 1, self.on_close)

    @property
    def relays(self) -> int:
        """Relay connections that have opened at least one channel."""
        return len(self.channels)

    def on_data(self, parent: Conn, f: list[bytes]) -> None:
        tag, data = f
        if len(tag) != 4:
            raise w.ProtocolError(f"a channel id is 4 bytes; got {len(tag)}")
        if isinstance(parent.sock, _ChannelSocket):
            raise w.ProtocolError("a channel cannot carry channels")
        chans = self.channels.get(parent)
        if chans is None:
            chans = self.channels[parent] = {}
            assert parent.sock is not None
            parent.sock = cast(socket.socket, _ParentSocket(parent.sock, self, parent))
        ch = chans.get(tag)
        if ch is None:
            ch = Conn(cast(socket.socket, _ChannelSocket(self, parent, tag)))
            chans[tag] = ch
        cs = cast(_ChannelSocket, ch.sock)
        if ch.big is not None or cs.rx:
            cs.rx += data
        elif data:
            ch.inbuf = ch.inbuf + data if ch.inbuf else data  # the usual case: no copy
        try:
            self._feed(ch, cs)
        except Exception:  # as the server does: one bad client never stops the others
            self.server._drop(ch)

    def on_close(self, parent: Conn, f: list[bytes]) -> None:
        ch = self.channels.get(parent, {}).get(f[0])
        if ch is not None and ch.sock is not None:
            cast(_ChannelSocket, ch.sock).ended = True
            self.server._drop(ch)

    def _feed(self, ch: Conn, cs: _ChannelSocket) -> None:
        """Serve what has arrived for ``ch``, as the server's read path does."""
        srv = self.server
        while ch.sock is not None and (cs.rx or ch.inbuf):
            if ch.big is not None:
                if not cs.rx:
                    return
                done = read_big(ch, cast(socket.socket, cs))
                if done is None:
                    srv._drop(ch)
                if not done:
                    return
                srv._process(ch)
                continue
            if cs.rx:
                data = bytes(cs.rx)
                cs.rx.clear()
                ch.inbuf = ch.inbuf + data if ch.inbuf else data
            if ch.waiter is not None or ch.writing or ch.later:
                if len(ch.inbuf) > PIPELINE_SLACK:
                    srv._drop(ch)
                return
            before = len(ch.inbuf)
            if ch.torch:
                srv._process_torch(ch)
            else:
                srv._process(ch)
            if ch.big is None and len(ch.inbuf) == before and not cs.rx:
                return  # an incomplete frame: the rest comes with the next MUX_DATA

    def forward(self, cs: _ChannelSocket, parts: Iterable[Part], size: int) -> None:
        parent = cs.parent
        if parent.sock is None:
            return
        out = parent.out
        out.append(_DATA_HEAD.pack(13 + size, MUX_DATA, 4, cs.tag, size))
        out.extend(parts)
        self.server.requests.reply_later(parent)

    def closed(self, cs: _ChannelSocket) -> None:
        parent = cs.parent
        chans = self.channels.get(parent)
        if chans is not None:
            chans.pop(cs.tag, None)
        if not cs.ended and parent.sock is not None:
            parent.out.append(w.encode_frame(MUX_CLOSE, [cs.tag]))
            self.server.requests.reply_later(parent)

    def drop_parent(self, parent: Conn) -> None:
        for ch in list(self.channels.pop(parent, {}).values()):
            self.server._drop(ch)

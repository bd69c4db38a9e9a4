"""RPC frames on a socket, the connection handshake, and pickling with buffers out of band.

A frame is a fixed header, a pickle (protocol 5) and the pickle's out-of-band buffers
(NumPy arrays' memory, never copied into the pickle)::

    magic "GRPC" | kind u8 | flags u8 | nbufs u16 | message id u64 | pickle length u64
    | nbufs x u64 buffer lengths | pickle | buffer 0 | buffer 1 | ...

A frame is written with one ``sendmsg`` of all its parts. A frame whose magic is wrong,
that declares more than ``MAX_BUFFERS`` buffers or more than ``max_frame_bytes`` in
all, is an error for its connection only (the connection is closed).

Before any frame, the dialer and the listener run the CPU transport's challenge-response
(:mod:`gpucoll._backends.cpu.auth`: HMAC over fresh nonces, keyed by the job's store
token; a same-host peer must belong to this user: on a Unix socket its ``SO_PEERCRED``
uid, checked before anything is read), under a key of its own for RPC. The
listener reads only fixed-size handshake records until the dialer has proven itself:
nothing from an unauthenticated connection is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import pickle
import secrets
import socket
import struct
from typing import Any, Callable

from .._backends.cpu import auth
from . import _local

__all__ = ["HEADER", "MAX_BUFFERS", "FrameError", "FrameReader", "frame_parts", "send_frame", "send_parts", "dial_handshake",
           "listen_handshake", "rpc_key", "dumps", "loads"]

HEADER = struct.Struct("<4sBBHQQ")
_HEAD = HEADER.size
MAGIC = b"GRPC"
HANDSHAKE_MAGIC = b"GPCRPC01"
MAX_BUFFERS = 4096
_IOV_MAX = 512
_CHUNK = 1 << 18
_DIRECT = 1 << 16  # bodies at least this large are received straight into their own buffer


class FrameError(Exception):
    """A malformed or oversized frame: its connection is closed."""


def rpc_key(store: Any) -> tuple[bytes, bool]:
    """The RPC handshake key (derived from the job's store token) and whether it is secret."""
    key, secret = auth.group_key(store)
    return hmac.new(key, b"gpucoll rpc v1", hashlib.sha256).digest(), secret


def dial_handshake(sock: socket.socket, key: bytes, me: int, peer: int) -> None:
    """The dialer's side: greet, check the listener's proof, prove ourselves, await OK.

    Raises:
        auth.HandshakeError: the listener does not hold the key.
        EOFError, OSError: the connection failed.
    """
    nonce = secrets.token_bytes(32)
    sock.sendall(auth.HELLO.pack(HANDSHAKE_MAGIC, me, peer, nonce))
    reply = auth.recv_exact(sock, auth.REPLY.size)
    sock.sendall(auth.check_reply(key, me, peer, nonce, reply))
    if auth.recv_exact(sock, 1) != auth.OK:
        raise auth.HandshakeError(f"worker id {peer} refused the connection")


def listen_handshake(sock: socket.socket, key: bytes, me: int, secret: bool,
                     valid_peer: Callable[[int], bool]) -> int:
    """The listener's side; returns the dialer's worker id once it has proven itself.

    Raises:
        auth.HandshakeError: a bad greeting or proof, or a same-host peer of another user.
    """
    unix = _local.family_name(sock) == "unix"
    if unix:  # always checked here, token or not: an abstract name is open to every user
        _local.check_peer(sock, "a connection on this worker's Unix address")
    magic, peer, target, dialer_nonce = auth.HELLO.unpack(auth.recv_exact(sock, auth.HELLO.size))
    if magic != HANDSHAKE_MAGIC or target != me or not valid_peer(peer):
        raise auth.HandshakeError(f"a connection with a bad greeting (worker id {peer}, for id {target})")
    if not unix:
        auth.check_local_owner(sock, peer, strict=not secret)
    reply, nonce = auth.make_reply(key, me, peer, dialer_nonce)
    sock.sendall(reply)
    auth.check_proof(key, me, peer, nonce, dialer_nonce, auth.recv_exact(sock, auth.PROOF.size))
    sock.sendall(auth.OK)
    return int(peer)


def frame_parts(kind: int, flags: int, mid: int, data: bytes | memoryview, bufs: list[Any]) -> list[Any]:
    """One frame as the buffers ``sendmsg`` writes: header, pickle, out-of-band buffers."""
    if type(data) is not bytes:
        data = memoryview(data).cast("B")  # (len: its size in bytes, for send_parts)
    if not bufs:
        return [HEADER.pack(MAGIC, kind, flags, 0, mid, len(data)), data]
    views = [_flat(b) for b in bufs]
    head = HEADER.pack(MAGIC, kind, flags, len(views), mid, len(data))
    head += struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    return [head, data, *views]


def send_frame(sock: socket.socket, kind: int, flags: int, mid: int, data: bytes | memoryview,
               bufs: list[Any]) -> None:
    """Write one frame with a single ``sendmsg`` where the kernel takes it all (the caller
    holds the connection's send lock)."""
    send_parts(sock, frame_parts(kind, flags, mid, data, bufs))


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Write frames' parts (:func:`frame_parts`, one or more frames) with one ``sendmsg``
    where the kernel takes it all."""
    sent = sock.sendmsg(parts[:_IOV_MAX])
    if sent == sum(map(len, parts)):  # (bytes, and memoryviews of unsigned bytes: len is the size)
        return
    # A partial write (a full socket buffer, or more parts than one call takes): go on from there.
    rest = [memoryview(p).cast("B") for p in parts]
    while rest:
        while rest and sent >= rest[0].nbytes:
            sent -= rest[0].nbytes
            rest.pop(0)
        if not rest:
            return
        if sent:
            rest[0] = rest[0][sent:]
        sent = sock.sendmsg(rest[:_IOV_MAX])


def _flat(b: Any) -> memoryview:
    """A buffer as contiguous unsigned bytes, format ``"B"`` (a PickleBuffer's ``raw()``;
    empty arrays included): its ``len`` is its size in bytes."""
    if isinstance(b, pickle.PickleBuffer):
        return b.raw()
    m = memoryview(b)
    return m.cast("B") if m.nbytes else memoryview(b"")


class FrameReader:
    """Reads frames from one authenticated connection, many small ones per ``recv``."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int) -> None:
        self.sock = sock
        self.max_frame_bytes = max_frame_bytes
        self.buf = bytearray()
        self.pos = 0
        self.chunk = bytearray(_CHUNK)
        self.chunk_view = memoryview(self.chunk)

    def buffered(self) -> bool:
        """Whether bytes already received wait to be read (a frame, or part of one)."""
        return len(self.buf) > self.pos

    def buffered_kind(self) -> int | None:
        """The kind of the next frame if all of it has been received already, else None."""
        have = len(self.buf) - self.pos
        if have < HEADER.size:
            return None
        magic, kind, _flags, nbufs, _mid, length = HEADER.unpack_from(self.buf, self.pos)
        if magic != MAGIC or nbufs > MAX_BUFFERS or have < HEADER.size + 8 * nbufs:
            return None
        sizes = struct.unpack_from(f"<{nbufs}Q", self.buf, self.pos + HEADER.size) if nbufs else ()
        return int(kind) if have >= HEADER.size + 8 * nbufs + length + sum(sizes) else None

    def pull(self) -> int:
        """Receive what the socket holds now, without blocking: the number of bytes (0: none
        yet, or the peer closed; a later :meth:`read` learns which)."""
        try:
            k = self.sock.recv_into(self.chunk_view, 0, socket.MSG_DONTWAIT)
        except OSError:  # nothing yet (EAGAIN), or a broken connection (the next read raises it)
            return 0
        if k:
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            self.buf += self.chunk_view[:k]
        return k

    def _fill(self, n: int) -> None:
        while len(self.buf) - self.pos < n:
            if self.pos:
                del self.buf[:self.pos]
                self.pos = 0
            k = self.sock.recv_into(self.chunk_view)
            if k == 0:
                raise EOFError("the connection was closed by the peer")
            self.buf += self.chunk_view[:k]

    def _take(self, n: int) -> bytes:
        self._fill(n)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def _body(self, n: int) -> bytearray:
        """``n`` bytes as a fresh writable buffer (arrays unpickled from it are writable)."""
        have = min(len(self.buf) - self.pos, n)
        if n < _DIRECT or have == n:
            self._fill(n)
            out = self.buf[self.pos:self.pos + n]
            self.pos += n
            return out
        out = bytearray(n)
        view = memoryview(out)
        view[:have] = self.buf[self.pos:self.pos + have]
        self.pos += have
        got = have
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("the connection was closed by the peer in the middle of a frame")
            got += k
        return out

    def read(self) -> tuple[int, int, int, bytearray, list[bytearray]]:
        """The next frame: ``(kind, flags, message id, pickle, buffers)``.

        Raises:
            FrameError: bad magic, too many buffers, or more bytes than allowed.
            EOFError: the peer closed the connection.
        """
        if len(self.buf) - self.pos < _HEAD:
            self._fill(_HEAD)  # (what the socket holds: often the whole frame, and more)
        buf, pos = self.buf, self.pos
        # The common case: a small frame without buffers, all of it received.
        magic, kind, flags, nbufs, mid, length = HEADER.unpack_from(buf, pos)
        end = pos + _HEAD + length
        if not nbufs and len(buf) >= end and magic == MAGIC and length < _DIRECT and length <= self.max_frame_bytes:
            self.pos = end
            return kind, flags, mid, buf[pos + _HEAD:end], []
        magic, kind, flags, nbufs, mid, length = HEADER.unpack(self._take(HEADER.size))
        if magic != MAGIC:
            raise FrameError(f"a frame with a bad magic {magic!r}")
        if nbufs > MAX_BUFFERS:
            raise FrameError(f"a frame declaring {nbufs} buffers (at most {MAX_BUFFERS})")
        sizes = struct.unpack(f"<{nbufs}Q", self._take(8 * nbufs)) if nbufs else ()
        total = length + sum(sizes)
        if total > self.max_frame_bytes:
            raise FrameError(f"a frame of {total} bytes (at most {self.max_frame_bytes})")
        data = self._body(length)
        return kind, flags, mid, data, [self._body(n) for n in sizes]


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, bufs: list[Any], hook: Callable[[Any], Any] | None) -> None:
        super().__init__(file, protocol=5, buffer_callback=bufs.append)
        self.hook = hook

    def reducer_override(self, obj: Any) -> Any:
        hook = self.hook
        return NotImplemented if hook is None else hook(obj)


def dumps(obj: Any, hook: Callable[[Any], Any] | None = None) -> tuple[bytes | memoryview, list[Any]]:
    """Pickle ``obj`` (protocol 5); returns the pickle and the out-of-band buffers.

    ``hook(obj)`` is asked first for every object that is not a plain builtin; it returns
    a reduce tuple (RRefs, device arrays) or ``NotImplemented``.
    """
    bufs: list[Any] = []
    if hook is None:
        return pickle.dumps(obj, protocol=5, buffer_callback=bufs.append), bufs
    f = io.BytesIO()
    _Pickler(f, bufs, hook).dump(obj)
    return f.getbuffer(), bufs


def loads(data: bytes | bytearray | memoryview, bufs: list[bytearray]) -> Any:
    """Unpickle a frame's pickle with its out-of-band buffers."""
    return pickle.loads(data, buffers=bufs)

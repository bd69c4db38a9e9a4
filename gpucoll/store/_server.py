"""The TCPStore server: one selector loop on a background thread serves every client.

Design points (see docs/stores.md):

* One thread, one selector, non-blocking sockets: thousands of connections cost one
  entry each, not a thread each.
* ``get``/``wait``/``queue_pop`` park a waiter in :class:`KVState`; the write that
  satisfies it queues the reply. Deadlines live in a heap, so a timed-out request is
  answered by the server (naming the keys still missing) at its deadline.
* Replies produced while handling one batch of ready sockets are flushed once, after
  the batch; requests that arrive together on one connection are answered together.
* A connection is answered strictly in order: while it has a parked request or
  unsent output, its further frames wait in its buffer.
* Anything that does not parse, a wrong token, or an absurd length drops that
  connection only. No name resolution happens on accept.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import itertools
import select
import socket
import sys
import threading
import time
from typing import Callable, Union

from ..errors import DistNetworkError, DistStoreError
from . import _wire as w
from ._kv import KVState, Waiter

__all__ = ["StoreServer"]

_RECV_SIZE = 256 * 1024
_PREAUTH_MAX_FRAME = 8192
_PIPELINE_SLACK = 1 << 20
"""Bytes a client may queue behind a parked request before it is taken for a flood."""
_JOIN_THRESHOLD = 64 * 1024
"""Replies smaller than this are joined into one buffer; larger ones go out by sendmsg
without copying the values."""
_IOV_MAX = 512
_OK_EMPTY = w.encode_frame(w.OK, [])
_ONE = w.encode_frame(w.OK, [b"1"])
_ZERO = w.encode_frame(w.OK, [b"0"])

Out = Union[bytes, memoryview]

_IN = select.POLLIN
_OUT = select.POLLOUT
_IN_ANY = select.POLLIN | select.POLLERR | select.POLLHUP


def unix_socket_name(ip: str, port: int) -> str:
    """The abstract Unix socket a server bound to ``ip:port`` also listens on."""
    return f"\0gpucoll-store/{ip}:{port}"


class _Poller:
    """epoll where there is one (Linux), poll elsewhere; both take seconds here."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()

    def register(self, fd: int, events: int) -> None:
        if self._epoll is not None:
            self._epoll.register(fd, events)
        else:
            assert self._poll is not None
            self._poll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        if self._epoll is not None:
            self._epoll.modify(fd, events)
        else:
            assert self._poll is not None
            self._poll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        if self._epoll is not None:
            self._epoll.unregister(fd)
        else:
            assert self._poll is not None
            self._poll.unregister(fd)

    def poll(self, timeout: float | None) -> list[tuple[int, int]]:
        if self._epoll is not None:
            return self._epoll.poll(-1 if timeout is None else timeout)
        assert self._poll is not None
        return self._poll.poll(None if timeout is None else timeout * 1000.0)

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


class _Conn:
    __slots__ = ("sock", "inbuf", "out", "authed", "limit", "waiter", "kind", "closing",
                 "writing", "dirty", "big", "big_have")

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.inbuf: bytes | bytearray = b""
        self.out: list[Out] = []
        self.authed = False
        self.limit = _PREAUTH_MAX_FRAME
        self.waiter: Waiter | None = None
        self.kind = 0
        self.closing = False
        self.writing = False
        self.dirty = False
        self.big: bytearray | None = None
        self.big_have = 0


class StoreServer:
    """Listens on ``host:port`` and serves the store protocol from a daemon thread.

    On Linux, a server bound to a loopback or wildcard address, or to one of this
    host's addresses, also listens on an abstract Unix socket named after that
    address and port; clients on the same host use it (a message costs about a third
    of a loopback TCP round trip in CPU).

    Args:
        host: address to bind ("" or "0.0.0.0" for all IPv4 interfaces, "::" for IPv6).
        port: port to bind; 0 picks a free one (read it back from ``.port``).
        token: bytes a client must present in its HELLO, or None for no check.
        max_key_size, max_value_size: limits on one key and one value, in bytes.
        backlog: listen backlog (the kernel caps it at ``net.core.somaxconn``).
        unix_socket: also listen on the abstract Unix socket (Linux only).

    Raises:
        DistNetworkError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, *, token: bytes | None, max_key_size: int,
                 max_value_size: int, backlog: int = 8192, unix_socket: bool = True) -> None:
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        # A multi_set or multi_get may carry several values; one frame holds up to twice the
        # value limit, and no more than a u32 length can say.
        self.max_frame = min(2 * max_value_size + (1 << 20), 0xFFFFFFFF)
        self._token = token
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
        self._listeners = [listener]
        bound = listener.getsockname()
        self.port: int = bound[1]
        self.unix_name: str | None = None
        if unix_socket and hasattr(socket, "AF_UNIX") and sys.platform.startswith("linux"):
            name = unix_socket_name(bound[0], self.port)
            ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                ux.bind(name)
                ux.listen(backlog)
                ux.setblocking(False)
                self._listeners.append(ux)
                self.unix_name = name
            except OSError:
                ux.close()  # the name is taken: clients simply use TCP
        self._poller = _Poller()
        for ls in self._listeners:
            self._poller.register(ls.fileno(), _IN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._poller.register(self._wake_r.fileno(), _IN)
        self._accepting = True
        self._rbuf = bytearray(_RECV_SIZE)
        self._rview = memoryview(self._rbuf)
        self._conns: dict[int, _Conn] = {}
        self._kv = KVState()
        self._timers: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._dirty: list[_Conn] = []
        self._resume: list[_Conn] = []
        self._stop = False
        self._handlers: dict[int, Callable[[_Conn, list[bytes]], None]] = {
            w.SET: self._op_set, w.GET: self._op_get, w.ADD: self._op_add, w.CAS: self._op_cas,
            w.WAIT: self._op_wait, w.CHECK: self._op_check, w.DELETE: self._op_delete,
            w.NUM_KEYS: self._op_num_keys, w.MULTI_SET: self._op_multi_set,
            w.APPEND: self._op_append, w.QPUSH: self._op_qpush, w.QPOP: self._op_qpop,
            w.QLEN: self._op_qlen, w.LIST_KEYS: self._op_list_keys,
        }
        self._thread = threading.Thread(target=self._run, name=f"gpucoll-store-server:{self.port}",
                                        daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Number of client connections currently open."""
        return len(self._conns)

    @property
    def running(self) -> bool:
        """True until the server has stopped."""
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and the listening sockets."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._wake_w.close()

    # -- the loop -------------------------------------------------------------------------

    def _run(self) -> None:
        poll = self._poller.poll
        conns = self._conns
        listeners = {ls.fileno(): ls for ls in self._listeners}
        wake_fd = self._wake_r.fileno()
        try:
            while not self._stop:
                timers = self._timers
                timeout = max(0.0, timers[0][0] - time.monotonic()) if timers else None
                try:
                    events = poll(timeout)
                except InterruptedError:
                    continue
                for fd, ev in events:
                    conn = conns.get(fd)
                    if conn is None:
                        ls = listeners.get(fd)
                        if ls is not None:
                            self._accept(ls)
                        elif fd == wake_fd:
                            self._drain_wake()
                        continue
                    if ev & _OUT:
                        self._send(conn)
                    if ev & _IN_ANY and conn.sock is not None:
                        self._on_readable(conn)
                if self._timers:
                    self._expire()
                while self._resume:
                    resume, self._resume = self._resume, []
                    for conn in resume:
                        if conn.sock is not None:
                            self._process(conn)
                if self._dirty:
                    dirty, self._dirty = self._dirty, []
                    for conn in dirty:
                        conn.dirty = False
                        if conn.sock is not None and not conn.writing:
                            self._send(conn)
        finally:
            for conn in list(conns.values()):
                self._drop(conn)
            self._poller.close()
            for ls in self._listeners:
                ls.close()
            self._wake_r.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop accepting until a connection closes, rather
                    # than spin on a listener that stays readable.
                    for ls in self._listeners:
                        self._poller.unregister(ls.fileno())
                    self._accepting = False
                return
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns[sock.fileno()] = conn
            self._poller.register(sock.fileno(), _IN)

    def _drop(self, conn: _Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        conn.sock = None
        if conn.waiter is not None:
            self._kv.cancel(conn.waiter)
            conn.waiter = None
        conn.out.clear()
        conn.inbuf = b""
        fd = sock.fileno()
        self._conns.pop(fd, None)
        try:
            self._poller.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass
        sock.close()
        if not self._accepting and not self._stop:
            for ls in self._listeners:
                self._poller.register(ls.fileno(), _IN)
            self._accepting = True

    # -- input ----------------------------------------------------------------------------

    def _on_readable(self, conn: _Conn) -> None:
        sock = conn.sock
        assert sock is not None
        if conn.big is not None:
            if self._read_big(conn, sock):
                self._process(conn)
            return
        try:
            # Into one reused buffer: a fresh 256 KiB bytes per recv costs more than the
            # request (malloc, then a shrinking realloc).
            n = sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not n:
            self._drop(conn)
            return
        if conn.inbuf:
            buf = conn.inbuf
            if isinstance(buf, bytes):
                buf = bytearray(buf)
            buf += self._rview[:n]
            conn.inbuf = buf
            if conn.waiter is not None or conn.writing:
                if len(buf) > _PIPELINE_SLACK:
                    self._drop(conn)
                return
            self._process(conn)
            return
        if conn.waiter is not None or conn.writing:
            conn.inbuf = bytes(self._rview[:n])
            return
        self._process(conn, self._rview, n)

    def _process(self, conn: _Conn, view: memoryview | None = None, n: int = 0) -> None:
        """Serve the complete frames buffered for ``conn`` (or, with ``view``, the first
        ``n`` bytes of the shared receive buffer), in order, until one parks."""
        buf: bytes | bytearray | memoryview
        if view is None:
            buf = conn.inbuf
            n = len(buf)
        else:
            buf = view
        pos = 0
        try:
            while n - pos >= 4 and conn.waiter is None and not conn.writing and not conn.closing:
                (length,) = w.U32.unpack_from(buf, pos)
                w.check_length(length, conn.limit)
                end = pos + 4 + length
                if end > n:
                    break
                code = buf[pos + 4]
                fields = w.decode_fields(buf, pos + 5, end)
                pos = end
                self._dispatch(conn, code, fields)
                if conn.sock is None:
                    return
        except w.ProtocolError:
            self._drop(conn)
            return
        if pos == n:
            conn.inbuf = b""
        elif view is not None:
            conn.inbuf = bytearray(view[pos:n])
        elif pos:
            conn.inbuf = buf[pos:]  # type: ignore[assignment]
        rest = conn.inbuf
        if len(rest) >= 4 and conn.authed and conn.waiter is None and not conn.writing:
            (length,) = w.U32.unpack_from(rest, 0)
            if length + 4 > _RECV_SIZE:
                # Too big for one read: give it a buffer of its final size now.
                big = bytearray(length + 4)
                big[:len(rest)] = rest
                conn.big = big
                conn.big_have = len(rest)
                conn.inbuf = b""
        # Everything this read produced goes out in one send, now.
        if conn.out and not conn.writing:
            self._send(conn)

    def _read_big(self, conn: _Conn, sock: socket.socket) -> bool:
        """Receive into the buffer of a large frame that is arriving, allocated at its
        final size once its header was seen (the size is within the connection's
        authenticated frame limit). Returns True once the frame is complete."""
        big = conn.big
        assert big is not None
        view = memoryview(big)
        try:
            while conn.big_have < len(big):
                got = sock.recv_into(view[conn.big_have:])
                if not got:
                    self._drop(conn)
                    return False
                conn.big_have += got
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self._drop(conn)
            return False
        finally:
            view.release()
        conn.big = None
        conn.inbuf = big
        return True

    def _dispatch(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        if not conn.authed:
            self._hello(conn, code, fields)
            return
        w.check_arity(code, len(fields))
        try:
            self._handlers[code](conn, fields)
        except DistStoreError as e:
            self._reply(conn, w.ERROR, [str(e).encode()])
        except w.ProtocolError:
            raise
        except Exception as e:  # a server bug must not take the other clients down
            self._reply(conn, w.ERROR, [f"server error in {w.NAMES[code]}: "
                                        f"{type(e).__name__}: {e}".encode()])
            conn.closing = True

    def _hello(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        if code != w.HELLO or len(fields) != 3 or fields[0][:4] != w.MAGIC or len(fields[0]) != 6:
            raise w.ProtocolError("the first frame must be HELLO")
        version = int.from_bytes(fields[0][4:6], "little")
        if version != w.VERSION:
            self._reply(conn, w.ERROR, [f"protocol version {version} is not supported; "
                                        f"this server speaks version {w.VERSION}".encode()])
            conn.closing = True
            return
        if self._token is not None and not hmac.compare_digest(fields[1], self._token):
            self._reply(conn, w.ERROR, [b"token rejected: the client's token does not match the "
                                        b"server's (GPUCOLL_STORE_TOKEN)"])
            conn.closing = True
            return
        conn.authed = True
        conn.limit = self.max_frame
        self._reply(conn, w.OK, [str(self.max_key_size).encode(), str(self.max_value_size).encode(),
                                 str(self.max_frame).encode()])

    # -- output ---------------------------------------------------------------------------

    def _queue(self, conn: _Conn, frame: bytes) -> None:
        conn.out.append(frame)

    def _reply(self, conn: _Conn, code: int, fields: list[bytes]) -> None:
        size = 1 + 4 * len(fields) + sum(map(len, fields))
        if size < _JOIN_THRESHOLD:
            conn.out.append(w.encode_frame(code, fields))
            return
        out = conn.out
        out.append(w.HEADER.pack(size, code))
        for f in fields:
            out.append(w.U32.pack(len(f)))
            out.append(f)

    def _reply_later(self, conn: _Conn) -> None:
        """Flush ``conn`` at the end of this loop iteration (a reply made while serving
        another connection)."""
        if not conn.dirty:
            conn.dirty = True
            self._dirty.append(conn)

    def _send(self, conn: _Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        out = conn.out
        try:
            while out:
                if len(out) == 1:
                    sent = sock.send(out[0])
                else:
                    if len(out) > 2 and sum(map(len, out)) < _JOIN_THRESHOLD:
                        out[:] = [b"".join(out)]
                        continue
                    sent = sock.sendmsg(out[:_IOV_MAX])
                drop = 0
                for part in out:
                    size = len(part)
                    if sent < size:
                        break
                    sent -= size
                    drop += 1
                del out[:drop]
                if sent:
                    out[0] = memoryview(out[0])[sent:]
        except (BlockingIOError, InterruptedError):
            if not conn.writing:
                conn.writing = True
                self._poller.modify(sock.fileno(), _IN | _OUT)
            return
        except OSError:
            self._drop(conn)
            return
        if conn.closing:
            self._drop(conn)
            return
        if conn.writing:
            conn.writing = False
            self._poller.modify(sock.fileno(), _IN)
            if conn.inbuf:
                self._resume.append(conn)

    # -- waiting --------------------------------------------------------------------------

    def _park(self, conn: _Conn, keys: list[bytes], timeout: float, kind: int,
              queue: bool) -> None:
        if queue:
            got = self._kv.queue_pop_or_watch(keys[0], self._ready, conn)
            if not isinstance(got, Waiter):
                self._reply(conn, w.OK, [got])
                return
        else:
            got2 = self._kv.get_or_watch(keys, self._ready, conn)
            if not isinstance(got2, Waiter):
                if kind == w.WAIT:
                    self._queue(conn, _OK_EMPTY)
                else:
                    self._reply(conn, w.OK, got2)
                return
            got = got2
        conn.waiter = got
        conn.kind = kind
        heapq.heappush(self._timers, (time.monotonic() + timeout, next(self._seq), got))

    def _ready(self, waiter: Waiter, values: list[bytes]) -> None:
        conn: _Conn = waiter.ctx
        conn.waiter = None
        if conn.sock is None:
            return
        if conn.kind == w.WAIT:
            self._queue(conn, _OK_EMPTY)
        else:
            self._reply(conn, w.OK, values)
        self._reply_later(conn)
        if conn.inbuf:
            self._resume.append(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, waiter = heapq.heappop(timers)
            if not waiter.active:
                continue
            self._kv.cancel(waiter)
            conn: _Conn = waiter.ctx
            conn.waiter = None
            if conn.sock is None:
                continue
            missing = waiter.keys if waiter.queue else self._kv.missing(waiter.keys)
            self._reply(conn, w.TIMEOUT, missing)
            self._reply_later(conn)
            if conn.inbuf:
                self._resume.append(conn)

    # -- requests -------------------------------------------------------------------------

    def _key(self, key: bytes) -> bytes:
        if len(key) > self.max_key_size:
            raise DistStoreError(f"key of {len(key)} bytes exceeds the server's limit of "
                                 f"{self.max_key_size} bytes")
        return key

    def _value(self, value: bytes) -> bytes:
        if len(value) > self.max_value_size:
            raise DistStoreError(f"value of {len(value)} bytes exceeds the server's limit of "
                                 f"{self.max_value_size} bytes")
        return value

    def _op_set(self, conn: _Conn, f: list[bytes]) -> None:
        self._kv.set(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_get(self, conn: _Conn, f: list[bytes]) -> None:
        self._blocking_read(conn, f, w.GET)

    def _op_wait(self, conn: _Conn, f: list[bytes]) -> None:
        self._blocking_read(conn, f, w.WAIT)

    def _blocking_read(self, conn: _Conn, f: list[bytes], kind: int) -> None:
        timeout = w.parse_timeout(f[0])
        keys = f[1:]
        if timeout <= 0:
            missing = self._kv.missing(keys)
            if missing:
                self._reply(conn, w.TIMEOUT, missing)
                return
        self._park(conn, keys, max(timeout, 0.0), kind, queue=False)

    def _op_add(self, conn: _Conn, f: list[bytes]) -> None:
        total = self._kv.add(self._key(f[0]), w.parse_int(f[1], "add amount"))
        self._queue(conn, w.encode_frame(w.OK, [str(total).encode()]))

    def _op_cas(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, [self._kv.compare_set(self._key(f[0]), f[1], self._value(f[2]))])

    def _op_check(self, conn: _Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self._kv.check(f) else _ZERO)

    def _op_delete(self, conn: _Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self._kv.delete(f[0]) else _ZERO)

    def _op_num_keys(self, conn: _Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self._kv.num_keys()).encode()]))

    def _op_multi_set(self, conn: _Conn, f: list[bytes]) -> None:
        for i in range(0, len(f), 2):
            self._key(f[i])
            self._value(f[i + 1])
        for i in range(0, len(f), 2):
            self._kv.set(f[i], f[i + 1])
        self._queue(conn, _OK_EMPTY)

    def _op_append(self, conn: _Conn, f: list[bytes]) -> None:
        key = self._key(f[0])
        current = self._kv.data.get(key, b"")
        if len(current) + len(f[1]) > self.max_value_size:
            raise DistStoreError(f"append would grow the value to {len(current) + len(f[1])} bytes, "
                                 f"over the server's limit of {self.max_value_size} bytes")
        self._kv.append(key, f[1])
        self._queue(conn, _OK_EMPTY)

    def _op_qpush(self, conn: _Conn, f: list[bytes]) -> None:
        self._kv.queue_push(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_qpop(self, conn: _Conn, f: list[bytes]) -> None:
        timeout = w.parse_timeout(f[0])
        if timeout <= 0:
            value = self._kv.queue_pop_now(f[1])
            if value is None:
                self._queue(conn, w.encode_frame(w.EMPTY, []))
            else:
                self._reply(conn, w.OK, [value])
            return
        self._park(conn, [f[1]], timeout, w.QPOP, queue=True)

    def _op_qlen(self, conn: _Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self._kv.queue_len(f[0])).encode()]))

    def _op_list_keys(self, conn: _Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, self._kv.list_keys())

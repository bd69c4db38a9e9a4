"""The TCPStore server's network side: one epoll loop on a background thread.

What a request does, and what it answers, is in :mod:`._requests`; this module
moves bytes (see docs/stores.md):

* One thread, one epoll set (a ``selectors`` set elsewhere), non-blocking sockets: thousands
  of connections cost one entry each, not a thread each. Each connection speaks
  gpucoll's protocol or torch's, told apart by its first bytes.
* Each ready connection is read into one reused buffer; every complete frame in it is
  served and the replies leave in one send. Replies that a write produces for parked
  requests on other connections leave at the end of the loop iteration.
* A frame too large for one read gets a buffer that grows with what arrives (never
  more than twice what was received, plus one chunk): an announced length costs
  nothing until its bytes come. Large replies leave by sendmsg without being copied.
* Anything that does not parse, a wrong token, or an absurd length drops that
  connection only. Nothing here resolves names.
* A connection that has not said HELLO (or torch's PING) within ``hello_timeout`` is
  dropped, and at most ``max_pending`` such connections are kept (the oldest goes
  first): idle or slow connections cannot hold the server's descriptors. Out of
  descriptors, the server drops its oldest such connection to accept a new one.
* Fairness: one connection's turn serves at most ``_TURN_FRAMES`` frames; the rest of
  its input waits for the next loop iteration, behind every other ready connection.

Torch's protocol is served by :mod:`._torch_serve`.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import sys
import threading
import time

from ..errors import DistNetworkError
from . import _native, _wire as w
from . import _torch_wire as tw
from ._sockets import IN as _IN, IN_ANY as _IN_ANY, OUT as _OUT, FD_RESERVE, forget
from ._sockets import NODELAY_INHERITED, accept_queues, listen, new_poller, nofile_for, peer_uid, read_big, unix_socket_name
from ._requests import OK_HEADS, JOIN_THRESHOLD, PIPELINE_SLACK, Requests, Conn
from ._mux import MuxHub
from ._torch_serve import process_torch, read_torch

__all__ = ["StoreServer"]

_RECV_SIZE = 256 * 1024
"""A large frame's buffer starts at most this big and at most doubles per growth."""
HELLO_TIMEOUT = 5.0
"""Seconds a new connection has to say HELLO (torch's clients: VALIDATE and PING)."""
_TURN_FRAMES = 64
"""Frames served from one connection before the others get their turn."""
_HEADER, _TCP, _NODELAY = w.HEADER, socket.IPPROTO_TCP, socket.TCP_NODELAY
_IOV_MAX = 512


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
        hello_timeout: seconds a new connection has to complete its HELLO.
        max_pending: connections without a completed HELLO kept at most; None: the
            open-file limit less FD_RESERVE (a whole job connecting at once has that
            many HELLOs on their way, and a dropped one only comes back).
        expected_clients: the job's world size, or None. The open-file limit is raised
            to the hard limit first; one too low for these clients is refused now.

    Raises:
        DistNetworkError: the address cannot be bound.
        DistStoreError: the open-file limit cannot hold ``expected_clients``.
    """

    def __init__(self, host: str, port: int, *, token: bytes | None, max_key_size: int,
                 max_value_size: int, backlog: int = 8192, unix_socket: bool = True,
                 listen_fd: int | None = None, hello_timeout: float = HELLO_TIMEOUT,
                 max_pending: int | None = None, expected_clients: int | None = None) -> None:
        # The store's protocol and state; this object owns the sockets and the loop.
        self.requests = Requests(token=token, max_key_size=max_key_size, max_value_size=max_value_size)
        self.native = _native.module()  # the compiled repeated ADD, or None (see _native)
        self.hello_timeout = float(hello_timeout)
        soft = nofile_for(expected_clients)
        room = max(1, soft - FD_RESERVE) if 0 < soft != resource.RLIM_INFINITY else 1 << 20
        self.max_pending = room if max_pending is None else max(1, min(room, max_pending))
        self._later: list[Conn] = []
        """Connections whose turn ended with whole frames still buffered."""
        if listen_fd is not None:
            # A socket the caller bound and listens on (torch's master_listen_fd).
            try:
                listener = socket.socket(fileno=listen_fd)
                listener.setblocking(False)
            except OSError as e:
                raise DistNetworkError(f"TCPStore server cannot use listen_fd={listen_fd}: {e}") from e
            self._listeners = [listener]
        else:
            self._listeners = listen(host, port, backlog, accept_queues(expected_clients, backlog))
        bound = self._listeners[0].getsockname()
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
        self._poller = new_poller()
        for ls in self._listeners:
            self._poller.register(ls.fileno(), _IN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._poller.register(self._wake_r.fileno(), _IN)
        self._accepting = True
        self._rbuf = bytearray(_RECV_SIZE)
        self._rview = memoryview(self._rbuf)
        self._conns: dict[int, Conn] = {}
        self.mux = MuxHub(self)  # relays' multiplexed connections (see _mux)
        self._stop = False
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
        req = self.requests
        rbuf = self._rbuf
        data = req.kv.data
        heads = OK_HEADS
        heads_n, head_size = len(heads), len(heads[0])  # values below heads_n characters
        ready = _IN
        on_event = self._on_event
        on_input = self._on_input
        native, epfd = self.native, self._poller.fileno()
        # The counter text this loop wrote last and its value: a counter holding that very object
        # is not parsed again. It starts as an object no key can hold (b"" and 1-byte are shared).
        hot_text = b"%d" % (1 << 70)
        hot_value = 1 << 70
        try:
            while not self._stop:
                if req.timers or req.pending or self._later:
                    timers = req.timers
                    timeout = (min(max(0.0, timers[0][0] - time.monotonic()), w.MAX_TIMEOUT)
                               if timers else None)
                    if req.pending:
                        first = max(0.0, next(iter(req.pending.values())) - time.monotonic())
                        timeout = first if timeout is None else min(timeout, first)
                    if self._later:
                        timeout = 0.0
                else:
                    timeout = None
                try:
                    events = (poll(-1 if timeout is None else timeout) if native is None else _native.wait(
                        self, native.run, epfd, -1.0 if timeout is None else timeout, conns, data, rbuf, heads))
                except InterruptedError:
                    continue
                for fd, ev in events:
                    try:
                        conn = conns[fd]  # (a subscript: no call, as get() takes)
                    except KeyError:
                        self._on_other(fd)  # a listener or the wake-up socket
                        continue
                    try:
                        # The hottest request, served here: the connection's last ADD frame
                        # again (quick_add's first case, without the calls). A failed test
                        # hands over at once (to _on_event, or after the read to _on_input).
                        if (ev != ready or not conn.authed or conn.closing or conn.later or conn.inbuf
                                or conn.out or conn.writing or conn.big is not None
                                or conn.waiter is not None):
                            on_event(conn, ev)
                            continue
                        sock = conn.sock
                        try:
                            n = sock.recv_into(rbuf)  # type: ignore[union-attr]
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            n = 0
                        if not n:
                            self._drop(conn)
                            continue
                        frame, size, key, amount = conn.last_add
                        if n != size or not rbuf.startswith(frame):
                            on_input(conn, sock, n)  # type: ignore[arg-type]
                            continue
                        try:
                            current = data[key]
                        except KeyError:  # deleted: the general path adds it anew
                            on_input(conn, sock, n)  # type: ignore[arg-type]
                            continue
                        if current is hot_text:
                            value = hot_value + amount
                        elif len(current) >= 20:
                            on_input(conn, sock, n)  # type: ignore[arg-type]
                            continue
                        else:
                            try:
                                value = int(current) + amount
                            except ValueError:
                                on_input(conn, sock, n)  # type: ignore[arg-type]
                                continue
                        total = b"%d" % value
                        size = len(total)
                        if size >= heads_n:
                            on_input(conn, sock, n)  # type: ignore[arg-type]
                            continue
                        data[key] = total
                        hot_text = total
                        hot_value = value
                        reply = heads[size] + total
                        sent = sock.send(reply)  # type: ignore[union-attr]
                        if sent != size + head_size:
                            conn.out.append(memoryview(reply)[sent:])
                            self._send(conn)
                    except Exception:  # a bug serving one client must not stop the server
                        self._drop(conn)
                if req.timers:
                    req.expire()
                if req.pending:
                    req.expire_pending(self._drop)
                if self._later:
                    later, self._later = self._later, []
                    for conn in later:
                        conn.later = False
                        if conn.sock is not None and conn.waiter is None and not conn.writing:
                            try:
                                self._process(conn)
                            except Exception:
                                self._drop(conn)
                while req.resume:
                    resume, req.resume = req.resume, []
                    for conn in resume:
                        if conn.sock is not None:
                            try:
                                self._process(conn)
                            except Exception:
                                self._drop(conn)
                while req.dirty:  # a channel's reply makes its relay's connection dirty
                    dirty, req.dirty = req.dirty, []
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

    def _on_other(self, fd: int) -> None:
        """An event on a descriptor that is not a connection: a listener or the wake-up."""
        for ls in self._listeners:
            if ls.fileno() == fd:
                self._accept(ls)
                return
        if fd == self._wake_r.fileno():
            self._drain_wake()

    def _on_event(self, conn: Conn, ev: int) -> None:
        """An event on ``conn`` that the loop's repeated-add path does not serve."""
        if ev == _IN:
            if not conn.later:  # (a later one is served at the end of the loop iteration)
                self._on_readable(conn)
            return
        if ev & _OUT:
            self._send(conn)
        if ev & _IN_ANY and conn.sock is not None and not conn.later:
            self._on_readable(conn)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        # Once per call, not per connection: a socket's .family builds an enum each time.
        unix = listener.family == socket.AF_UNIX
        nodelay = not unix and not (NODELAY_INHERITED and listener.getsockopt(_TCP, _NODELAY))
        eager = True
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: drop the oldest connection that has not said HELLO; with
                    # none, stop accepting until one closes (not spin on a readable listener).
                    if self.requests.evict_pending(self._drop):
                        continue
                    for ls in self._listeners:
                        self._poller.unregister(ls.fileno())
                    self._accepting = False
                return
            if unix:
                # Same host, by the abstract name: this user's processes and root's; others come by TCP (token).
                if peer_uid(sock) not in (os.getuid(), 0):
                    sock.close()
                    continue
            elif nodelay:
                sock.setsockopt(_TCP, _NODELAY, 1)
            sock.setblocking(False)
            conn = Conn(sock)
            if len(self.requests.pending) >= self.max_pending:
                self.requests.evict_pending(self._drop)
            self.requests.pending[conn] = time.monotonic() + self.hello_timeout
            self._conns[sock.fileno()] = conn
            self._poller.register(sock.fileno(), _IN)
            # A client sends HELLO right after connecting: it is often here already, and
            # answering it now saves a trip through epoll. Once one is not (a burst), the
            # rest of this batch waits for epoll rather than read nothing, one call each.
            if eager:
                try:
                    self._on_readable(conn)
                except Exception:  # as in the loop: one bad client never stops the server
                    self._drop(conn)
                eager = conn.authed or conn.torch or bool(conn.inbuf)

    def _drop(self, conn: Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        conn.sock = None
        self.requests.pending.pop(conn, None)
        if conn.waiter is not None:
            self.requests.kv.cancel(conn.waiter)
            conn.waiter = None
        conn.out.clear()
        conn.inbuf = b""
        fd = sock.fileno()
        self._conns.pop(fd, None)
        forget(self._poller, fd)
        sock.close()
        if not self._accepting and not self._stop:
            for ls in self._listeners:
                self._poller.register(ls.fileno(), _IN)
            self._accepting = True

    # -- input ----------------------------------------------------------------------------

    def _on_readable(self, conn: Conn) -> None:
        sock = conn.sock
        assert sock is not None
        if not conn.authed or conn.closing or conn.big is not None:
            if conn.big is not None:
                done = read_big(conn, sock)
                if done is None:
                    self._drop(conn)
                elif done:
                    self._process(conn)
                return
            if conn.torch:
                read_torch(self, conn, sock)
                return
        try:
            # Into one reused buffer: a fresh 256 KiB bytes per recv costs more than the request.
            n = sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not n:
            self._drop(conn)
            return
        self._on_input(conn, sock, n)

    def _on_input(self, conn: Conn, sock: socket.socket, n: int) -> None:
        """Serve the ``n`` bytes just read from ``conn`` into the shared receive buffer."""
        if (conn.authed and not (conn.closing or conn.inbuf or conn.out or conn.writing) and conn.big is None
                and conn.waiter is None):
            # The common case, one whole request in this read from a connection with nothing
            # pending: served without _process's bookkeeping (same checks, same order). First
            # a counter's ADD, most often this connection's last frame again (quick_add), then
            # a GET of a key that is set.
            reply = self.requests.quick_add(conn, self._rbuf, n)
            if reply is None:
                reply = self.requests.quick_get(conn, self._rbuf, n)
            if reply is not None:
                try:
                    sent = sock.send(reply)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    self._drop(conn)
                    return
                if sent != len(reply):
                    conn.out.append(memoryview(reply)[sent:])
                    self._send(conn)
                return
            if n >= 5:
                length, code = _HEADER.unpack_from(self._rbuf)
                if n == length + 4 and length <= conn.limit:
                    try:
                        fields = w.decode_fields(self._rview, 5, n)
                        self.requests.dispatch(conn, code, fields)
                    except w.ProtocolError:
                        self._drop(conn)
                        return
                    if conn.out and conn.sock is not None and not conn.writing:
                        self._send(conn)
                    return
            self._process(conn, self._rview, n)
            return
        if conn.inbuf:
            buf = conn.inbuf
            if isinstance(buf, bytes):
                buf = bytearray(buf)
            buf += self._rview[:n]
            conn.inbuf = buf
            if conn.waiter is not None or conn.writing:
                if len(buf) > PIPELINE_SLACK:
                    self._drop(conn)
                return
            self._process(conn)
            return
        if conn.waiter is not None or conn.writing:
            conn.inbuf = bytes(self._rview[:n])
            return
        self._process(conn, self._rview, n)

    def _process(self, conn: Conn, view: memoryview | None = None, n: int = 0) -> None:
        """Serve the complete frames buffered for ``conn`` (or, with ``view``, the first
        ``n`` bytes of the shared receive buffer), in order, until one parks."""
        if conn.torch:
            self._process_torch(conn)
            return
        buf: bytes | bytearray | memoryview
        if view is None:
            buf = conn.inbuf
            n = len(buf)
        else:
            buf = view
        if not conn.authed and n and buf[0] == 0:
            # gpucoll's HELLO never starts with a zero byte (see tcp.py); torch's VALIDATE does.
            if n < len(tw.PREFIX):
                conn.inbuf = bytes(buf[:n])
                return
            if bytes(buf[:len(tw.PREFIX)]) != tw.PREFIX:
                self._drop(conn)
                return
            conn.torch = True
            conn.inbuf = bytes(buf[:n])
            self._process_torch(conn)
            return
        pos = 0
        unpack = w.U32.unpack_from
        turn = _TURN_FRAMES
        try:
            while n - pos >= 4 and conn.waiter is None and not conn.writing and not conn.closing:
                (length,) = unpack(buf, pos)
                if not 0 < length <= conn.limit:
                    w.check_length(length, conn.limit)  # raises, with the message
                end = pos + 4 + length
                if end > n:
                    break
                if not turn:
                    # The others' turn: the rest waits for the next loop iteration.
                    if not conn.later:
                        conn.later = True
                        self._later.append(conn)
                    break
                turn -= 1
                code = buf[pos + 4]
                fields = w.decode_fields(buf, pos + 5, end)
                pos = end
                self.requests.dispatch(conn, code, fields)
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
        if (len(rest) >= 4 and conn.authed and conn.waiter is None and not conn.writing
                and not conn.later):
            (length,) = w.U32.unpack_from(rest, 0)
            if length + 4 > _RECV_SIZE:
                # Too big for one read: it gets a buffer that grows as its bytes arrive
                # (see _sockets.read_big), never one of the announced size up front.
                conn.big = bytearray(rest)
                conn.big_have = len(rest)
                conn.big_need = length + 4
                conn.inbuf = b""
        # Everything this read produced goes out in one send, now.
        if conn.out and not conn.writing:
            self._send(conn)

    # -- torch's protocol -----------------------------------------------------------------

    def _process_torch(self, conn: Conn) -> None:
        process_torch(self, conn)

    # -- output ---------------------------------------------------------------------------

    def _send(self, conn: Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        out = conn.out
        if len(out) == 1 and not conn.closing and not conn.writing:
            # One reply, sent whole: the usual case.
            part = out[0]
            try:
                sent = sock.send(part)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            if sent == len(part):
                out.clear()
                return
            if sent:
                out[0] = memoryview(part)[sent:]
        try:
            while out:
                if len(out) == 1:
                    sent = sock.send(out[0])
                else:
                    if len(out) > 2 and sum(map(len, out)) < JOIN_THRESHOLD:
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
                self.requests.resume.append(conn)


"""A node-local store relay: this node's store clients over ONE connection to the server.

gpucoll-run's agent runs one per node when relays are on (see docs/launching.md and
docs/scaling.md): the node's ranks connect to the relay, at the address in
``GPUCOLL_STORE_RELAY``, as if it were the job's store, and the relay carries each of
their connections as a channel of one multiplexed connection to the job's store server
(see ``_mux``), so the server holds one connection per node, not one per rank.

The relay does not read the store protocol: it moves bytes. Each client connection's
bytes go up as MUX_DATA frames tagged with its channel; what comes down for a channel
goes to its client as it came. A client's HELLO (and its token) is checked by the
server itself, and a ``wait`` parked on the server parks only its own channel.

If the relay's upstream connection breaks, the relay closes every client connection
and stops listening: its ranks' next or parked request fails at once with a
DistNetworkError naming the relay. If the relay itself dies, the kernel closes those
connections, with the same result.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Final

from .._env import STORE_RELAY_ENV
from .._timeouts import Backoff
from ..errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from . import _wire as w
from ._mux import CHANNEL, MUX_CLOSE, MUX_DATA, close_frame, data_frame
from ._sockets import IN, IN_ANY, OUT, new_poller, peer_uid, unix_socket_name

if TYPE_CHECKING:
    from .tcp import TCPStore

__all__ = ["StoreRelay", "relay_address", "relay_client"]

_CHUNK: Final = 256 * 1024
_JOIN: Final = 64 * 1024


class _Client:
    __slots__ = ("sock", "channel", "out", "writing", "closing")

    def __init__(self, sock: socket.socket, channel: int) -> None:
        self.sock = sock
        self.channel = channel
        self.out: list[bytes] = []
        self.writing = False
        self.closing = False


class StoreRelay:
    """Serves store clients on ``host:port`` over one connection to ``upstream``.

    Args:
        upstream_host, upstream_port: the job's store server.
        token: the job's store token (the relay's own HELLO presents it), or None.
        host: address to listen on for this node's clients (default loopback).
        port: port to listen on; 0 picks a free one (read it back from ``.port``).
        timeout: seconds to wait for the upstream server to accept and answer HELLO.

    Raises:
        DistStoreTimeoutError: the server did not answer within ``timeout``.
        DistNetworkError: it cannot be reached, or the address cannot be bound.
        DistStoreError: the server refused the relay (a wrong token).
    """

    def __init__(self, upstream_host: str, upstream_port: int, *, token: str | bytes | None,
                 host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0) -> None:
        self.upstream = f"{upstream_host}:{upstream_port}"
        tok = token.encode() if isinstance(token, str) else token
        self._up = _connect_upstream(upstream_host, upstream_port, tok, float(timeout))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._listener.bind((host, port))
            self._listener.listen(4096)
        except OSError as e:
            self._listener.close()
            self._up.close()
            raise DistNetworkError(f"store relay cannot listen on {host}:{port}: {e}") from e
        self._listener.setblocking(False)
        self._up.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._listeners = [self._listener]
        if hasattr(socket, "AF_UNIX") and sys.platform.startswith("linux"):
            # As the server does: the node's ranks reach it through an abstract Unix
            # socket named after its address (a message costs about a third of a
            # loopback TCP round trip); TCP stays open for the rest.
            ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                ux.bind(unix_socket_name(self._listener.getsockname()[0], self.port))
                ux.listen(4096)
                ux.setblocking(False)
                self._listeners.append(ux)
            except OSError:
                ux.close()
        self.error: str | None = None
        """Why the relay stopped on its own (its upstream connection broke), or None."""
        self._clients: dict[int, _Client] = {}
        self._by_channel: dict[int, _Client] = {}
        self._next_channel = 0
        self._up_out: list[bytes] = []
        self._up_in = bytearray()
        self._up_writing = False
        self._rbuf = bytearray(_CHUNK)
        self._rview = memoryview(self._rbuf)
        self._poller = new_poller()
        for ls in self._listeners:
            self._poller.register(ls.fileno(), IN)
        self._poller.register(self._up.fileno(), IN)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._poller.register(self._wake_r.fileno(), IN)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"gpucoll-store-relay:{self.port}",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` for ``GPUCOLL_STORE_RELAY``."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def clients(self) -> int:
        """Client connections currently carried."""
        return len(self._clients)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop: close every client connection, the listener and the upstream connection."""
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._wake_w.close()

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        listeners = {ls.fileno(): ls for ls in self._listeners}
        ufd, wfd = self._up.fileno(), self._wake_r.fileno()
        clients = self._clients
        try:
            while not self._stop:
                try:
                    events = self._poller.poll(-1)
                except InterruptedError:
                    continue
                for fd, ev in events:
                    if fd == ufd:
                        if ev & OUT:
                            self._flush_up()
                        if ev & IN_ANY and not self._read_up():
                            return
                    elif fd in listeners:
                        self._accept(listeners[fd])
                    elif fd == wfd:
                        break
                    else:
                        c = clients.get(fd)
                        if c is None:
                            continue
                        if ev & OUT:
                            self._flush(c)
                        if ev & IN_ANY and c.sock.fileno() >= 0:
                            self._read(c)
                if self._up_out and not self._up_writing:
                    self._flush_up()
                if self.error is not None:
                    return
            if self._stop and self.error is None:
                self._drain()
        except Exception as e:  # never a silent stop: the clients see their connections close
            self.error = f"store relay {self.address} failed: {type(e).__name__}: {e}"
        finally:
            for c in list(clients.values()):
                c.sock.close()
            clients.clear()
            self._by_channel.clear()
            self._poller.close()
            for ls in self._listeners:
                ls.close()
            self._up.close()
            self._wake_r.close()

    def _drain(self, timeout: float = 2.0) -> None:
        """On close: what clients sent before they closed (a last ``set`` with no reply)
        still reaches the store, and the store reads it before the connection ends."""
        for c in list(self._clients.values()):
            while c.sock.fileno() >= 0:
                before = len(self._up_out)
                self._read(c)
                if len(self._up_out) == before:
                    break
        deadline = time.monotonic() + timeout
        up = self._up
        try:
            up.setblocking(True)
            up.settimeout(timeout)
            for part in self._up_out:
                up.sendall(part)
            self._up_out.clear()
            up.shutdown(socket.SHUT_WR)
            # Until the store closes its end: it has read everything by then.
            while time.monotonic() < deadline and up.recv(_CHUNK):
                pass
        except OSError:
            pass

    def _accept(self, listener: socket.socket) -> None:
        unix = listener.family == socket.AF_UNIX
        eager = True
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors: the client retries its connect
            if unix and peer_uid(sock) not in (os.getuid(), 0):
                sock.close()  # only this user's processes: others come by TCP
                continue
            sock.setblocking(False)
            self._next_channel = (self._next_channel + 1) & 0xFFFFFFFF
            while self._next_channel in self._by_channel:
                self._next_channel = (self._next_channel + 1) & 0xFFFFFFFF
            c = _Client(sock, self._next_channel)
            self._clients[sock.fileno()] = c
            self._by_channel[c.channel] = c
            self._poller.register(sock.fileno(), IN)
            if eager:
                # Its HELLO is often here already: saves a trip through epoll. Once one
                # is not (a burst), the rest of this batch waits for epoll.
                before = len(self._up_out)
                self._read(c)
                eager = len(self._up_out) > before

    def _read(self, c: _Client) -> None:
        try:
            # Into one reused buffer: a fresh 256 KiB bytes per recv costs more than the
            # request (as in the server).
            n = c.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n:
            self._up_out.append(data_frame(c.channel, self._rview[:n]))
            return
        self._up_out.append(close_frame(c.channel))
        self._forget(c)

    def _forget(self, c: _Client) -> None:
        self._clients.pop(c.sock.fileno(), None)
        self._by_channel.pop(c.channel, None)
        c.sock.close()

    def _flush(self, c: _Client) -> None:
        out = c.out
        try:
            while out:
                sent = c.sock.send(out[0])
                if sent == len(out[0]):
                    out.pop(0)
                else:
                    out[0] = out[0][sent:]
        except (BlockingIOError, InterruptedError):
            if not c.writing:
                c.writing = True
                self._poller.modify(c.sock.fileno(), IN | OUT)
            return
        except OSError:
            self._up_out.append(close_frame(c.channel))
            self._forget(c)
            return
        if c.closing:
            self._forget(c)
        elif c.writing:
            c.writing = False
            self._poller.modify(c.sock.fileno(), IN)

    def _read_up(self) -> bool:
        try:
            n = self._up.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as e:
            self.error = f"store relay {self.address} lost its connection to the store at {self.upstream}: {e}"
            return False
        if not n:
            self.error = f"store relay {self.address}: the store at {self.upstream} closed the connection"
            return False
        buf = self._up_in
        if buf:
            buf += self._rview[:n]
            view = memoryview(buf)
            total = len(buf)
        else:
            # The usual case: whole frames in this read, taken from the receive buffer
            # itself and sent on without a copy.
            view = self._rview
            total = n
        try:
            pos = self._deliver(view, total)
        finally:
            if buf:
                view.release()
        if pos is None:
            return False
        if buf:
            del buf[:pos]
        elif pos < total:
            buf += self._rview[pos:total]
        return True

    def _deliver(self, view: memoryview, n: int) -> int | None:
        """Hand the whole frames in ``view[:n]`` to their clients; return the bytes used,
        or None when the store sent something other than a channel's frame."""
        pos = 0
        head, chan, by_channel = w.HEADER.unpack_from, CHANNEL.unpack_from, self._by_channel
        while n - pos >= 5:
            length, code = head(view, pos)
            end = pos + 4 + length
            if end > n:
                break
            if code == MUX_DATA and length >= 13:
                c = by_channel.get(chan(view, pos + 9)[0])
                if c is not None:
                    self._write(c, view[pos + 17:end])
            elif code == MUX_CLOSE and length >= 9:
                c = by_channel.get(chan(view, pos + 9)[0])
                if c is not None:
                    c.closing = True
                    if not c.out:
                        self._forget(c)
            else:
                fields = w.decode_fields(view, pos + 5, end)
                why = fields[0].decode(errors="replace") if fields else f"code {code}"
                self.error = f"store relay {self.address}: the store at {self.upstream} answered: {why}"
                return None
            pos = end
        return pos

    def _write(self, c: _Client, data: memoryview) -> None:
        """Send ``data`` to ``c`` now, or queue what does not fit behind what waits."""
        if c.out or c.writing:
            c.out.append(bytes(data))
            return
        try:
            sent = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._up_out.append(close_frame(c.channel))
            self._forget(c)
            return
        if sent < len(data):
            c.out.append(bytes(data[sent:]))
            c.writing = True
            self._poller.modify(c.sock.fileno(), IN | OUT)

    def _flush_up(self) -> None:
        out = self._up_out
        try:
            while out:
                if len(out) > 1 and sum(map(len, out[:64])) < _JOIN:
                    out[:64] = [b"".join(out[:64])]
                sent = self._up.send(out[0])
                if sent == len(out[0]):
                    out.pop(0)
                else:
                    out[0] = out[0][sent:]
        except (BlockingIOError, InterruptedError):
            if not self._up_writing:
                self._up_writing = True
                self._poller.modify(self._up.fileno(), IN | OUT)
            return
        except OSError as e:
            self.error = f"store relay {self.address} lost its connection to the store at {self.upstream}: {e}"
            return
        if self._up_writing:
            self._up_writing = False
            self._poller.modify(self._up.fileno(), IN)


def _connect_upstream(host: str, port: int, token: bytes | None, timeout: float) -> socket.socket:
    """Connect to the store server over TCP and say HELLO; retry refusals until ``timeout``."""
    deadline = time.monotonic() + timeout
    wait = Backoff(timeout, first=0.01, cap=0.5)
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(0.05, deadline - time.monotonic()))
            break
        except (ConnectionRefusedError, TimeoutError) as e:
            if not wait.sleep():
                raise DistStoreTimeoutError(f"store relay: could not connect to the store at "
                                            f"{host}:{port} within {timeout:g} s: {e}") from e
        except OSError as e:
            raise DistNetworkError(f"store relay: cannot connect to the store at {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tok = token or b""
        pad = b"" if (19 + len(tok)) % 256 else b"\x01"  # a HELLO never starts with a zero byte
        sock.sendall(w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"), tok, pad]))
        reader = w.FrameReader(1 << 20)
        frames: list[tuple[int, list[bytes]]] = []
        while not frames:
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                raise DistStoreError(f"store relay: the store at {host}:{port} closed the connection "
                                     f"after HELLO")
            frames = reader.feed(data)
        code, fields = frames[0]
        if code != w.OK:
            why = fields[0].decode(errors="replace") if fields else f"code {code}"
            raise DistStoreError(f"store relay: the store at {host}:{port} refused the relay: {why}")
        sock.settimeout(None)
        return sock
    except TimeoutError as e:
        sock.close()
        raise DistStoreTimeoutError(f"store relay: the store at {host}:{port} did not answer HELLO "
                                    f"within {timeout:g} s") from e
    except (OSError, w.ProtocolError) as e:
        sock.close()
        raise DistNetworkError(f"store relay: HELLO to the store at {host}:{port} failed: {e}") from e
    except BaseException:
        sock.close()
        raise


def relay_address(environ: "os._Environ[str] | dict[str, str] | None" = None) -> tuple[str, int] | None:
    """``GPUCOLL_STORE_RELAY`` as ``(host, port)``, or None when it is unset or empty.

    Raises:
        ValueError: it is set but not ``HOST:PORT``.
    """
    value = (os.environ if environ is None else environ).get(STORE_RELAY_ENV, "").strip()
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{STORE_RELAY_ENV} must be HOST:PORT (the node's store relay); got {value!r}")
    return host, int(port)


def relay_client(relay: tuple[str, int], upstream: str, world_size: int | None, *, timeout: float,
                 token: str | None) -> "TCPStore":
    """A TCPStore client that reaches the job's store through this node's relay; its
    errors name the relay (``upstream``: the store's address, for the messages)."""
    from .tcp import TCPStore

    host, port = relay
    where = f"store relay {host}:{port} (this node's, carrying the job's store at {upstream})"
    try:
        store = TCPStore(host, port, world_size, is_master=False, timeout=timeout, token=token)
    except DistStoreTimeoutError as e:
        raise DistStoreTimeoutError(f"{where}: {e}") from e
    except DistNetworkError as e:
        raise DistNetworkError(f"{where}: {e}") from e
    except DistStoreError as e:
        raise DistStoreError(f"{where}: {e}") from e
    store._links.where = where
    return store

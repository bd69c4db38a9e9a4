"""One client connection to a TCPStore server, and how a client finds the server.

A :class:`Connection` sends one request and reads its reply with as few system calls
as Python allows: the socket stays blocking with kernel timeouts (Linux), replies
land in a reused buffer, and a short spin before blocking saves the wake-up when the
server answers within microseconds.
"""

from __future__ import annotations

import socket
import struct
import sys
import time

from .._timeouts import SPIN_BACKOFF_MIN, skip_spins
from ..errors import DistStoreError
from . import _wire as w
from ._sockets import unix_socket_name

__all__ = ["Connection", "unix_names", "is_local_host"]

_RECV_SIZE = 8 * 1024


class _ConnectionClosed(ConnectionError):
    pass


_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
"""On Linux a socket stays blocking and its timeout is SO_RCVTIMEO/SO_SNDTIMEO, so a
request costs one send and one recv; Python's own socket timeouts add a poll() before
each of them."""


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_SPIN_SECONDS = 50e-6 if _KERNEL_TIMEOUTS and _DONTWAIT else 0.0


def _timeval(seconds: float) -> bytes:
    seconds = min(seconds, w.MAX_TIMEOUT)
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


class Connection:
    """One authenticated socket to the server; one request at a time."""

    __slots__ = ("sock", "timeout", "buf", "view", "skip_spin", "backoff", "late", "pending")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = -1.0
        # Replies land in one reused buffer: recv(n) would allocate n bytes each time.
        self.buf = bytearray(_RECV_SIZE)
        self.view = memoryview(self.buf)
        self.skip_spin = 0 if _SPIN_SECONDS else 1 << 62
        self.backoff = SPIN_BACKOFF_MIN
        self.late: str | None = None
        """The message of a LATE_ERROR (a failed quiet set) read before the last reply."""
        self.pending = b""
        if _KERNEL_TIMEOUTS:
            sock.settimeout(None)
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        if _KERNEL_TIMEOUTS:
            tv = _timeval(timeout)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        else:
            self.sock.settimeout(min(timeout, w.MAX_TIMEOUT))
        self.timeout = timeout

    def request(self, frame: bytes, timeout: float) -> tuple[int, list[bytes]]:
        """Send one request and return the reply's ``(code, fields)``.

        Raises:
            TimeoutError: no complete reply within ``timeout`` (the connection is then
                in an unknown state and must be closed).
            OSError: the connection failed or was closed by the server.
        """
        self.send(frame, timeout)
        code, fields = self.reply(timeout)
        return self.skip_late(code, fields, timeout)

    def skip_late(self, code: int, fields: list[bytes], timeout: float) -> tuple[int, list[bytes]]:
        """Read past LATE_ERROR replies (a failed quiet set, kept in :attr:`late`) to the
        reply of the request itself."""
        while code == w.LATE_ERROR:
            self.late = fields[0].decode("utf-8", "replace") if fields else "(no message)"
            code, fields = self.reply(timeout)
        return code, fields

    def send(self, frame: bytes, timeout: float) -> None:
        """Send a request that has no reply (or whose reply :meth:`reply` reads)."""
        if timeout != self.timeout:
            self.set_timeout(timeout)
        try:
            self.sock.sendall(frame)
        except BlockingIOError as e:  # SO_SNDTIMEO expired
            raise TimeoutError(f"timed out after {timeout:g} s") from e

    def reply(self, timeout: float) -> tuple[int, list[bytes]]:
        """Read the reply to a request already sent (see :meth:`request`)."""
        if self.pending:
            data, self.pending = self.pending, b""
            return self._read_rest(data, timeout)
        sock = self.sock
        try:
            if self.skip_spin:
                self.skip_spin -= 1
                n = sock.recv_into(self.buf)
            else:
                n = self._spin_recv()
        except BlockingIOError as e:  # SO_RCVTIMEO/SO_SNDTIMEO expired
            raise TimeoutError(f"timed out after {timeout:g} s") from e
        return self.parse(n, timeout)

    def parse(self, n: int, timeout: float) -> tuple[int, list[bytes]]:
        """The reply whose first ``n`` bytes are in :attr:`buf`, read to its end."""
        if n >= 5:
            length, code = w.HEADER.unpack_from(self.buf)
            if n == length + 4:
                return code, w.decode_fields(self.view, 5, n)
        return self._read_rest(bytes(self.view[:n]), timeout)

    def _spin_recv(self) -> int:
        """Poll for the reply for up to _SPIN_SECONDS before blocking.

        Waking a thread that slept costs tens of microseconds on a virtual machine,
        more than a whole request to an idle server. Spinning pays only while the
        server answers well within the spin: a reply that misses it, or arrives in its
        second half (a busy server, a parked get, more clients than cores), turns
        spinning off for the next few requests, twice as many after each further such
        reply (:func:`gpucoll._timeouts.skip_spins`), so contended clients leave the CPU to the
        server.
        """
        sock = self.sock
        buf = self.buf
        start = time.perf_counter()
        end = start + _SPIN_SECONDS
        while True:
            try:
                n = sock.recv_into(buf, 0, _DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() < end:
                    continue
                skip_spins(self)
                return sock.recv_into(buf)
            if time.perf_counter() - start > 0.5 * _SPIN_SECONDS:
                skip_spins(self)
            else:
                self.backoff = SPIN_BACKOFF_MIN
            return n

    def _read_rest(self, data: bytes, timeout: float) -> tuple[int, list[bytes]]:
        deadline = time.monotonic() + timeout
        sock = self.sock
        head = bytearray(data)
        try:
            while len(head) < 5:
                if not data:
                    raise _ConnectionClosed("the server closed the connection")
                self._tick(deadline)
                data = sock.recv(4096)
                head += data
            length, code = w.HEADER.unpack_from(head)
            if length + 4 < len(head):
                if code != w.LATE_ERROR:
                    raise DistStoreError("protocol error: the server sent more than one reply")
                self.pending = bytes(head[length + 4:])
                del head[length + 4:]
            buf = bytearray(length + 4)
            buf[:len(head)] = head
            view = memoryview(buf)
            got = len(head)
            while got < len(buf):
                self._tick(deadline)
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise _ConnectionClosed("the server closed the connection mid-reply")
                got += n
        except BlockingIOError as e:
            raise TimeoutError(f"timed out after {timeout:g} s") from e
        fields = w.decode_fields(view, 5, len(buf))
        view.release()
        return code, fields

    def _tick(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out reading a reply")
        if left < 0.5 * self.timeout:  # a few setsockopt per large reply, not one per recv
            self.set_timeout(left)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def unix_names(host: str, port: int) -> list[str]:
    """Abstract Unix sockets that reach the server at ``host:port`` when it runs on this
    host (see StoreServer), most specific first; [] when ``host`` is not local."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "AF_UNIX"):
        return []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_NUMERICSERV)
    except OSError:
        return []
    names: list[str] = []
    for family, _, _, _, addr in infos:
        ip = str(addr[0])
        if family not in (socket.AF_INET, socket.AF_INET6) or not _is_local(family, ip):
            continue
        name = unix_socket_name(ip, port)
        if name not in names:
            names.append(name)
    if names:
        names += [unix_socket_name("0.0.0.0", port), unix_socket_name("::", port)]
    return names


def is_local_host(host: str) -> bool:
    """True if every address ``host`` resolves to is this host's (loopback included)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = [(f, str(a[0])) for f, _, _, _, a in infos if f in (socket.AF_INET, socket.AF_INET6)]
    return bool(addrs) and all(_is_local(f, ip) for f, ip in addrs)


def _is_local(family: int, ip: str) -> bool:
    """True if ``ip`` is an address of this host: loopback, or binding a UDP socket to it
    succeeds (no name service involved)."""
    if ip.startswith("127.") or ip == "::1":
        return True
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.bind((ip, 0))
        return True
    except OSError:
        return False
    finally:
        probe.close()

"""TCPStore: a store served over TCP by one process (rank 0 or the launcher).

The master runs :class:`~gpucoll.store._server.StoreServer` on a background thread;
every TCPStore, the master's included, is a client. A client keeps a small pool of
connections, one per thread using it at once, each carrying one request at a time.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

from .._timeouts import DEFAULT_TIMEOUT
from ..clusters.base import STORE_TOKEN_ENV
from ..errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from . import _wire as w
from ._kv import HIDDEN_PREFIX
from ._server import StoreServer, unix_socket_name
from .base import Store, Timeout, timeout_error

__all__ = ["TCPStore"]

DEFAULT_MAX_KEY_SIZE = 64 * 1024
DEFAULT_MAX_VALUE_SIZE = 512 * 1024 * 1024
_GRACE = 0.25
"""Seconds a client waits past a blocking request's timeout for the server's own
timeout reply before it gives up on the connection."""
_RECV_SIZE = 64 * 1024
_MAX_TOKEN = 4096
_WORKERS_KEY = HIDDEN_PREFIX + b"tcpstore/workers"
_READY_KEY = HIDDEN_PREFIX + b"tcpstore/ready"


class _ConnectionClosed(ConnectionError):
    pass


_KERNEL_TIMEOUTS = sys.platform.startswith("linux")
"""On Linux a socket stays blocking and its timeout is SO_RCVTIMEO/SO_SNDTIMEO, so a
request costs one send and one recv; Python's own socket timeouts add a poll() before
each of them."""


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1e6))


class _Connection:
    """One authenticated socket to the server; one request at a time."""

    __slots__ = ("sock", "timeout", "buf", "view")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = -1.0
        # Replies land in one reused buffer: recv(n) would allocate n bytes each time.
        self.buf = bytearray(_RECV_SIZE)
        self.view = memoryview(self.buf)
        if _KERNEL_TIMEOUTS:
            sock.settimeout(None)
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float) -> None:
        if _KERNEL_TIMEOUTS:
            tv = _timeval(timeout)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        else:
            self.sock.settimeout(timeout)
        self.timeout = timeout

    def request(self, frame: bytes, timeout: float) -> tuple[int, list[bytes]]:
        """Send one request and return the reply's ``(code, fields)``.

        Raises:
            TimeoutError: no complete reply within ``timeout`` (the connection is then
                in an unknown state and must be closed).
            OSError: the connection failed or was closed by the server.
        """
        if timeout != self.timeout:
            self.set_timeout(timeout)
        sock = self.sock
        try:
            sock.sendall(frame)
            n = sock.recv_into(self.buf)
        except BlockingIOError as e:  # SO_RCVTIMEO/SO_SNDTIMEO expired
            raise TimeoutError(f"timed out after {timeout:g} s") from e
        if n >= 5:
            length, code = w.HEADER.unpack_from(self.buf)
            if n == length + 4:
                return code, w.decode_fields(self.view, 5, n)
        return self._read_rest(bytes(self.view[:n]), timeout)

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
                raise DistStoreError("protocol error: the server sent more than one reply")
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


def _unix_names(host: str, port: int) -> list[str]:
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


def _is_local(family: int, ip: str) -> bool:
    """True if ``ip`` is an address of this host: binding a UDP socket to it succeeds
    (no name service involved)."""
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.bind((ip, 0))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class TCPStore(Store):
    """A store on a TCP server that one process (the master) runs on a background thread.

    Args:
        host: the server's address (master: the address to bind; "0.0.0.0" for all).
        port: the server's port; the master may pass 0 to pick a free port (see ``.port``).
        world_size: number of processes that will create a TCPStore for this job
            (master included), or None. With it, each joins on construction and the
            master waits for all of them when ``wait_for_workers`` is True.
        is_master: run the server in this process.
        timeout: default timeout of every call (connect, blocking reads, requests),
            seconds or ``timedelta``.
        wait_for_workers: see ``world_size``.
        token: shared secret clients present before any request; default: the
            ``GPUCOLL_STORE_TOKEN`` environment variable, if set.
        max_key_size, max_value_size: the server's limits in bytes (master only;
            clients learn them on connect and refuse larger keys/values up front).
        use_unix_socket: on Linux, let clients on the server's host reach it through an
            abstract Unix socket instead of loopback TCP (same protocol, same token,
            about a third of the CPU per message). Off for both ends with False.

    Raises:
        DistNetworkError: the master cannot bind ``host:port``.
        DistStoreTimeoutError: the server could not be reached, or the workers did not
            all join, within ``timeout``.
        DistStoreError: the server rejected the token.

    Example:
        >>> master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        >>> client = TCPStore("127.0.0.1", master.port)
        >>> client.set("k", b"v"); master.get("k")
        b'v'
    """

    def __init__(self, host: str, port: int, world_size: int | None = None,
                 is_master: bool = False, timeout: Timeout = DEFAULT_TIMEOUT,
                 wait_for_workers: bool = True, token: str | bytes | None = None, *,
                 max_key_size: int = DEFAULT_MAX_KEY_SIZE,
                 max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
                 use_unix_socket: bool = True) -> None:
        super().__init__(timeout)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str; got {type(host).__name__} {host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535; got {port!r}")
        if port == 0 and not is_master:
            raise ValueError("port 0 is only valid for the master (it picks a free port); "
                             "a client needs the master's real port")
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"world_size must be None or an int >= 1; got {world_size!r}")
        for name, lim in (("max_key_size", max_key_size), ("max_value_size", max_value_size)):
            if not isinstance(lim, int) or not 1 <= lim <= 0x7FFF0000:
                raise ValueError(f"{name} must be an int in 1..{0x7FFF0000}; got {lim!r}")
        self._token = _token_bytes(token)
        self._closed = False
        self._pool: list[_Connection] = []
        self._lock = threading.Lock()
        self._server: StoreServer | None = None
        self.world_size = world_size
        self.host = host
        if is_master:
            self._server = StoreServer(host, port, token=self._token, max_key_size=max_key_size,
                                       max_value_size=max_value_size, unix_socket=use_unix_socket)
            port = self._server.port
        self._port = port
        self._connect_host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self._where = f"TCPStore {host}:{port}"
        self._unix = _unix_names(self._connect_host, port) if use_unix_socket else []
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self._max_frame = 0
        try:
            self._pool.append(self._connect(time.monotonic() + self._timeout))
            if world_size is not None:
                if self._add(_WORKERS_KEY.decode(), 1) == world_size:
                    self._set(_READY_KEY.decode(), b"1")
                if is_master and wait_for_workers:
                    self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    @property
    def port(self) -> int:
        """The server's port (the one picked when the master was given port 0)."""
        return self._port

    @property
    def is_master(self) -> bool:
        """True if this process runs the server."""
        return self._server is not None

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({self.host!r}, {self._port}, {role})"

    def close(self) -> None:
        """Close this client's connections and, on the master, stop the server.

        Calls blocked in other threads on this client, and every other client's
        calls, then fail with DistNetworkError.
        """
        self._closed = True
        with self._lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()
        if self._server is not None:
            self._server.close()

    # -- connections ----------------------------------------------------------------------

    def _connect(self, deadline: float) -> _Connection:
        """Connect and say HELLO, retrying refused connections until ``deadline``."""
        delay = 0.01
        while True:
            try:
                return self._open(max(0.05, deadline - time.monotonic()))
            except (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                    TimeoutError) as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DistStoreTimeoutError(
                        f"could not connect to {self._where} within {self._timeout:g} s: {e}") from e
                time.sleep(min(delay, left))
                delay = min(2 * delay, 0.5)
            except OSError as e:
                raise DistNetworkError(f"cannot connect to {self._where}: {e}") from e

    def _open(self, timeout: float) -> _Connection:
        sock = self._open_socket(timeout)
        try:
            conn = _Connection(sock, timeout)
            hello = w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"),
                                             self._token or b"", b""])
            code, fields = conn.request(hello, timeout)
            if code == w.ERROR and fields:
                raise DistStoreError(f"{self._where} refused the connection: "
                                     f"{fields[0].decode('utf-8', 'replace')}")
            if code != w.OK or len(fields) != 3:
                raise DistStoreError(f"{self._where} answered HELLO with code {code}; "
                                     f"is it a gpucoll TCPStore?")
            self.max_key_size = int(fields[0])
            self.max_value_size = int(fields[1])
            self._max_frame = int(fields[2])
            conn.set_timeout(self._timeout + _GRACE)
            return conn
        except BaseException:
            sock.close()
            raise

    def _open_socket(self, timeout: float) -> socket.socket:
        for name in self._unix:
            ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ux.settimeout(timeout)
            try:
                ux.connect(name)
                if _peer_uid(ux) in (os.getuid(), 0):
                    return ux
            except OSError:
                pass
            ux.close()
        # create_connection resolves forward only; nothing on this path asks for a peer's name.
        sock = socket.create_connection((self._connect_host, self._port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _call(self, frame: bytes, timeout: float, op: str) -> tuple[int, list[bytes]]:
        if self._closed:
            raise DistStoreError(f"{op} on a closed {self._where}")
        if len(frame) - 4 > self._max_frame:
            raise ValueError(f"{op}: the request is {len(frame)} bytes, over the limit of "
                             f"{self._max_frame} bytes of {self._where}")
        try:
            conn = self._pool.pop()
        except IndexError:
            # Several threads at once, or the last connection broke: one more connection.
            # The server is known to have existed, so a refusal is not retried.
            try:
                conn = self._open(self._timeout)
            except OSError as e:
                raise DistNetworkError(f"{op}: cannot reach {self._where}: {e}") from e
        try:
            code, fields = conn.request(frame, timeout)
        except TimeoutError as e:
            conn.close()
            raise DistStoreTimeoutError(f"{op} got no reply from {self._where} within "
                                        f"{timeout:g} s") from e
        except OSError as e:
            conn.close()
            raise DistNetworkError(f"{op}: lost the connection to {self._where}: {e}") from e
        except BaseException:
            conn.close()
            raise
        if self._closed:
            conn.close()
        else:
            self._pool.append(conn)
        if code == w.ERROR:
            msg = fields[0].decode("utf-8", "replace") if fields else "(no message)"
            raise DistStoreError(f"{op} failed on {self._where}: {msg}")
        return code, fields

    def _simple(self, code: int, fields: list[bytes], op: str) -> list[bytes]:
        status, out = self._call(w.encode_frame(code, fields), self._timeout + _GRACE, op)
        if status != w.OK:
            raise DistStoreError(f"{op}: unexpected reply code {status} from {self._where}")
        return out

    def _wait_for_workers(self, world_size: int) -> None:
        try:
            self._wait([_READY_KEY.decode()], self._timeout)
        except DistStoreTimeoutError as e:
            joined = int(self._get([_WORKERS_KEY.decode()], self._timeout)[0])
            raise DistStoreTimeoutError(
                f"{self._where}: only {joined} of world_size={world_size} processes joined "
                f"within {self._timeout:g} s") from e

    # -- checks against the server's limits -----------------------------------------------

    def _k(self, key: str) -> bytes:
        b = key.encode()
        if len(b) > self.max_key_size:
            raise ValueError(f"key of {len(b)} bytes ({key[:40]!r}...) exceeds the limit of "
                             f"{self.max_key_size} bytes of {self._where}")
        return b

    def _v(self, value: bytes, name: str = "value") -> bytes:
        if len(value) > self.max_value_size:
            raise ValueError(f"{name} of {len(value)} bytes exceeds the limit of "
                             f"{self.max_value_size} bytes of {self._where} (max_value_size)")
        return value

    # -- the operations -------------------------------------------------------------------

    def _set(self, key: str, value: bytes) -> None:
        self._simple(w.SET, [self._k(key), self._v(value)], "set")

    def _blocking(self, code: int, keys: list[str], timeout: float, op: str) -> list[bytes]:
        fields = [w.timeout_field(timeout)]
        fields += [self._k(k) for k in keys]
        status, out = self._call(w.encode_frame(code, fields), timeout + _GRACE, op)
        if status == w.TIMEOUT:
            raise timeout_error(op, keys, [f.decode("utf-8", "replace") for f in out], timeout,
                                self._where)
        if status != w.OK:
            raise DistStoreError(f"{op}: unexpected reply code {status} from {self._where}")
        return out

    def _get(self, keys: list[str], timeout: float) -> list[bytes]:
        if not keys:
            return []
        out = self._blocking(w.GET, keys, timeout, "get" if len(keys) == 1 else "multi_get")
        if len(out) != len(keys):
            raise DistStoreError(f"get: {len(out)} values for {len(keys)} keys from {self._where}")
        return out

    def _wait(self, keys: list[str], timeout: float) -> None:
        if keys:
            self._blocking(w.WAIT, keys, timeout, "wait")

    def _add(self, key: str, amount: int) -> int:
        return int(self._simple(w.ADD, [self._k(key), str(amount).encode()], "add")[0])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._simple(w.CAS, [self._k(key), expected, self._v(desired, "desired_value")],
                            "compare_set")[0]

    def _check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        return self._simple(w.CHECK, [self._k(k) for k in keys], "check")[0] == b"1"

    def _delete_key(self, key: str) -> bool:
        return self._simple(w.DELETE, [self._k(key)], "delete_key")[0] == b"1"

    def _num_keys(self) -> int:
        return int(self._simple(w.NUM_KEYS, [], "num_keys")[0])

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if not keys:
            return
        fields: list[bytes] = []
        for k, v in zip(keys, values):
            fields.append(self._k(k))
            fields.append(self._v(v, "values"))
        self._simple(w.MULTI_SET, fields, "multi_set")

    def _append(self, key: str, value: bytes) -> None:
        self._simple(w.APPEND, [self._k(key), self._v(value)], "append")

    def _queue_push(self, key: str, value: bytes) -> None:
        self._simple(w.QPUSH, [self._k(key), self._v(value)], "queue_push")

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        wait = 0.0 if timeout is None else timeout
        frame = w.encode_frame(w.QPOP, [w.timeout_field(wait), self._k(key)])
        status, out = self._call(frame, (wait or self._timeout) + _GRACE, "queue_pop")
        if status == w.OK and len(out) == 1:
            return out[0]
        if status == w.EMPTY:
            raise DistStoreError(f"queue_pop({key!r}, block=False): the queue is empty")
        if status == w.TIMEOUT:
            raise timeout_error("queue_pop", [key], [key], wait, self._where)
        raise DistStoreError(f"queue_pop: unexpected reply code {status} from {self._where}")

    def _queue_len(self, key: str) -> int:
        return int(self._simple(w.QLEN, [self._k(key)], "queue_len")[0])

    def _list_keys(self) -> list[str]:
        return [k.decode("utf-8", "replace") for k in self._simple(w.LIST_KEYS, [], "list_keys")]


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (-1 if unknown): a
    server squatting the abstract name under another user is not trusted."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return -1
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, opt, 12))
    return int(uid)


def _token_bytes(token: str | bytes | None) -> bytes | None:
    if token is None:
        token = os.environ.get(STORE_TOKEN_ENV) or None
        if token is None:
            return None
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, bytes):
        raise TypeError(f"token must be str, bytes or None; got {type(token).__name__}")
    if len(token) > _MAX_TOKEN:
        raise ValueError(f"token must be at most {_MAX_TOKEN} bytes; got {len(token)}")
    return token or None

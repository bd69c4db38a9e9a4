"""The connection side of a TCPStore client: finding the server, saying HELLO, and
carrying one request on a pooled connection (gpucoll's protocol or torch's).

:class:`TCPStore` (in ``tcp``) holds a :class:`Links`; the operations are there.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Callable, TypeVar

from .._timeouts import Backoff
from .._env import STORE_TOKEN_ENV
from ..errors import DistError, DistNetworkError, DistStoreError, DistStoreTimeoutError
from . import _torch_wire as tw
from . import _wire as w
from ._client import Connection
from ._sockets import peer_uid
from ._torch_client import TORCH_MAX_VALUE, TorchConnection, WaitTimedOut

__all__ = ["Links", "ServerRestarted", "GRACE", "token_bytes"]

_T = TypeVar("_T")

GRACE = 0.25
"""Seconds a client waits past a blocking request's timeout for the server's own
timeout reply before it gives up on the connection."""
_MAX_TOKEN = 4096
_REPLY1 = struct.Struct("<IBI")
"""A reply's header and its first field's length."""
_PROBE_SECONDS = 10.0
"""How long a client waits for a server to answer its first bytes before it says that the
listener is not a store (torch's server may spend 5 s resolving the client's name)."""


class ServerRestarted(DistStoreError):
    """The server a client reconnected to is not the one it first said HELLO to."""


class _TorchServer(Exception):
    """The server answered the probe as torch's TCPStore does."""


class Links:
    """A TCPStore client's connections: a pool of gpucoll connections (or, against a
    torch server, of torch connections), each carrying one request at a time. A
    :class:`~gpucoll.store.tcp.TCPStore` holds one; the server's limits and protocol,
    learnt at HELLO, live here."""

    def __init__(self, host: str, port: int, *, connect_host: str, unix: list[str], token: bytes | None,
                 token_given: bool, protocol: str, timeout: float, max_key_size: int, max_value_size: int) -> None:
        self.host = host
        self.port = port
        self.connect_host = connect_host
        self.where = f"TCPStore {host}:{port}"
        self.unix = unix
        self.token = token
        self.token_given = token_given
        self.protocol = protocol
        """"gpucoll", "torch", or "auto" until the first connection tells."""
        self.timeout = timeout
        """The store's timeout, seconds (TCPStore.set_timeout keeps it)."""
        self.closed = False
        self.pool: list[Connection] = []
        self.tpool: list[TorchConnection] = []
        self.tpool_mode = False
        """True once the server is known to speak torch's protocol."""
        self.instance: bytes | None = None
        """The server instance id this client first said HELLO to (see check_instance)."""
        self.limit_name = "max_value_size"
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        self.max_frame = 0

    def connect_first(self, deadline: float) -> None:
        """Connect (finding the server's protocol when it is "auto") and pool the connection."""
        if self.protocol == "torch":
            self.use_torch()
            self.tpool.append(self.connect(deadline, torch=True))  # type: ignore[arg-type]
            return
        try:
            self.pool.append(self.connect(deadline))  # type: ignore[arg-type]
            self.protocol = "gpucoll"
        except _TorchServer:
            self.use_torch()
            self.tpool.append(self.connect(deadline, torch=True))  # type: ignore[arg-type]

    def use_torch(self) -> None:
        if self.token_given or self.token is not None:
            raise DistStoreError(
                f"{self.where} is a torch TCPStore server, which has no token check; a token "
                f"was given (token= or GPUCOLL_STORE_TOKEN): refusing to connect without it")
        self.protocol = "torch"
        self.tpool_mode = True
        self.unix = []
        self.where = f"torch TCPStore {self.host}:{self.port}"
        # torch's libuv server resets a connection that sends a longer item.
        self.max_value_size = min(self.max_value_size, TORCH_MAX_VALUE)
        self.max_key_size = min(self.max_key_size, TORCH_MAX_VALUE - 1)
        self.limit_name = "torch's server limit"

    def connect(self, deadline: float, torch: bool = False) -> Connection | TorchConnection:
        """Connect and say HELLO, retrying refused connections until ``deadline``."""
        wait = Backoff(deadline - time.monotonic(), first=0.01, cap=0.5)
        while True:
            try:
                left = max(0.05, wait.left())
                return self.open_torch(left) if torch else self.open(left, probe=True)
            except (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                    TimeoutError) as e:
                if not wait.sleep():
                    raise DistStoreTimeoutError(
                        f"could not connect to {self.where} within {self.timeout:g} s: {e}") from e
            except OSError as e:
                raise DistNetworkError(f"cannot connect to {self.where}: {e}") from e

    def open_torch(self, timeout: float) -> TorchConnection:
        timeout = min(timeout, w.MAX_TIMEOUT)
        sock = self.open_socket(timeout)
        try:
            return TorchConnection.open(sock, min(self.timeout + GRACE, w.MAX_TIMEOUT))
        except BaseException:
            sock.close()
            raise

    def hello(self) -> bytes:
        token = self.token or b""
        # A HELLO never starts with a zero byte: the server tells torch's clients (whose
        # first byte is 0) from gpucoll's by it.
        pad = b"" if (19 + len(token)) % 256 else b"\x01"
        return w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"), token, pad])

    def probe(self, sock: socket.socket, timeout: float) -> None:
        """Read the answer to a probe (see _torch_wire): UPGRADE from a gpucoll server;
        raise _TorchServer on torch's echo, DistStoreError on anything else."""
        wait = min(timeout, _PROBE_SECONDS)
        sock.settimeout(wait)
        got = b""
        try:
            while len(got) < 4:
                more = sock.recv(4 - len(got))
                if not more:
                    break
                got += more
        except TimeoutError:
            raise DistStoreError(
                f"{self.where} accepted the connection but did not answer within {wait:g} s: "
                f"is it a TCPStore (gpucoll's or torch's)?") from None
        except OSError as e:
            got = got or f"({e})".encode()
        if got == tw.UPGRADE:
            return
        if got == tw.U32.pack(tw.PROBE_NONCE):
            raise _TorchServer()
        raise DistStoreError(
            f"{self.where} accepted the connection but answered {got[:16]!r} to the store "
            f"greeting: it is not a TCPStore (neither gpucoll's nor torch 2.x's)")

    def open(self, timeout: float, probe: bool = False) -> Connection:
        timeout = min(timeout, w.MAX_TIMEOUT)
        sock = self.open_socket(timeout)
        try:
            if probe and self.protocol == "auto" and sock.family != socket.AF_UNIX:
                # Is it gpucoll's server or torch's? One round trip tells (see _torch_wire).
                sock.sendall(tw.PREFIX + bytes([tw.Q.PING]) + tw.U32.pack(tw.PROBE_NONCE))
                self.probe(sock, timeout)
            # HELLO goes out first, so that it is there when the server accepts (it
            # reads a new connection at once); the socket options are set meanwhile.
            sock.sendall(self.hello())
            # The timeout of every later request, already: one setsockopt pair per connection.
            conn = Connection(sock, min(self.timeout + GRACE, w.MAX_TIMEOUT))
            # No spin for HELLO: the server accepts before it reads, so the reply seldom
            # arrives within the spin, which would then only burn 50 us of CPU.
            conn.skip_spin = max(conn.skip_spin, 1)
            code, fields = conn.reply(conn.timeout)
            if code == w.ERROR and fields:
                raise DistStoreError(f"{self.where} refused the connection: "
                                     f"{fields[0].decode('utf-8', 'replace')}")
            try:
                if code != w.OK or len(fields) not in (3, 4):
                    raise ValueError(f"reply code {code} with {len(fields)} fields")
                limits = [int(f) for f in fields[:3]]
            except ValueError as e:
                raise DistStoreError(f"{self.where} answered HELLO with something unexpected "
                                     f"({e}); is it a gpucoll TCPStore?") from None
            self.check_instance(fields[3] if len(fields) == 4 else b"")
            self.max_key_size, self.max_value_size, self.max_frame = limits
            return conn
        except BaseException:
            sock.close()
            raise

    def check_instance(self, instance: bytes) -> None:
        """Remember the server's instance id at the first HELLO; a later connection to
        another instance means the server restarted, and every key, counter and waiter
        this client relied on is gone: fail rather than carry on with an empty store."""
        if self.instance is None:
            self.instance = instance
            return
        if instance != self.instance:
            raise ServerRestarted(
                f"{self.where} restarted: this client first connected to server instance "
                f"{self.instance.decode(errors='replace') or '(unnamed)'}, and the server now "
                f"listening there is instance {instance.decode(errors='replace') or '(unnamed)'}. "
                f"The store this job used died with the first one (its keys, counters and "
                f"waiters are gone); the job cannot continue on the new, empty store")

    def open_socket(self, timeout: float) -> socket.socket:
        for name in self.unix:
            ux = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ux.settimeout(timeout)
            try:
                ux.connect(name)
                if peer_uid(ux) in (os.getuid(), 0):
                    return ux
            except OSError:
                pass
            ux.close()
        # create_connection resolves forward only; nothing on this path asks for a peer's name.
        sock = socket.create_connection((self.connect_host, self.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def tcall(self, op: str, fn: Callable[[TorchConnection], _T]) -> _T:
        """Run ``fn`` on a pooled connection to a torch server."""
        if self.closed:
            raise DistStoreError(f"{op} on a closed {self.where}")
        try:
            conn = self.tpool.pop()
        except IndexError:
            try:
                conn = self.open_torch(self.timeout)
            except OSError as e:
                raise DistNetworkError(f"{op}: cannot reach {self.where}: {e}") from e
        try:
            result = fn(conn)
        except TimeoutError as e:
            conn.close()
            raise DistStoreTimeoutError(f"{op} got no reply from {self.where} within "
                                        f"{self.timeout:g} s") from e
        except WaitTimedOut:
            self.tpool.append(conn)
            raise
        except OSError as e:
            conn.close()
            raise DistNetworkError(f"{op}: lost the connection to {self.where}: {e} (torch's "
                                   f"server resets a connection whose request it refuses)") from e
        except BaseException:
            conn.close()
            raise
        if self.closed:
            conn.close()
        else:
            self.tpool.append(conn)
        return result

    def checkout(self, frame: bytes, op: str) -> Connection:
        """A pooled connection for ``frame`` (a new one when none is free), after the
        checks every request makes."""
        if self.closed:
            raise DistStoreError(f"{op} on a closed {self.where}")
        if len(frame) - 4 > self.max_frame:
            raise ValueError(f"{op}: the request is {len(frame)} bytes, over the limit of "
                             f"{self.max_frame} bytes of {self.where}")
        try:
            return self.pool.pop()
        except IndexError:
            # Several threads at once, or the last connection broke: one more connection.
            # The server is known to have existed, so a refusal is not retried.
            try:
                return self.open(self.timeout)
            except OSError as e:
                raise DistNetworkError(f"{op}: cannot reach {self.where}: {e}") from e

    def checkin(self, conn: Connection) -> None:
        if self.closed:
            conn.close()
        else:
            self.pool.append(conn)

    def send_only(self, frame: bytes, op: str) -> None:
        """Send a request that is answered only when it fails (see SET_QUIET)."""
        conn = self.checkout(frame, op)
        try:
            conn.send(frame, self.timeout + GRACE)
        except BaseException as e:
            raise self.broken(conn, e, op, self.timeout, "could not send to")
        self.checkin(conn)

    def lost(self, op: str, e: OSError) -> Exception:
        """The error for a connection that broke under ``op``: says so when the server
        restarted (one new connection, within a second, tells)."""
        if not self.closed:
            try:
                self.pool.append(self.open(min(1.0, self.timeout)))
            except ServerRestarted as restarted:
                return DistNetworkError(f"{op}: lost the connection to {self.where}: {e}; "
                                        f"{restarted}")
            except (OSError, DistError):
                pass
        return DistNetworkError(f"{op}: lost the connection to {self.where}: {e}")

    def call(self, frame: bytes, timeout: float, op: str) -> tuple[int, list[bytes]]:
        """Send one request on a pooled connection and return its reply's ``(code, fields)``."""
        conn = self.checkout(frame, op)
        try:
            code, fields = conn.request(frame, timeout)
        except BaseException as e:
            raise self.broken(conn, e, op, timeout)
        return self.answered(conn, code, fields, op)

    def ask(self, frame: bytes, op: str) -> bytes | bytearray:
        """Send a request answered by OK with one field (add, check) and return that field.

        The hot path of counters: when a pooled connection is ready (no spin due, nothing
        buffered, the store's timeout set) and the whole reply arrives in one read, the
        reply is taken apart here, with no further call; anything else is :meth:`_call`'s
        or :meth:`_finish`'s.
        """
        pool = self.pool
        timeout = self.timeout + GRACE
        if pool and not self.closed and len(frame) - 4 <= self.max_frame:
            conn = pool.pop()
            if conn.skip_spin and not conn.pending and conn.timeout == timeout:
                conn.skip_spin -= 1
                try:
                    conn.sock.sendall(frame)
                    n = conn.sock.recv_into(conn.buf)
                except BaseException as e:
                    raise self.broken(conn, e, op, timeout)
                buf = conn.buf
                length, code, size = _REPLY1.unpack_from(buf)
                if n == length + 4 and size == n - 9 and code == w.OK:
                    if self.closed:
                        conn.close()
                    else:
                        pool.append(conn)
                    return buf[9:n]
                code, fields = self.finish(conn, n, timeout, op)
            else:
                pool.append(conn)
                code, fields = self.call(frame, timeout, op)
        else:
            code, fields = self.call(frame, timeout, op)
        if code != w.OK or len(fields) != 1:
            raise DistStoreError(f"{op}: unexpected reply code {code} from {self.where}")
        return fields[0]

    def finish(self, conn: Connection, n: int, timeout: float, op: str) -> tuple[int, list[bytes]]:
        """Read the rest of a reply whose first ``n`` bytes are in ``conn.buf``."""
        try:
            code, fields = conn.skip_late(*conn.parse(n, timeout), timeout)
        except BaseException as e:
            raise self.broken(conn, e, op, timeout)
        return self.answered(conn, code, fields, op)

    def answered(self, conn: Connection, code: int, fields: list[bytes],
                  op: str) -> tuple[int, list[bytes]]:
        """Pool ``conn`` again and raise the errors its reply (or an earlier one) reports."""
        self.checkin(conn)
        if conn.late is not None:
            late, conn.late = conn.late, None
            raise DistStoreError(f"an earlier set on this connection to {self.where} failed: "
                                 f"{late} (this {op} itself was carried out)")
        if code == w.ERROR:
            msg = fields[0].decode("utf-8", "replace") if fields else "(no message)"
            raise DistStoreError(f"{op} failed on {self.where}: {msg}")
        return code, fields

    def broken(self, conn: Connection, e: BaseException, op: str, timeout: float,
                what: str = "got no reply from") -> BaseException:
        """Close a connection that failed under ``op`` and return the error to raise."""
        conn.close()
        err: BaseException
        if isinstance(e, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_RCVTIMEO/SNDTIMEO
            err = DistStoreTimeoutError(f"{op} {what} {self.where} within {timeout:g} s")
        elif isinstance(e, OSError):
            err = self.lost(op, e)
        else:
            return e
        err.__cause__ = e
        return err


def token_bytes(token: str | bytes | None) -> bytes | None:
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


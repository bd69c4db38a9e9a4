"""TCPStore: a store served over TCP by one process (rank 0 or the launcher).

The master runs :class:`~gpucoll.store._server.StoreServer` on a background thread;
every TCPStore, the master's included, is a client. A client keeps a small pool of
connections (:class:`~gpucoll.store._client.Connection`), one per thread using it at
once, each carrying one request at a time.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Sequence

from .._timeouts import DEFAULT_TIMEOUT
from ..errors import DistStoreError, DistStoreTimeoutError
from . import _wire as w
from ._kv import HIDDEN_PREFIX
from ._client import unix_names
from ._links import GRACE as _GRACE, Links, token_bytes as _token_bytes
from ._server import StoreServer
from ._torch_client import WaitTimedOut
from .base import Store, Timeout, ValueLike, queue_empty_error, timeout_error

__all__ = ["TCPStore"]

DEFAULT_MAX_KEY_SIZE = 64 * 1024
DEFAULT_MAX_VALUE_SIZE = 512 * 1024 * 1024
_HEAD1 = struct.Struct("<IBI")
"""A frame's header and the length of its first field."""
_U32 = w.U32
_QUICK_FRAME = 256 * 1024
"""A set's frame at most this long may take TCPStore.set's quick path: it is under any
server's max_frame (twice its value limit plus 1 MiB)."""
_NO_SET: tuple[str | None, int, bytes, float, int] = (None, 0, b"", 0.0, 0)
_WORKERS_KEY = HIDDEN_PREFIX + b"tcpstore/workers"
_READY_KEY = HIDDEN_PREFIX + b"tcpstore/ready"
PROTOCOLS = ("auto", "gpucoll", "torch")

_TENANTS: dict[int, list[object]] = {}
"""Servers shared by ``multi_tenant=True`` masters of this process: port -> [server, users]."""
_TENANTS_LOCK = threading.Lock()


def _agent_serves(port: int | None) -> bool:
    """torch's rule: under TORCHELASTIC_USE_AGENT_STORE, a master on MASTER_PORT is a client."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() in ("1", "true", "yes", "on", "y")
    return agent and port is not None and os.environ.get("MASTER_PORT", "").strip() == str(port)


class TCPStore(Store):
    """A store on a TCP server that one process (the master) runs on a background thread.

    Args:
        host: the server's address (master: the address to bind; "0.0.0.0" for all).
        port: the server's port; the master may pass 0 to pick a free port (see ``.port``).
        world_size: number of processes that will create a TCPStore for this job
            (master included), or None (0 is refused, as by torch). With it, each
            store created with ``wait_for_workers`` True joins on construction, and
            the master waits for all of them.
        is_master: run the server in this process. As in torch, when
            ``TORCHELASTIC_USE_AGENT_STORE`` is set and ``port`` is ``MASTER_PORT``,
            torchrun's agent serves it and this store is a client.
        timeout: default timeout of every call (connect, blocking reads, requests),
            seconds or ``timedelta``.
        wait_for_workers: see ``world_size``.
        token: shared secret clients present before any request; default: the
            ``GPUCOLL_STORE_TOKEN`` environment variable, if set.
        max_key_size, max_value_size: the server's limits in bytes (master only;
            clients learn them on connect and refuse larger keys/values up front).
        use_libuv: torch's choice of server implementation; gpucoll has one, and keeps
            the value as ``libuvBackend`` for torch code that reads it.
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

    def __init__(self, host: str | None = None, port: int | None = None,
                 world_size: int | None = None, is_master: bool = False,
                 timeout: Timeout = DEFAULT_TIMEOUT, wait_for_workers: bool = True,
                 token: str | bytes | None = None, *,
                 max_key_size: int = DEFAULT_MAX_KEY_SIZE,
                 max_value_size: int = DEFAULT_MAX_VALUE_SIZE,
                 use_unix_socket: bool = True, protocol: str = "auto",
                 host_name: str | None = None, multi_tenant: bool = False,
                 master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
        super().__init__(timeout)
        if host_name is not None:
            if host is not None:
                raise TypeError("pass host or host_name (torch's name), not both")
            host = host_name
        if host is None or port is None:
            raise TypeError("TCPStore needs host (or host_name) and port")
        if world_size == 0 and not isinstance(world_size, bool):
            raise ValueError("TCPStore world size cannot be 0: pass None (unknown) or the number of "
                             "processes, master included")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}; got {protocol!r}")
        if master_listen_fd is not None and (not is_master or not isinstance(master_listen_fd, int)):
            raise ValueError(f"master_listen_fd must be an int and needs is_master=True; "
                             f"got {master_listen_fd!r} with is_master={is_master}")
        # torch's choice of server implementation: gpucoll has one; the choice is kept
        # as ``libuvBackend`` for torch code that reads it back
        self.libuvBackend = bool(use_libuv)
        if is_master and _agent_serves(port):
            is_master = False  # torchrun's agent already serves this port (torch's rule)
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
        token_b = _token_bytes(token)
        self._lock = threading.Lock()
        self._server: StoreServer | None = None
        self._tenant_port: int | None = None
        self._last_add: tuple[str | None, int, bytes] = (None, 0, b"")
        """The last add's key, amount and request frame, sent again when they repeat."""
        self._last_set: tuple[str | None, int, bytes, float, int] = _NO_SET
        """The last key set, its value's size, the frame's head, the connections' timeout
        then and the frame's size (see set)."""
        self.world_size = world_size
        self.host = host
        if is_master:
            self._server = self._start_server(host, port, token_b, max_key_size, max_value_size,
                                              use_unix_socket, multi_tenant, master_listen_fd)
            port = self._server.port
        connect_host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        self._links = Links(host, port, connect_host=connect_host,
                            unix=unix_names(connect_host, port) if use_unix_socket else [], token=token_b,
                            token_given=token is not None, protocol="gpucoll" if is_master else protocol,
                            timeout=self._timeout, max_key_size=max_key_size, max_value_size=max_value_size)
        try:
            self._links.connect_first(time.monotonic() + self._timeout)
            # torch's rule: only a store that waits for the workers counts itself in
            if world_size is not None and wait_for_workers:
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
        return self._links.port

    @property
    def protocol(self) -> str:
        """The server's protocol: "gpucoll", or "torch" for a torch TCPStore server
        (a torch master or torchrun's agent store), found at connect unless given."""
        return self._links.protocol

    def clone(self) -> TCPStore:
        """A new client of the same server (its own connections; torch's ``clone``)."""
        twin = TCPStore(self.host, self._links.port, timeout=self._timeout, token=self._links.token,
                        use_unix_socket=bool(self._links.unix), protocol=self._links.protocol)
        if self._links.instance is not None and twin._links.instance != self._links.instance:
            twin.close()
            self._links.check_instance(twin._links.instance or b"")  # raises: the server restarted
        twin._links.where = self._links.where  # a relay's client names the relay (see _relay)
        return twin

    def _start_server(self, host: str, port: int, token: bytes | None, max_key_size: int, max_value_size: int,
                      unix_socket: bool, multi_tenant: bool,
                      listen_fd: int | None) -> StoreServer:
        if not multi_tenant or port == 0:
            server = StoreServer(host, port, token=token, max_key_size=max_key_size,
                                 max_value_size=max_value_size, unix_socket=unix_socket,
                                 listen_fd=listen_fd, expected_clients=self.world_size)
            if multi_tenant:
                with _TENANTS_LOCK:
                    _TENANTS[server.port] = [server, 1]
                self._tenant_port = server.port
            return server
        with _TENANTS_LOCK:
            entry = _TENANTS.get(port)
            if entry is not None and isinstance(entry[0], StoreServer) and entry[0].running:
                entry[1] = int(entry[1]) + 1  # type: ignore[call-overload]
                self._tenant_port = port
                return entry[0]
            server = StoreServer(host, port, token=token, max_key_size=max_key_size,
                                 max_value_size=max_value_size, unix_socket=unix_socket,
                                 listen_fd=listen_fd, expected_clients=self.world_size)
            _TENANTS[port] = [server, 1]
            self._tenant_port = port
            return server

    @property
    def max_key_size(self) -> int:
        """The server's limit on one key, in bytes (learnt at connect)."""
        return self._links.max_key_size

    @max_key_size.setter
    def max_key_size(self, value: int) -> None:
        self._links.max_key_size = value
        self._last_set = _NO_SET  # set's quick path checked the old limit

    @property
    def max_value_size(self) -> int:
        """The server's limit on one value, in bytes (learnt at connect)."""
        return self._links.max_value_size

    @max_value_size.setter
    def max_value_size(self, value: int) -> None:
        self._links.max_value_size = value
        self._last_set = _NO_SET  # set's quick path checked the old limit

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self._links.timeout = self._timeout
        self._last_set = _NO_SET  # set's quick path compares the connection's timeout

    @property
    def is_master(self) -> bool:
        """True if this process runs the server."""
        return self._server is not None

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({self.host!r}, {self._links.port}, {role})"

    def close(self) -> None:
        """Close this client's connections and, on the master, stop the server.

        Calls blocked in other threads on this client, and every other client's
        calls, then fail with DistNetworkError.
        """
        if self._links.closed:
            return
        self._links.closed = True
        with self._lock:
            pool, self._links.pool = self._links.pool, []
            tpool, self._links.tpool = self._links.tpool, []
        for conn in pool:
            conn.close()
        for tconn in tpool:
            tconn.close()
        if self._server is not None:
            if self._tenant_port is not None:
                with _TENANTS_LOCK:
                    entry = _TENANTS.get(self._tenant_port)
                    if entry is not None and entry[0] is self._server:
                        entry[1] = int(entry[1]) - 1  # type: ignore[call-overload]
                        if int(entry[1]) > 0:  # type: ignore[call-overload]
                            return  # another multi_tenant store still uses the server
                        del _TENANTS[self._tenant_port]
            self._server.close()

    # -- the hot calls ----------------------------------------------------------------------
    # Counters, barriers and address exchange are these four calls. They skip the generic
    # layers (argument checks of Store, field lists) for the common argument types and
    # fall back to them otherwise, so errors are the same.

    def add(self, key: str, amount: int) -> int:
        if type(key) is not str or type(amount) is not int or self._links.tpool_mode:
            return super().add(key, amount)
        last = self._last_add
        if key == last[0] and amount == last[1]:
            frame = last[2]  # a counter is usually bumped by the same amount again and again
        else:
            kb = key.encode()
            if len(kb) > self._links.max_key_size:
                self._k(key)  # raises, with the message
            ab = b"%d" % amount
            frame = _HEAD1.pack(9 + len(kb) + len(ab), w.ADD, len(kb)) + kb + _U32.pack(len(ab)) + ab
            self._last_add = (key, amount, frame)
        return int(self._links.ask(frame, "add"))

    def get(self, key: str, *, timeout: Timeout | None = None) -> bytes:
        if type(key) is not str or timeout is not None or self._links.tpool_mode:
            return super().get(key, timeout=timeout)
        return self._blocking(w.GET, [key], self._timeout, "get")[0]

    def set(self, key: str, value: ValueLike) -> None:
        # A set has no reply (see _set): its cost is the frame's assembly and one send. A
        # key is usually set again with a value of the same size (a status, an address),
        # so the frame's head is kept from the last set (_set fills it, never in torch's
        # protocol); with it and a pooled connection ready, this is the whole call.
        last = self._last_set
        if type(key) is not str or key != last[0] or type(value) is not bytes or len(value) != last[1]:
            if type(key) is not str or type(value) is not bytes or self._links.tpool_mode:
                return super().set(key, value)
            self._set(key, value)
            return
        links = self._links
        pool = links.pool
        try:
            conn = pool.pop()
        except IndexError:  # none free (another thread's, or broken): _set opens one
            self._set(key, value)
            return
        if conn.timeout != last[3]:
            pool.append(conn)
            self._set(key, value)
            return
        frame = last[2] + value
        try:
            sent = conn.sock.send(frame)
            if sent != last[4]:  # cut short (a signal, SO_SNDTIMEO): the rest, or the error
                conn.sock.sendall(memoryview(frame)[sent:])
        except BaseException as e:
            raise links.broken(conn, e, "set", links.timeout, "could not send to")
        if links.closed:
            conn.close()
        else:
            pool.append(conn)

    def check(self, keys: str | Sequence[str]) -> bool:
        if (type(keys) is not list or len(keys) != 1 or type(keys[0]) is not str
                or self._links.tpool_mode):
            return super().check(keys)
        kb = keys[0].encode()
        if len(kb) > self._links.max_key_size:
            self._k(keys[0])
        return self._links.ask(_HEAD1.pack(5 + len(kb), w.CHECK, len(kb)) + kb, "check") == b"1"

    def _twait(self, op: str, keys: list[str], timeout: float) -> list[bytes]:
        bkeys = [self._k(k) for k in keys]
        try:
            self._links.tcall(op, lambda c: c.wait(bkeys, timeout, self._timeout + _GRACE))
        except WaitTimedOut:
            missing = [k for k in keys if not self._check([k])]
            raise timeout_error(op, keys, missing, timeout, self._links.where) from None
        return bkeys

    def _simple(self, code: int, fields: list[bytes], op: str) -> list[bytes]:
        status, out = self._links.call(w.encode_frame(code, fields), self._timeout + _GRACE, op)
        if status != w.OK:
            raise DistStoreError(f"{op}: unexpected reply code {status} from {self._links.where}")
        return out

    def _wait_for_workers(self, world_size: int) -> None:
        try:
            self._wait([_READY_KEY.decode()], self._timeout)
        except DistStoreTimeoutError as e:
            joined = int(self._get([_WORKERS_KEY.decode()], self._timeout)[0])
            raise DistStoreTimeoutError(
                f"Timed out after {self._timeout:g} seconds waiting for clients. "
                f"{joined}/{world_size} clients joined. ({self._links.where}: the processes that did not "
                "create their TCPStore are missing or slow, or world_size is wrong)") from e

    # -- checks against the server's limits -----------------------------------------------

    def _k(self, key: str) -> bytes:
        b = key.encode()
        if len(b) > self._links.max_key_size:
            raise ValueError(f"key of {len(b)} bytes ({key[:40]!r}...) exceeds the limit of "
                             f"{self._links.max_key_size} bytes of {self._links.where}")
        return b

    def _v(self, value: bytes, name: str = "value") -> bytes:
        if len(value) > self._links.max_value_size:
            raise ValueError(f"{name} of {len(value)} bytes exceeds the limit of "
                             f"{self._links.max_value_size} bytes of {self._links.where} ({self._links.limit_name})")
        return value

    # -- the operations -------------------------------------------------------------------

    def _set(self, key: str, value: bytes) -> None:
        # No round trip: the server answers only a failure, read with the next reply on
        # this connection (see docs/stores.md).
        kb = self._k(key)
        self._v(value)
        if self._links.tpool_mode:
            self._links.tcall("set", lambda c: c.set(kb, value))
            return
        head = b"".join((_HEAD1.pack(9 + len(kb) + len(value), w.SET_QUIET, len(kb)), kb,
                         w.U32.pack(len(value))))
        self._links.send_only(head + value, "set")
        if len(head) + len(value) <= _QUICK_FRAME:  # under any server's max_frame (1 MiB or more)
            self._last_set = (key, len(value), head, self._links.timeout + _GRACE,
                              len(head) + len(value))

    def _call2(self, code: int, a: bytes, b: bytes, op: str) -> bytes | None:
        """A two-field request with a reply of at most one field (the common ops)."""
        frame = b"".join((_HEAD1.pack(9 + len(a) + len(b), code, len(a)), a, w.U32.pack(len(b)), b))
        status, out = self._links.call(frame, self._timeout + _GRACE, op)
        if status != w.OK:
            raise DistStoreError(f"{op}: unexpected reply code {status} from {self._links.where}")
        return out[0] if out else None

    def _blocking(self, code: int, keys: list[str], timeout: float, op: str) -> list[bytes]:
        if len(keys) == 1:
            kb = self._k(keys[0])
            frame = _HEAD1.pack(17 + len(kb), code, 8) + w.F64.pack(timeout) + w.U32.pack(len(kb)) + kb
        else:
            frame = w.encode_frame(code, [w.timeout_field(timeout)] + [self._k(k) for k in keys])
        status, out = self._links.call(frame, timeout + _GRACE, op)
        if status == w.TIMEOUT:
            raise timeout_error(op, keys, [f.decode("utf-8", "replace") for f in out], timeout,
                                self._links.where)
        if status != w.OK:
            raise DistStoreError(f"{op}: unexpected reply code {status} from {self._links.where}")
        return out

    def _get(self, keys: list[str], timeout: float) -> list[bytes]:
        if not keys:
            return []
        if self._links.tpool_mode:
            op = "get" if len(keys) == 1 else "multi_get"
            bkeys = self._twait(op, keys, timeout)
            return self._links.tcall(op, lambda c: c.get(bkeys))
        out = self._blocking(w.GET, keys, timeout, "get" if len(keys) == 1 else "multi_get")
        if len(out) != len(keys):
            raise DistStoreError(f"get: {len(out)} values for {len(keys)} keys from {self._links.where}")
        return out

    def _wait(self, keys: list[str], timeout: float) -> None:
        if keys and self._links.tpool_mode:
            self._twait("wait", keys, timeout)
        elif keys:
            self._blocking(w.WAIT, keys, timeout, "wait")

    def _add(self, key: str, amount: int) -> int:
        if self._links.tpool_mode:
            if not -(1 << 63) <= amount < (1 << 63):
                raise ValueError(f"add: amount {amount} does not fit torch's int64")
            kb = self._k(key)
            return self._links.tcall("add", lambda c: c.add(kb, amount))
        total = self._call2(w.ADD, self._k(key), b"%d" % amount, "add")
        if total is None:
            raise DistStoreError(f"add: empty reply from {self._links.where}")
        return int(total)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        if self._links.tpool_mode:
            kb = self._k(key)
            self._v(expected, "expected_value")
            self._v(desired, "desired_value")
            return self._links.tcall("compare_set", lambda c: c.compare_set(kb, expected, desired))
        return self._simple(w.CAS, [self._k(key), expected, self._v(desired, "desired_value")],
                            "compare_set")[0]

    def _check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        if self._links.tpool_mode:
            bkeys = [self._k(k) for k in keys]
            return self._links.tcall("check", lambda c: c.check(bkeys))
        return self._simple(w.CHECK, [self._k(k) for k in keys], "check")[0] == b"1"

    def _delete_key(self, key: str) -> bool:
        if self._links.tpool_mode:
            kb = self._k(key)
            return self._links.tcall("delete_key", lambda c: c.delete_key(kb))
        return self._simple(w.DELETE, [self._k(key)], "delete_key")[0] == b"1"

    def _num_keys(self) -> int:
        if self._links.tpool_mode:
            return self._links.tcall("num_keys", lambda c: c.num_keys())
        # torch counts its join counter among the keys: so does this count (the server
        # keeps it hidden, so it is added here)
        joined = self._check([_WORKERS_KEY.decode()])
        return int(self._simple(w.NUM_KEYS, [], "num_keys")[0]) + int(joined)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        if not keys:
            return
        if self._links.tpool_mode:
            bkeys = [self._k(k) for k in keys]
            for v in values:
                self._v(v, "values")
            self._links.tcall("multi_set", lambda c: c.multi_set(bkeys, values))
            return
        fields: list[bytes] = []
        for k, v in zip(keys, values):
            fields.append(self._k(k))
            fields.append(self._v(v, "values"))
        self._simple(w.MULTI_SET, fields, "multi_set")

    def _append(self, key: str, value: bytes) -> None:
        if self._links.tpool_mode:
            kb = self._k(key)
            self._v(value)
            self._links.tcall("append", lambda c: c.append(kb, value))
            return
        self._simple(w.APPEND, [self._k(key), self._v(value)], "append")

    def _queue_push(self, key: str, value: bytes) -> None:
        if self._links.tpool_mode:
            kb = self._k(key)
            self._v(value)
            self._links.tcall("queue_push", lambda c: c.queue_push(kb, value))
            return
        self._simple(w.QPUSH, [self._k(key), self._v(value)], "queue_push")

    def _queue_pop(self, key: str, timeout: float | None) -> bytes:
        if self._links.tpool_mode:
            return self._tqueue_pop(key, timeout)
        wait = 0.0 if timeout is None else timeout
        frame = w.encode_frame(w.QPOP, [w.timeout_field(wait), self._k(key)])
        status, out = self._links.call(frame, (wait or self._timeout) + _GRACE, "queue_pop")
        if status == w.OK and len(out) == 1:
            return out[0]
        if status == w.EMPTY:
            raise queue_empty_error(key, self._links.where)
        if status == w.TIMEOUT:
            raise timeout_error("queue_pop", [key], [key], wait, self._links.where)
        raise DistStoreError(f"queue_pop: unexpected reply code {status} from {self._links.where}")

    def _tqueue_pop(self, key: str, timeout: float | None) -> bytes:
        kb = self._k(key)
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            if timeout is not None:
                self._twait("queue_pop", [key], max(0.0, deadline - time.monotonic()))
            value = self._links.tcall("queue_pop", lambda c: c.queue_pop_now(kb))
            if value is not None:
                return value
            if timeout is None:
                raise queue_empty_error(key, self._links.where)
            # Another client popped between the WAIT and the POP: wait again.

    def _queue_len(self, key: str) -> int:
        if self._links.tpool_mode:
            kb = self._k(key)
            return self._links.tcall("queue_len", lambda c: c.queue_len(kb))
        return int(self._simple(w.QLEN, [self._k(key)], "queue_len")[0])

    def _list_keys(self) -> list[str]:
        if self._links.tpool_mode:
            keys = self._links.tcall("list_keys", lambda c: c.list_keys())
            return [k.decode("utf-8", "replace") for k in keys if not k.startswith(HIDDEN_PREFIX)]
        return [k.decode("utf-8", "replace") for k in self._simple(w.LIST_KEYS, [], "list_keys")]

"""What the TCPStore server does with each request, and what it answers.

:class:`Requests` holds the store (a :class:`KVState`), the parked requests and
their deadlines, and the per-connection output queues; the :class:`StoreServer` (in
``_server``) that holds it feeds it frames and sends what it queues.

* ``get``/``wait``/``queue_pop`` park a waiter in the KVState; the write that
  satisfies it queues the reply. Deadlines live in a heap, so a timed-out request is
  answered by the server, naming the keys still missing, at its deadline.
* A connection is answered strictly in order: while it has a parked request or
  unsent output, its further frames wait in its buffer.
"""

from __future__ import annotations

import heapq
import hmac
import itertools
import os
import socket
import struct
import time
from typing import Callable, Union, cast

from ..errors import DistStoreError
from . import _wire as w
from ._kv import KVState, Waiter
from . import _torch_wire as tw
from ._torch_wire import Q

__all__ = ["Requests", "Conn", "JOIN_THRESHOLD", "PIPELINE_SLACK", "torch_request"]

PREAUTH_MAX_FRAME = 8192
PIPELINE_SLACK = 1 << 20
"""Bytes a client may queue behind a parked request before it is taken for a flood."""
JOIN_THRESHOLD = 64 * 1024
"""Replies smaller than this are joined into one buffer; larger ones go out by sendmsg
without copying the values."""
_OK_EMPTY = w.encode_frame(w.OK, [])
_ONE_FIELD = struct.Struct("<IBI")
"""Header of a reply with one field: length, code, the field's length."""
_OK_HEADS = tuple(_ONE_FIELD.pack(5 + size, w.OK, size) for size in range(24))
OK_HEADS = _OK_HEADS
"""An OK reply's head for one field of each size below 24 bytes (a counter's value)."""
_OK_HEADS_N = len(_OK_HEADS)
"""The head of an OK reply with one field of each size up to 23 bytes (any int64)."""
_ONE = w.encode_frame(w.OK, [b"1"])
_ZERO = w.encode_frame(w.OK, [b"0"])

Out = Union[bytes, memoryview]


class Conn:
    __slots__ = ("sock", "inbuf", "out", "authed", "limit", "waiter", "kind", "closing",
                 "writing", "dirty", "big", "big_have", "big_need", "torch", "pinged", "later",
                 "last_add")

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.inbuf: bytes | bytearray = b""
        self.out: list[Out] = []
        self.authed = False
        self.limit = PREAUTH_MAX_FRAME
        self.waiter: Waiter | None = None
        self.kind = 0
        self.closing = False
        self.writing = False
        self.dirty = False
        self.big: bytearray | None = None
        self.big_have = 0
        self.big_need = 0
        """Size of the large frame arriving in ``big``, which grows as it arrives."""
        self.torch = False
        """Speaks torch's protocol (see _torch_wire)."""
        self.pinged = False
        self.later = False
        """Its turn ended with whole frames buffered; served next loop iteration."""
        self.last_add: tuple[bytes, int, bytes, int] = (b"", 0, b"", 0)
        """The last ADD frame served by Requests.quick_add, its size, its key and its amount."""


class Requests:
    """The store's protocol and semantics, without sockets: what a :class:`StoreServer`
    (``_server``) holds and feeds frames to, and whose queued replies it sends.

    Args:
        token: bytes a client must present in its HELLO, or None for no check.
        max_key_size, max_value_size: limits on one key and one value, in bytes.
    """

    def __init__(self, *, token: bytes | None, max_key_size: int, max_value_size: int) -> None:
        self.max_key_size = max_key_size
        self.max_value_size = max_value_size
        # A multi_set or multi_get may carry several values; one frame holds up to twice the
        # value limit, and no more than a u32 length can say.
        self.max_frame = min(2 * max_value_size + (1 << 20), 0xFFFFFFFF)
        self._token = token
        self.instance_id = os.urandom(8).hex().encode()
        """Sent with every HELLO reply: a client that reconnects to a different id knows
        that the server restarted (and that the store it had is gone)."""
        self.pending: dict[Conn, float] = {}
        """Connections that have not said HELLO (or torch's PING) yet, oldest first, and
        when each is dropped if it still has not."""
        self.kv = KVState()
        self._data = self.kv.data  # the same dict, one attribute nearer (quick_add)
        self.timers: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self.dirty: list[Conn] = []
        self.resume: list[Conn] = []
        handlers: dict[int, Callable[[Conn, list[bytes]], None]] = {
            w.SET: self._op_set, w.GET: self._op_get, w.ADD: self._op_add, w.CAS: self._op_cas,
            w.WAIT: self._op_wait, w.CHECK: self._op_check, w.DELETE: self._op_delete,
            w.NUM_KEYS: self._op_num_keys, w.MULTI_SET: self._op_multi_set,
            w.APPEND: self._op_append, w.QPUSH: self._op_qpush, w.QPOP: self._op_qpop,
            w.QLEN: self._op_qlen, w.LIST_KEYS: self._op_list_keys, w.SET_QUIET: self._op_set_quiet,
        }
        # Indexed by opcode: (fewest fields, most fields, handler), or None.
        self._table: list[tuple[int, int, Callable[[Conn, list[bytes]], None]] | None] = [None] * 256
        for code, handler in handlers.items():
            lo, hi = w.ARITY[code]
            self._table[code] = (lo, 1 << 30 if hi is None else hi, handler)

    def register(self, code: int, fewest: int, most: int, handler: Callable[[Conn, list[bytes]], None]) -> None:
        """Serve frames of opcode ``code`` (with ``fewest`` to ``most`` fields) with ``handler``
        (a connection kind beside the store's own requests: the relays' channels, _mux)."""
        self._table[code] = (fewest, most, handler)

    # -- frames in ------------------------------------------------------------------------

    def dispatch(self, conn: Conn, code: int, fields: list[bytes]) -> None:
        if not conn.authed:
            self._hello(conn, code, fields)
            return
        spec = self._table[code]
        if spec is None:
            raise w.ProtocolError(f"unknown opcode {code}")
        lo, hi, handler = spec
        if not lo <= len(fields) <= hi:
            w.check_arity(code, len(fields))  # raises, with the message
        try:
            handler(conn, fields)
        except DistStoreError as e:
            self._reply(conn, w.ERROR, [str(e).encode()])
        except w.ProtocolError:
            raise
        except Exception as e:  # a server bug must not take the other clients down
            self._reply(conn, w.ERROR, [f"server error in {w.NAMES[code]}: "
                                        f"{type(e).__name__}: {e}".encode()])
            conn.closing = True

    def _hello(self, conn: Conn, code: int, fields: list[bytes]) -> None:
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
        self.pending.pop(conn, None)
        conn.limit = self.max_frame
        self._reply(conn, w.OK, [str(self.max_key_size).encode(), str(self.max_value_size).encode(),
                                 str(self.max_frame).encode(), self.instance_id])

    # -- replies out ----------------------------------------------------------------------

    def _queue(self, conn: Conn, frame: bytes) -> None:
        conn.out.append(frame)

    def _reply(self, conn: Conn, code: int, fields: list[bytes]) -> None:
        if len(fields) == 1 and len(fields[0]) < JOIN_THRESHOLD:
            f = fields[0]
            conn.out.append(_ONE_FIELD.pack(5 + len(f), code, len(f)) + f)
            return
        size = 1 + 4 * len(fields) + sum(map(len, fields))
        if size < JOIN_THRESHOLD:
            conn.out.append(w.encode_frame(code, fields))
            return
        out = conn.out
        out.append(w.HEADER.pack(size, code))
        for f in fields:
            out.append(w.U32.pack(len(f)))
            out.append(f)

    def reply_later(self, conn: Conn) -> None:
        """Flush ``conn`` at the end of this loop iteration (a reply made while serving
        another connection)."""
        if not conn.dirty:
            conn.dirty = True
            self.dirty.append(conn)

    # -- waiting --------------------------------------------------------------------------

    def _park(self, conn: Conn, keys: list[bytes], timeout: float, kind: int,
              queue: bool) -> None:
        if queue:
            got = self.kv.queue_pop_or_watch(keys[0], self._ready, conn)
            if not isinstance(got, Waiter):
                self._reply(conn, w.OK, [got])
                return
        else:
            got2 = self.kv.get_or_watch(keys, self._ready, conn)
            if not isinstance(got2, Waiter):
                if kind == w.WAIT:
                    self._queue(conn, _OK_EMPTY)
                else:
                    self._reply(conn, w.OK, got2)
                return
            got = got2
        conn.waiter = got
        conn.kind = kind
        heapq.heappush(self.timers, (time.monotonic() + timeout, next(self._seq), got))

    def _ready(self, waiter: Waiter, values: list[bytes]) -> None:
        conn: Conn = waiter.ctx
        conn.waiter = None
        if conn.sock is None:
            return
        if conn.kind == _TORCH_WAIT:
            conn.out.append(tw.STOP_WAITING)
        elif conn.kind == _TORCH_GET:
            conn.out.append(b"".join(map(tw.string, values)))
        elif conn.kind == w.WAIT:
            self._queue(conn, _OK_EMPTY)
        else:
            self._reply(conn, w.OK, values)
        self.reply_later(conn)
        if conn.inbuf:
            self.resume.append(conn)

    def expire_pending(self, drop: Callable[[Conn], None]) -> None:
        """``drop`` the connections that did not say HELLO in time (oldest first)."""
        now = time.monotonic()
        pending = self.pending
        while pending:
            conn, deadline = next(iter(pending.items()))
            if deadline > now:
                return
            del pending[conn]
            if not (conn.authed or conn.pinged):
                drop(conn)

    def evict_pending(self, drop: Callable[[Conn], None]) -> bool:
        """``drop`` the oldest connection that has not said HELLO; False if there is none."""
        pending = self.pending
        while pending:
            conn = next(iter(pending))
            del pending[conn]
            if conn.sock is not None and not (conn.authed or conn.pinged):
                drop(conn)
                return True
        return False

    def expire(self) -> None:
        now = time.monotonic()
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, waiter = heapq.heappop(timers)
            if not waiter.active:
                continue
            self.kv.cancel(waiter)
            conn: Conn = waiter.ctx
            conn.waiter = None
            if conn.sock is None:
                continue
            missing = waiter.keys if waiter.queue else self.kv.missing(waiter.keys)
            self._reply(conn, w.TIMEOUT, missing)
            self.reply_later(conn)
            if conn.inbuf:
                self.resume.append(conn)

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

    def _op_set(self, conn: Conn, f: list[bytes]) -> None:
        self.kv.set(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_set_quiet(self, conn: Conn, f: list[bytes]) -> None:
        try:
            self.kv.set(self._key(f[0]), self._value(f[1]))
        except DistStoreError as e:
            self._reply(conn, w.LATE_ERROR, [f"set({f[0][:80]!r}) failed: {e}".encode()])

    def _op_get(self, conn: Conn, f: list[bytes]) -> None:
        self._blocking_read(conn, f, w.GET)

    def _op_wait(self, conn: Conn, f: list[bytes]) -> None:
        timeout = w.parse_timeout(f[0])
        keys = f[1:]
        if timeout <= 0:
            missing = self.kv.missing(keys)
            self._reply(conn, w.TIMEOUT, missing) if missing else self._queue(conn, _OK_EMPTY)
            return
        got = self.kv.wait_or_watch(keys, self._ready, conn)
        if got is None:
            self._queue(conn, _OK_EMPTY)
            return
        conn.waiter = got
        conn.kind = w.WAIT
        heapq.heappush(self.timers, (time.monotonic() + timeout, next(self._seq), got))

    def _blocking_read(self, conn: Conn, f: list[bytes], kind: int) -> None:
        timeout = w.parse_timeout(f[0])
        keys = f[1:]
        if timeout <= 0:
            missing = [k for k in keys if k not in self.kv.data]
            if missing:
                self._reply(conn, w.TIMEOUT, missing)
                return
        self._park(conn, keys, max(timeout, 0.0), kind, queue=False)

    def _op_add(self, conn: Conn, f: list[bytes]) -> None:
        key, text = f
        if len(key) > self.max_key_size:
            self._key(key)  # raises, with the message
        try:
            amount = int(text) if len(text) <= 64 else w.parse_int(text, "add amount")
        except ValueError:
            raise w.ProtocolError(f"add amount must be a decimal integer; got {text[:80]!r}") from None
        total = self.kv.add_text(key, amount)
        conn.out.append(_ONE_FIELD.pack(5 + len(total), w.OK, len(total)) + total)

    def quick_add(self, conn: Conn, buf: bytearray, n: int) -> bytes | None:
        """The reply to the frame in ``buf[:n]`` from the authenticated ``conn`` when it is
        an ADD in the usual case: well formed, a key within the limit, an amount of a few
        digits, and the key absent or holding an integer. None for anything else: the
        frame then takes the general path, which gives the same answer or the error.
        (Counters are the store's hottest request; this serves one with no field list and
        no dispatch. A client usually bumps one counter by one amount again and again: a
        frame equal to this connection's last ADD is not parsed again.)"""
        frame, size, key, amount = conn.last_add
        if n == size and buf.startswith(frame):
            # The key exists unless a delete took it: add in place, as KVState.add_text.
            data = self._data
            current = data.get(key)
            if current is not None:
                try:
                    total = b"%d" % (int(current) + amount)
                except ValueError:
                    return None
                data[key] = total
                size = len(total)
                return (_OK_HEADS[size] if size < _OK_HEADS_N else _ONE_FIELD.pack(5 + size, w.OK, size)) + total
        else:
            if n < 13 or buf[4] != w.ADD:
                return None
            unpack = w.U32.unpack_from
            if unpack(buf, 0)[0] != n - 4 or n - 4 > conn.limit:
                return None
            end = 9 + unpack(buf, 5)[0]
            if end + 4 > n or end - 9 > self.max_key_size:
                return None
            start = end + 4
            if start + unpack(buf, end)[0] != n or n - start > 20:
                return None
            try:
                amount = int(buf[start:n])
            except ValueError:
                return None
            key = bytes(buf[9:end])
            conn.last_add = (bytes(buf[:n]), n, key, amount)
        try:
            total = self.kv.add_text(key, amount)
        except DistStoreError:
            return None
        size = len(total)
        return (_OK_HEADS[size] if size < _OK_HEADS_N else _ONE_FIELD.pack(5 + size, w.OK, size)) + total

    def quick_get(self, conn: Conn, buf: bytearray, n: int) -> bytes | None:
        """The reply to the frame in ``buf[:n]`` from the authenticated ``conn`` when it is
        a GET of one key that is set, with a well-formed timeout and a value small enough
        to be joined to its reply's head. None for anything else (a key not set yet parks,
        several keys, a large value): the frame then takes the general path, which gives
        the same answer. (A rank's reads of an address or a status are the store's most
        common read; this serves one with no field list, no dispatch and no queued reply.)"""
        if n < 21 or buf[4] != w.GET or n - 4 > conn.limit:
            return None
        unpack = w.U32.unpack_from
        if unpack(buf, 0)[0] != n - 4 or unpack(buf, 5)[0] != 8 or unpack(buf, 17)[0] != n - 21:
            return None  # not one timeout field and one key filling the frame
        (timeout,) = w.F64.unpack_from(buf, 9)
        if timeout != timeout:
            return None  # NaN: the general path drops the connection
        value = self._data.get(bytes(buf[21:n]))
        if value is None or len(value) >= JOIN_THRESHOLD:
            return None
        size = len(value)
        return _ONE_FIELD.pack(5 + size, w.OK, size) + value

    def _op_cas(self, conn: Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, [self.kv.compare_set(self._key(f[0]), f[1], self._value(f[2]))])

    def _op_check(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self.kv.check(f) else _ZERO)

    def _op_delete(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self.kv.delete(f[0]) else _ZERO)

    def _op_num_keys(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self.kv.num_keys()).encode()]))

    def _op_multi_set(self, conn: Conn, f: list[bytes]) -> None:
        for i in range(0, len(f), 2):
            self._key(f[i])
            self._value(f[i + 1])
        for i in range(0, len(f), 2):
            self.kv.set(f[i], f[i + 1])
        self._queue(conn, _OK_EMPTY)

    def _op_append(self, conn: Conn, f: list[bytes]) -> None:
        key = self._key(f[0])
        current = self.kv.data.get(key, b"")
        if len(current) + len(f[1]) > self.max_value_size:
            raise DistStoreError(f"append would grow the value to {len(current) + len(f[1])} bytes, "
                                 f"over the server's limit of {self.max_value_size} bytes")
        self.kv.append(key, f[1])
        self._queue(conn, _OK_EMPTY)

    def _op_qpush(self, conn: Conn, f: list[bytes]) -> None:
        self.kv.queue_push(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_qpop(self, conn: Conn, f: list[bytes]) -> None:
        timeout = w.parse_timeout(f[0])
        if timeout <= 0:
            value = self.kv.queue_pop_now(f[1])
            if value is None:
                self._queue(conn, w.encode_frame(w.EMPTY, []))
            else:
                self._reply(conn, w.OK, [value])
            return
        self._park(conn, [f[1]], timeout, w.QPOP, queue=True)

    def _op_qlen(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self.kv.queue_len(f[0])).encode()]))

    def _op_list_keys(self, conn: Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, self.kv.list_keys())


# -- torch's protocol ---------------------------------------------------------------------

_TORCH_WAIT = 200
_TORCH_GET = 201
_TORCH_FORMAT = struct.Struct("<q")


def _tkey(key: bytes) -> bytes:
    """A torch client's key as gpucoll stores it: torch's client sends ``k`` as ``/k``."""
    return key[1:] if key[:1] == tw.KEY_PREFIX else key


def torch_request(srv: Requests, conn: Conn, q: int, a: list[object]) -> None:
    """Serve one request of a torch client (see _torch_wire) on ``srv``'s store.

    Failures (a value over the limit, ``add`` on a non-integer) raise DistStoreError
    or ProtocolError, and the caller closes the connection, as torch's own server
    does; the torch client then sees the connection reset.
    """
    kv = srv.kv
    out = conn.out
    i64 = _TORCH_FORMAT.pack
    if not conn.pinged and q not in (Q.VALIDATE, Q.PING):
        if srv._token is not None:
            raise w.ProtocolError("torch clients cannot present this server's token")
    if q == Q.VALIDATE:
        if a[0] != tw.MAGIC:
            raise w.ProtocolError(f"torch VALIDATE with a wrong magic number {a[0]:#x}")
    elif q == Q.PING:
        if a[0] == tw.PROBE_NONCE and not conn.pinged:
            # A gpucoll client probing: it speaks gpucoll's protocol from here on.
            out.append(tw.UPGRADE)
            conn.torch = False
            return
        if srv._token is not None:
            raise w.ProtocolError("torch clients cannot present this server's token")
        conn.pinged = True
        srv.pending.pop(conn, None)
        out.append(tw.U32.pack(int(a[0])))  # type: ignore[call-overload]
    elif q == Q.SET:
        kv.set(srv._key(_tkey(a[0])), srv._value(a[1]))  # type: ignore[arg-type]
    elif q == Q.GET or q == Q.MULTI_GET:
        raw = cast("list[bytes]", a[0]) if q == Q.MULTI_GET else [cast(bytes, a[0])]
        keys = [_tkey(k) for k in raw]
        got = kv.get_or_watch(keys, srv._ready, conn)
        if isinstance(got, Waiter):
            conn.waiter = got
            conn.kind = _TORCH_GET
        else:
            out.append(b"".join(map(tw.string, got)))
    elif q == Q.WAIT:
        got2 = kv.wait_or_watch([_tkey(k) for k in a[0]], srv._ready, conn)  # type: ignore[attr-defined]
        if got2 is None:
            out.append(tw.STOP_WAITING)
        else:
            conn.waiter = got2
            conn.kind = _TORCH_WAIT
    elif q == Q.CANCEL_WAIT:
        if conn.waiter is not None:
            kv.cancel(conn.waiter)
            conn.waiter = None
        out.append(tw.WAIT_CANCELED)
    elif q == Q.ADD:
        try:
            out.append(i64(kv.add(srv._key(_tkey(a[0])), int(a[1]))))  # type: ignore[arg-type, call-overload]
        except struct.error as e:
            raise w.ProtocolError(f"add: the sum does not fit torch's int64: {e}") from None
    elif q == Q.CHECK:
        out.append(tw.READY if kv.check([_tkey(k) for k in a[0]]) else tw.NOT_READY)  # type: ignore[attr-defined]
    elif q == Q.COMPARE_SET:
        out.append(tw.string(kv.compare_set(srv._key(_tkey(a[0])), a[1],  # type: ignore[arg-type]
                                            srv._value(a[2]))))  # type: ignore[arg-type]
    elif q == Q.GETNUMKEYS:
        out.append(i64(kv.num_keys()))
    elif q == Q.DELETE_KEY:
        # torch's delete_key leaves a queue of the same name alone.
        key = _tkey(a[0])  # type: ignore[arg-type]
        found = kv.data.get(key) is not None
        if found:
            queue = kv.queues.pop(key, None)
            kv.delete(key)
            if queue is not None:
                kv.queues[key] = queue
        out.append(i64(1 if found else 0))
    elif q == Q.APPEND:
        srv._op_append(conn, [_tkey(cast(bytes, a[0])), cast(bytes, a[1])])
        out.pop()  # torch's append has no reply
    elif q == Q.MULTI_SET:
        items: list[bytes] = a[0]  # type: ignore[assignment]
        for j in range(0, len(items), 2):
            srv._key(_tkey(items[j]))
            srv._value(items[j + 1])
        for j in range(0, len(items), 2):
            kv.set(_tkey(items[j]), items[j + 1])
    elif q == Q.QUEUE_PUSH:
        kv.queue_push(srv._key(_tkey(a[0])), srv._value(a[1]))  # type: ignore[arg-type]
    elif q == Q.QUEUE_POP:
        value = kv.queue_pop_now(_tkey(a[0]))  # type: ignore[arg-type]
        out.append(i64(0) if value is None else i64(1) + tw.string(value))
    elif q == Q.QUEUE_LEN:
        out.append(i64(kv.queue_len(_tkey(a[0]))))  # type: ignore[arg-type]
    elif q == Q.BARRIER:
        # The keys of Store.barrier, so that torch's and gpucoll's barriers meet.
        key = _tkey(a[0])  # type: ignore[arg-type]
        if kv.add(srv._key(key + b"/num_members"), 1) == a[1]:
            kv.set(key + b"/last_member", b"1")
        got3 = kv.wait_or_watch([key + b"/last_member"], srv._ready, conn)
        if got3 is None:
            out.append(tw.STOP_WAITING)
        else:
            conn.waiter = got3
            conn.kind = _TORCH_WAIT
    elif q == Q.LIST_KEYS:
        keys = kv.list_keys()
        out.append(tw.U64.pack(len(keys)) + b"".join(tw.string(tw.KEY_PREFIX + k) for k in keys))

"""What the TCPStore server does with each request, and what it answers.

:class:`RequestServer` holds the store (a :class:`KVState`), the parked requests and
their deadlines, and the per-connection output queues; :class:`StoreServer` (in
``_server``) feeds it frames and sends what it queues.

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
import socket
import struct
import time
from typing import Callable, Union

from ..errors import DistStoreError
from . import _wire as w
from ._kv import KVState, Waiter

__all__ = ["RequestServer", "Conn", "JOIN_THRESHOLD", "PIPELINE_SLACK"]

PREAUTH_MAX_FRAME = 8192
PIPELINE_SLACK = 1 << 20
"""Bytes a client may queue behind a parked request before it is taken for a flood."""
JOIN_THRESHOLD = 64 * 1024
"""Replies smaller than this are joined into one buffer; larger ones go out by sendmsg
without copying the values."""
_OK_EMPTY = w.encode_frame(w.OK, [])
_ONE_FIELD = struct.Struct("<IBI")
"""Header of a reply with one field: length, code, the field's length."""
_ONE = w.encode_frame(w.OK, [b"1"])
_ZERO = w.encode_frame(w.OK, [b"0"])

Out = Union[bytes, memoryview]


class Conn:
    __slots__ = ("sock", "inbuf", "out", "authed", "limit", "waiter", "kind", "closing",
                 "writing", "dirty", "big", "big_have")

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


class RequestServer:
    """The store's protocol and semantics, without sockets.

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
        self._kv = KVState()
        self._timers: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._dirty: list[Conn] = []
        self._resume: list[Conn] = []
        handlers: dict[int, Callable[[Conn, list[bytes]], None]] = {
            w.SET: self._op_set, w.GET: self._op_get, w.ADD: self._op_add, w.CAS: self._op_cas,
            w.WAIT: self._op_wait, w.CHECK: self._op_check, w.DELETE: self._op_delete,
            w.NUM_KEYS: self._op_num_keys, w.MULTI_SET: self._op_multi_set,
            w.APPEND: self._op_append, w.QPUSH: self._op_qpush, w.QPOP: self._op_qpop,
            w.QLEN: self._op_qlen, w.LIST_KEYS: self._op_list_keys,
        }
        # Indexed by opcode: (fewest fields, most fields, handler), or None.
        self._table: list[tuple[int, int, Callable[[Conn, list[bytes]], None]] | None] = [None] * 256
        for code, handler in handlers.items():
            lo, hi = w.ARITY[code]
            self._table[code] = (lo, 1 << 30 if hi is None else hi, handler)

    # -- frames in ------------------------------------------------------------------------

    def _dispatch(self, conn: Conn, code: int, fields: list[bytes]) -> None:
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
        conn.limit = self.max_frame
        self._reply(conn, w.OK, [str(self.max_key_size).encode(), str(self.max_value_size).encode(),
                                 str(self.max_frame).encode()])

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

    def _reply_later(self, conn: Conn) -> None:
        """Flush ``conn`` at the end of this loop iteration (a reply made while serving
        another connection)."""
        if not conn.dirty:
            conn.dirty = True
            self._dirty.append(conn)

    # -- waiting --------------------------------------------------------------------------

    def _park(self, conn: Conn, keys: list[bytes], timeout: float, kind: int,
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
        conn: Conn = waiter.ctx
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
            conn: Conn = waiter.ctx
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

    def _op_set(self, conn: Conn, f: list[bytes]) -> None:
        self._kv.set(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_get(self, conn: Conn, f: list[bytes]) -> None:
        self._blocking_read(conn, f, w.GET)

    def _op_wait(self, conn: Conn, f: list[bytes]) -> None:
        self._blocking_read(conn, f, w.WAIT)

    def _blocking_read(self, conn: Conn, f: list[bytes], kind: int) -> None:
        timeout = w.parse_timeout(f[0])
        keys = f[1:]
        if timeout <= 0:
            missing = self._kv.missing(keys)
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
        total = b"%d" % self._kv.add(key, amount)
        conn.out.append(_ONE_FIELD.pack(5 + len(total), w.OK, len(total)) + total)

    def _op_cas(self, conn: Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, [self._kv.compare_set(self._key(f[0]), f[1], self._value(f[2]))])

    def _op_check(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self._kv.check(f) else _ZERO)

    def _op_delete(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, _ONE if self._kv.delete(f[0]) else _ZERO)

    def _op_num_keys(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self._kv.num_keys()).encode()]))

    def _op_multi_set(self, conn: Conn, f: list[bytes]) -> None:
        for i in range(0, len(f), 2):
            self._key(f[i])
            self._value(f[i + 1])
        for i in range(0, len(f), 2):
            self._kv.set(f[i], f[i + 1])
        self._queue(conn, _OK_EMPTY)

    def _op_append(self, conn: Conn, f: list[bytes]) -> None:
        key = self._key(f[0])
        current = self._kv.data.get(key, b"")
        if len(current) + len(f[1]) > self.max_value_size:
            raise DistStoreError(f"append would grow the value to {len(current) + len(f[1])} bytes, "
                                 f"over the server's limit of {self.max_value_size} bytes")
        self._kv.append(key, f[1])
        self._queue(conn, _OK_EMPTY)

    def _op_qpush(self, conn: Conn, f: list[bytes]) -> None:
        self._kv.queue_push(self._key(f[0]), self._value(f[1]))
        self._queue(conn, _OK_EMPTY)

    def _op_qpop(self, conn: Conn, f: list[bytes]) -> None:
        timeout = w.parse_timeout(f[0])
        if timeout <= 0:
            value = self._kv.queue_pop_now(f[1])
            if value is None:
                self._queue(conn, w.encode_frame(w.EMPTY, []))
            else:
                self._reply(conn, w.OK, [value])
            return
        self._park(conn, [f[1]], timeout, w.QPOP, queue=True)

    def _op_qlen(self, conn: Conn, f: list[bytes]) -> None:
        self._queue(conn, w.encode_frame(w.OK, [str(self._kv.queue_len(f[0])).encode()]))

    def _op_list_keys(self, conn: Conn, f: list[bytes]) -> None:
        self._reply(conn, w.OK, self._kv.list_keys())

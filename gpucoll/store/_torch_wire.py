"""torch.distributed's TCPStore wire protocol (torch 2.x), as gpucoll speaks it.

Learnt from torch's c10d sources and from the bytes a torch 2.13 client and server
exchange on loopback. Integers are little-endian; there are no frames:

    request     u8 query type, then its arguments
    string      u64 length, then the bytes (keys; torch's client prefixes every key with "/")
    bytes       u64 length, then the bytes (values)
    list        u64 count, then that many strings (or key/value pairs for MULTI_SET)

A connection opens with VALIDATE (u32 magic) and PING (u32 nonce, echoed back).
SET, APPEND, MULTI_SET and QUEUE_PUSH get no reply. A client's ``get`` is WAIT then
GET; a WAIT that the client gives up on is followed by CANCEL_WAIT, answered with
WAIT_CANCELED (after STOP_WAITING when the keys arrived meanwhile). BARRIER (key, i64
world size) is answered STOP_WAITING once that many have entered, and is cancelled the
same way.

gpucoll's own clients probe a server with VALIDATE and PING carrying
:data:`PROBE_NONCE` (above any process id, so no torch client sends it): a torch
server echoes it, a gpucoll server answers :data:`UPGRADE` and reads a gpucoll
HELLO next on the same connection.
"""

from __future__ import annotations

import struct
from typing import Final, Union

from ._wire import ProtocolError

__all__ = ["Q", "MAGIC", "PREFIX", "PROBE_NONCE", "UPGRADE", "Incomplete", "parse_request",
           "string", "request"]

Buf = Union[bytes, bytearray, memoryview]


class Q:
    """Query types (the first byte of a request)."""

    VALIDATE: Final = 0
    SET: Final = 1
    COMPARE_SET: Final = 2
    GET: Final = 3
    ADD: Final = 4
    CHECK: Final = 5
    WAIT: Final = 6
    GETNUMKEYS: Final = 7
    DELETE_KEY: Final = 8
    APPEND: Final = 9
    MULTI_GET: Final = 10
    MULTI_SET: Final = 11
    CANCEL_WAIT: Final = 12
    PING: Final = 13
    QUEUE_PUSH: Final = 14
    QUEUE_POP: Final = 15
    QUEUE_LEN: Final = 16
    LIST_KEYS: Final = 17
    BARRIER: Final = 18


MAGIC: Final = 0x3C85F7CE
PREFIX: Final = bytes([Q.VALIDATE]) + struct.pack("<I", MAGIC)
"""The first five bytes of every torch client connection."""
READY: Final = b"\x00"
NOT_READY: Final = b"\x01"
STOP_WAITING: Final = b"\x00"
WAIT_CANCELED: Final = b"\x01"
PROBE_NONCE: Final = 0x47504353
UPGRADE: Final = b"GPC\x01"
"""A gpucoll server's answer to a PING carrying PROBE_NONCE."""
KEY_PREFIX: Final = b"/"
"""torch's client sends key ``k`` as ``/k``; gpucoll's server stores it as ``k``."""

U32: Final = struct.Struct("<I")
U64: Final = struct.Struct("<Q")
I64: Final = struct.Struct("<q")

# Arguments per query: s = string/bytes (u64 length + data), i = i64, u = u32,
# L = u64 count then that many strings, P = u64 count then that many (string, bytes).
_ARGS: Final[dict[int, str]] = {
    Q.VALIDATE: "u", Q.SET: "ss", Q.COMPARE_SET: "sss", Q.GET: "s", Q.ADD: "si", Q.CHECK: "L",
    Q.WAIT: "L", Q.GETNUMKEYS: "", Q.DELETE_KEY: "s", Q.APPEND: "ss", Q.MULTI_GET: "L",
    Q.MULTI_SET: "P", Q.CANCEL_WAIT: "", Q.PING: "u", Q.QUEUE_PUSH: "ss", Q.QUEUE_POP: "s",
    Q.QUEUE_LEN: "s", Q.LIST_KEYS: "", Q.BARRIER: "si",
}
NAMES: Final = {Q.VALIDATE: "validate", Q.SET: "set", Q.COMPARE_SET: "compare_set", Q.GET: "get",
                Q.ADD: "add", Q.CHECK: "check", Q.WAIT: "wait", Q.GETNUMKEYS: "num_keys",
                Q.DELETE_KEY: "delete_key", Q.APPEND: "append", Q.MULTI_GET: "multi_get",
                Q.MULTI_SET: "multi_set", Q.CANCEL_WAIT: "cancel_wait", Q.PING: "ping",
                Q.QUEUE_PUSH: "queue_push", Q.QUEUE_POP: "queue_pop", Q.QUEUE_LEN: "queue_len",
                Q.LIST_KEYS: "list_keys", Q.BARRIER: "barrier"}


class Incomplete(Exception):
    """The buffer ends inside a request: read more."""


def parse_request(buf: Buf, pos: int, end: int, max_item: int,
                  max_count: int = 1 << 20) -> tuple[int, list[object], int]:
    """Parse the request at ``buf[pos:end]``.

    Args:
        buf: received bytes.
        pos, end: where the request starts and where the received bytes end.
        max_item: the longest string or value accepted (a longer announced length is a
            ProtocolError at once, before anything is buffered for it).
        max_count: the most keys in one list.

    Returns:
        ``(query, args, next_pos)``: strings and values as bytes, integers as int, lists
        as lists of bytes (MULTI_SET: alternating keys and values).

    Raises:
        Incomplete: the request is not all there yet.
        ProtocolError: an unknown query or an absurd length.
    """
    if pos >= end:
        raise Incomplete
    q = buf[pos]
    spec = _ARGS.get(q)
    if spec is None:
        raise ProtocolError(f"unknown torch query type {q}")
    pos += 1
    args: list[object] = []
    for kind in spec:
        if kind == "u":
            if end - pos < 4:
                raise Incomplete
            args.append(U32.unpack_from(buf, pos)[0])
            pos += 4
        elif kind == "i":
            if end - pos < 8:
                raise Incomplete
            args.append(I64.unpack_from(buf, pos)[0])
            pos += 8
        elif kind == "s":
            item, pos = _item(buf, pos, end, max_item)
            args.append(item)
        else:
            if end - pos < 8:
                raise Incomplete
            (count,) = U64.unpack_from(buf, pos)
            pos += 8
            if count > max_count:
                raise ProtocolError(f"a list of {count} items exceeds the limit of {max_count}")
            items: list[bytes] = []
            for _ in range(count * (2 if kind == "P" else 1)):
                item, pos = _item(buf, pos, end, max_item)
                items.append(item)
            args.append(items)
    return q, args, pos


def _item(buf: Buf, pos: int, end: int, max_item: int) -> tuple[bytes, int]:
    if end - pos < 8:
        raise Incomplete
    (n,) = U64.unpack_from(buf, pos)
    if n > max_item:
        raise ProtocolError(f"an item of {n} bytes exceeds the limit of {max_item} bytes")
    pos += 8
    if end - pos < n:
        raise Incomplete
    return bytes(buf[pos:pos + n]), pos + n


def string(data: bytes) -> bytes:
    """Encode a string or value: u64 length, then the bytes."""
    return U64.pack(len(data)) + data


def request(q: int, *parts: bytes) -> bytes:
    """Encode a request from its query type and already-encoded arguments."""
    return bytes([q]) + b"".join(parts)

"""The TCPStore wire format: length-prefixed binary frames.

Every message, in both directions, is one frame::

    u32 length      little-endian; bytes that follow (the code byte and the fields)
    u8  code        an opcode (requests) or a status (replies)
    field*          each: u32 length, then that many bytes

A request's fields are fixed per opcode (see ``ARITY``): keys are UTF-8, values are
raw bytes, counts and amounts are decimal ASCII (so ``add`` has no 64-bit overflow),
timeouts are little-endian float64 seconds. The first frame on a connection must be
HELLO (magic, version, token); the server answers it with its limits, or with an
ERROR and a close. The same encoding is the record format of :class:`FileStore`'s log.

Anything that does not parse is a :class:`ProtocolError`; the server drops the
connection that sent it and carries on.
"""

from __future__ import annotations

import struct
from typing import Final, Union

__all__ = [
    "ProtocolError", "encode_frame", "decode_fields", "FrameReader",
    "MAGIC", "VERSION", "HEADER", "U32", "F64", "MAX_TIMEOUT",
]

Buf = Union[bytes, bytearray, memoryview]

MAGIC: Final = b"GPCS"
VERSION: Final = 1

HEADER: Final = struct.Struct("<IB")
"""Frame header: payload length (code + fields), then the code."""
U32: Final = struct.Struct("<I")
F64: Final = struct.Struct("<d")

# Requests.
HELLO: Final = 1
SET: Final = 2
GET: Final = 3
ADD: Final = 4
CAS: Final = 5
WAIT: Final = 6
CHECK: Final = 7
DELETE: Final = 8
NUM_KEYS: Final = 9
MULTI_SET: Final = 10
APPEND: Final = 11
QPUSH: Final = 12
QPOP: Final = 13
QLEN: Final = 14
LIST_KEYS: Final = 15
SET_QUIET: Final = 16
"""``set`` with no reply on success; a failure is answered LATE_ERROR, ahead of the reply
to the connection's next request."""
# FileStore log records only (never sent over TCP).
REC_DELETE: Final = 64
REC_QPOP: Final = 65

# Replies.
OK: Final = 0
TIMEOUT: Final = 1
"""A blocking request ran out of time; the fields are the keys still missing."""
ERROR: Final = 2
"""The request was understood but failed; one field, a UTF-8 message."""
EMPTY: Final = 3
"""A non-blocking ``queue_pop`` found the queue empty."""
LATE_ERROR: Final = 4
"""An earlier SET_QUIET on this connection failed; one field, a UTF-8 message. The reply
to the request in hand follows."""

ARITY: Final[dict[int, tuple[int, int | None]]] = {
    # opcode: (minimum fields, maximum fields or None for "any")
    HELLO: (3, 3),        # magic+version, token, reserved
    SET: (2, 2),          # key, value
    GET: (2, None),       # timeout, key+
    ADD: (2, 2),          # key, decimal amount
    CAS: (3, 3),          # key, expected, desired
    WAIT: (2, None),      # timeout, key+
    CHECK: (1, None),     # key+
    DELETE: (1, 1),       # key
    NUM_KEYS: (0, 0),
    MULTI_SET: (2, None), # key, value, key, value, ... (even count)
    APPEND: (2, 2),       # key, value
    QPUSH: (2, 2),        # key, value
    QPOP: (2, 2),         # timeout (<= 0: do not block), key
    QLEN: (1, 1),         # key
    LIST_KEYS: (0, 0),
    SET_QUIET: (2, 2),    # key, value
}

NAMES: Final = {HELLO: "hello", SET: "set", GET: "get", ADD: "add", CAS: "compare_set",
                WAIT: "wait", CHECK: "check", DELETE: "delete_key", NUM_KEYS: "num_keys",
                MULTI_SET: "multi_set", APPEND: "append", QPUSH: "queue_push",
                QPOP: "queue_pop", QLEN: "queue_len", LIST_KEYS: "list_keys", SET_QUIET: "set"}


class ProtocolError(Exception):
    """Bytes that are not a well-formed frame (internal; never escapes the store)."""


def encode_frame(code: int, fields: "list[bytes] | tuple[bytes, ...]") -> bytes:
    """Encode one frame.

    Args:
        code: opcode or status, 0..255.
        fields: the frame's fields, each bytes-like.

    Returns:
        The frame, header included.
    """
    parts = [b""]
    size = 1
    pack = U32.pack
    for f in fields:
        n = len(f)
        parts.append(pack(n))
        parts.append(f)
        size += 4 + n
    parts[0] = HEADER.pack(size, code)
    return b"".join(parts)


_COPY_WHOLE = 4096
"""Frames up to this size are copied whole before being split (see decode_fields)."""


def decode_fields(buf: Buf, start: int, end: int) -> list[bytes]:
    """Split ``buf[start:end]`` into its length-prefixed fields.

    Args:
        buf: the bytes holding a frame.
        start: index of the first field (just after the code byte).
        end: index just past the frame.

    Returns:
        The fields as ``bytes``.

    Raises:
        ProtocolError: a field length runs past ``end``.
    """
    fields: list[bytes] = []
    unpack = U32.unpack_from
    if type(buf) is not bytes and end - start <= _COPY_WHOLE:
        # One copy of a small frame, then plain bytes slices: cheaper than a memoryview
        # slice plus a copy per field (the server's add/get/set path).
        buf = bytes(buf[start:end])
        end -= start
        start = 0
    if type(buf) is bytes and end - start >= 4:
        # One or two fields (most requests and replies): no loop.
        mid = start + 4 + U32.unpack_from(buf, start)[0]
        if mid == end:
            return [buf[start + 4:end]]
        if mid + 4 <= end and mid + 4 + U32.unpack_from(buf, mid)[0] == end:
            return [buf[start + 4:mid], buf[mid + 4:end]]
    pos = start
    while pos < end:
        if end - pos < 4:
            raise ProtocolError(f"truncated field header at byte {pos - start}")
        (n,) = unpack(buf, pos)
        pos += 4
        if n > end - pos:
            raise ProtocolError(f"field of {n} bytes runs past the end of its frame")
        # A bytes slice is bytes already; a bytearray/memoryview slice is copied once.
        field = buf[pos:pos + n]
        fields.append(field if type(field) is bytes else bytes(field))
        pos += n
    return fields


class FrameReader:
    """Reassembles frames from a byte stream (used for tests, fuzzing and FileStore).

    Args:
        max_frame: the largest payload accepted; a longer announced length is an error
            at once, before any of it is buffered.
    """

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: Buf) -> list[tuple[int, list[bytes]]]:
        """Add ``data`` and return every frame now complete, as ``(code, fields)``.

        Raises:
            ProtocolError: a zero or over-limit length, or fields that do not fit.
        """
        self._buf += data
        buf = self._buf
        out: list[tuple[int, list[bytes]]] = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = U32.unpack_from(buf, pos)
            check_length(length, self.max_frame)
            end = pos + 4 + length
            if end > n:
                break
            out.append((buf[pos + 4], decode_fields(buf, pos + 5, end)))
            pos = end
        del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)


def check_length(length: int, max_frame: int) -> None:
    """Raise ProtocolError unless ``0 < length <= max_frame``."""
    if length == 0:
        raise ProtocolError("frame of length 0 (a frame holds at least its code byte)")
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_frame} bytes")


def check_arity(code: int, nfields: int) -> None:
    """Raise ProtocolError unless ``code`` is a known request with a valid field count."""
    spec = ARITY.get(code)
    if spec is None:
        raise ProtocolError(f"unknown opcode {code}")
    lo, hi = spec
    if nfields < lo or (hi is not None and nfields > hi):
        raise ProtocolError(f"{NAMES[code]} takes {lo}..{hi} fields; got {nfields}")
    if code == MULTI_SET and nfields % 2:
        raise ProtocolError(f"multi_set takes key/value pairs; got {nfields} fields")


MAX_TIMEOUT: Final = 1e6
"""Longest wait the server parks a request for (11.6 days): a longer timeout means this
one. Kernel timeouts (epoll, SO_RCVTIMEO) overflow not far beyond."""


def timeout_field(seconds: float) -> bytes:
    """Encode a timeout in seconds as a field's bytes."""
    return F64.pack(seconds)


def parse_timeout(field: bytes) -> float:
    """Decode a timeout field.

    Raises:
        ProtocolError: not 8 bytes, or NaN.
    """
    if len(field) != 8:
        raise ProtocolError(f"timeout field must be 8 bytes; got {len(field)}")
    (t,) = F64.unpack(field)
    if t != t:
        raise ProtocolError("timeout is NaN")
    return min(float(t), MAX_TIMEOUT)


def parse_int(field: bytes, what: str) -> int:
    """Decode a decimal ASCII integer field.

    Raises:
        ProtocolError: not a decimal integer of at most 64 digits.
    """
    if not 0 < len(field) <= 64 or not field.lstrip(b"-").isdigit():
        raise ProtocolError(f"{what} must be a decimal integer; got {field[:80]!r}")
    return int(field)

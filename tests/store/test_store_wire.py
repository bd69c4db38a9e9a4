"""Property-based tests of the wire codec, and fuzzing of a live server with random and
malformed frames: the server must drop what it cannot parse and keep serving."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpucoll.store import TCPStore
from gpucoll.store import _wire as w

fields_st = st.lists(st.binary(max_size=300), max_size=8)


@given(code=st.integers(0, 255), fields=fields_st, cuts=st.lists(st.integers(0, 4000), max_size=6))
def test_encode_then_read_in_any_chunking(code: int, fields: list[bytes], cuts: list[int]) -> None:
    frame = w.encode_frame(code, fields)
    stream = frame * 3
    points = sorted({c % (len(stream) + 1) for c in cuts})
    reader = w.FrameReader(1 << 20)
    got = []
    prev = 0
    for p in points + [len(stream)]:
        got += reader.feed(stream[prev:p])
        prev = p
    assert got == [(code, fields)] * 3
    assert reader.buffered == 0


@given(code=st.integers(0, 255), fields=fields_st)
def test_decode_fields_inverts_encode(code: int, fields: list[bytes]) -> None:
    frame = w.encode_frame(code, fields)
    (length,) = w.U32.unpack_from(frame, 0)
    assert length == len(frame) - 4
    assert frame[4] == code
    assert w.decode_fields(frame, 5, len(frame)) == fields
    assert w.decode_fields(memoryview(bytearray(frame)), 5, len(frame)) == fields


@given(data=st.binary(max_size=2000))
def test_random_bytes_parse_or_raise_protocol_error(data: bytes) -> None:
    reader = w.FrameReader(1024)
    try:
        frames = reader.feed(data)
    except w.ProtocolError:
        return
    for code, fields in frames:
        assert 0 <= code <= 255 and all(isinstance(f, bytes) for f in fields)


@given(n=st.integers(1025, 2**32 - 1))
def test_over_limit_length_rejected_before_payload(n: int) -> None:
    with pytest.raises(w.ProtocolError, match="exceeds the limit"):
        w.FrameReader(1024).feed(struct.pack("<I", n))


def test_check_arity_knows_every_request() -> None:
    for code, (lo, _hi) in w.ARITY.items():
        w.check_arity(code, lo + (lo % 2 if code == w.MULTI_SET else 0))
    with pytest.raises(w.ProtocolError, match="unknown opcode"):
        w.check_arity(99, 0)
    with pytest.raises(w.ProtocolError):
        w.check_arity(w.SET, 3)


@given(st.floats(allow_nan=False))
def test_timeout_field_roundtrip(t: float) -> None:
    assert w.parse_timeout(w.timeout_field(t)) == min(t, w.MAX_TIMEOUT)


# -- the live server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server() -> Iterator[TCPStore]:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10,
                 token="tok", max_value_size=4096)
    try:
        yield m
    finally:
        m.close()


def _hello(token: bytes = b"tok") -> bytes:
    return w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"), token, b""])


def _poke(port: int, payload: bytes) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(payload)
        s.settimeout(0.05)
        try:
            while s.recv(65536):
                pass
        except (socket.timeout, ConnectionResetError):
            pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server already dropped us, which is fine
    finally:
        s.close()


def _assert_serving(m: TCPStore) -> None:
    assert m._server is not None and m._server.running
    c = TCPStore("127.0.0.1", m.port, timeout=5, token="tok")
    c.set("fuzz-health", b"ok")
    assert c.get("fuzz-health") == b"ok"
    assert c.add("fuzz-count", 1) >= 1
    c.close()


_fuzz = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(junk=st.binary(min_size=1, max_size=600), authed=st.booleans())
def test_server_survives_random_bytes(server: TCPStore, junk: bytes, authed: bool) -> None:
    _poke(server.port, (_hello() if authed else b"") + junk)
    _assert_serving(server)


request_st = st.tuples(
    st.integers(0, 255),
    st.lists(st.one_of(st.binary(max_size=40),
                       st.floats(allow_nan=True, allow_infinity=True).map(w.timeout_field),
                       st.integers(-10**20, 10**20).map(lambda i: str(i).encode()),
                       st.just(b"\xff" * 5000)),
             max_size=6),
)


@_fuzz
@given(requests=st.lists(request_st, min_size=1, max_size=5),
       token=st.sampled_from([b"tok", b"bad", b""]),
       truncate=st.integers(0, 50))
def test_server_survives_random_well_framed_requests(server: TCPStore,
                                                     requests: list[tuple[int, list[bytes]]],
                                                     token: bytes, truncate: int) -> None:
    payload = _hello(token) + b"".join(w.encode_frame(c, f) for c, f in requests)
    if truncate:
        payload = payload[:-truncate]
    _poke(server.port, payload)
    _assert_serving(server)

"""The server's quick GET (``Requests.quick_get``) against its general path.

A read of one key that is set is answered in the read path itself, with no field list,
dispatch or queued reply. Each test serves the same frame through the quick path and
through the general one (``dispatch``, the reference): the quick path must give the
same reply, or decline and leave the store as it was, so that the general path answers.
The end-to-end behaviour of ``get`` (parking, timeouts, large values, torch's clients)
is what the rest of tests/store checks, through a server that now takes this path.
"""

from __future__ import annotations

import math
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from gpucoll.store import TCPStore
from gpucoll.store import _wire as w
from gpucoll.store._requests import JOIN_THRESHOLD, Conn, Requests


def _server(state: dict[bytes, bytes]) -> Requests:
    server = Requests(token=None, max_key_size=64, max_value_size=1 << 20)
    for k, v in state.items():
        server.kv.set(k, v)
    return server


def _authed() -> Conn:
    conn = Conn(None)  # type: ignore[arg-type]
    conn.authed = True
    conn.limit = 1 << 30
    return conn


def _general(server: Requests, frame: bytes) -> bytes | str:
    """What the general path does with ``frame``: its reply, "parked", or the error."""
    conn = _authed()
    try:
        server.dispatch(conn, frame[4], w.decode_fields(frame, 5, len(frame)))
    except (w.ProtocolError, ValueError) as e:
        return type(e).__name__
    if conn.waiter is not None:
        return "parked"
    return b"".join(bytes(p) for p in conn.out)


keys = st.binary(min_size=0, max_size=10)
small_values = st.binary(max_size=40)
timeouts = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([0.0, -1.0, 60.0, math.nan]))


@settings(max_examples=300, deadline=None)
@given(state=st.dictionaries(keys, small_values, max_size=4), key=keys, timeout=timeouts,
       tail=st.binary(max_size=16), big=st.booleans())
def test_quick_get_answers_as_the_general_path_or_leaves_the_frame_to_it(
        state: dict[bytes, bytes], key: bytes, timeout: float, tail: bytes, big: bool) -> None:
    if big and state:
        # A value too large to be joined to its reply's head: the general path's (sendmsg).
        state[next(iter(state))] = b"v" * JOIN_THRESHOLD
    frame = w.encode_frame(w.GET, [struct.pack("<d", timeout), key])
    server = _server(state)
    reply = server.quick_get(_authed(), bytearray(frame + tail), len(frame))
    expected = _general(_server(state), frame)
    if reply is None:
        # Declined: a key not set (the general path parks or times out), NaN, a large value.
        assert key not in state or timeout != timeout or len(state[key]) >= JOIN_THRESHOLD
        assert server.kv.data == state
    else:
        assert reply == expected
        assert key in state and len(state[key]) < JOIN_THRESHOLD


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(st.binary(max_size=40),
                      st.lists(st.binary(max_size=12), min_size=0, max_size=4).map(
                          lambda fs: w.encode_frame(w.GET, fs)[5:])),
       code=st.one_of(st.just(w.GET), st.integers(0, 255)), skew=st.sampled_from([0, 0, 1, -1]),
       n_extra=st.integers(0, 8))
def test_quick_get_never_misreads_a_malformed_frame(body: bytes, code: int, skew: int,
                                                   n_extra: int) -> None:
    """Any frame (any bytes or any fields, any request code, a length that does not match
    what was read) is served only if the general path reads it as a GET of one key after
    an 8-byte timeout, and then as it would. Every key it could name is set."""
    frame = w.HEADER.pack(max(0, 1 + len(body) + skew), code) + body
    state = {bytes(body[i:j]): b"value" for i in range(min(len(body), 24))
             for j in range(i, min(len(body), 24) + 1)}
    reply = _server(state).quick_get(_authed(), bytearray(frame + b"\0" * n_extra), len(frame))
    if reply is not None:
        assert code == w.GET and skew == 0
        fields = w.decode_fields(frame, 5, len(frame))
        assert len(fields) == 2 and len(fields[0]) == 8
        assert reply == _general(_server(state), frame)


def test_quick_get_declines_several_keys_and_a_key_that_does_not_fill_the_frame() -> None:
    """A GET of two keys (multi_get) is the general path's, even when the bytes after the
    first key's length happen to spell a key that is set; so is one key whose length
    says less than the frame holds (the general path refuses it)."""
    two = w.encode_frame(w.GET, [w.timeout_field(1.0), b"a", b"b"])
    state = {b"a": b"1", b"b": b"2", bytes(two[21:]): b"not this"}
    assert _server(state).quick_get(_authed(), bytearray(two), len(two)) is None
    assert _general(_server(state), two) == w.encode_frame(w.OK, [b"1", b"2"])
    one = w.encode_frame(w.GET, [w.timeout_field(1.0), b"key"]) + b"++"
    one = w.U32.pack(len(one) - 4) + one[4:]
    state = {b"key++": b"not this", b"key": b"v"}
    assert _server(state).quick_get(_authed(), bytearray(one), len(one)) is None
    assert _general(_server(state), one) == "ProtocolError"


def test_quick_get_declines_a_frame_over_the_connections_limit() -> None:
    """Before HELLO a connection's frames are limited (the general path refuses a longer
    one); the quick path never answers past that limit."""
    frame = w.encode_frame(w.GET, [w.timeout_field(1.0), b"k" * 40])
    conn = _authed()
    conn.limit = len(frame) - 5
    assert _server({b"k" * 40: b"v"}).quick_get(conn, bytearray(frame), len(frame)) is None
    conn.limit = len(frame) - 4
    assert _server({b"k" * 40: b"v"}).quick_get(conn, bytearray(frame), len(frame)) is not None


def test_get_through_a_server_set_missing_and_large_values() -> None:
    """End to end, one server: a set key (the quick path), a key set after the get parked,
    a value too large for it, an empty value, and the value changed between two gets."""
    import threading

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    try:
        client.set("a", b"1")
        assert [client.get("a") for _ in range(3)] == [b"1"] * 3
        client.set("a", b"22")
        assert client.get("a") == b"22"
        client.set("empty", b"")
        assert client.get("empty") == b""
        big = bytes(range(256)) * (2 * JOIN_THRESHOLD // 256)
        client.set("big", big)
        assert client.get("big") == big
        later = threading.Timer(0.2, lambda: master.set("late", b"here"))
        later.start()
        assert client.get("late") == b"here"
        later.join()
        assert client.add("n", 5) == 5 and client.get("n") == b"5"
    finally:
        client.close()
        master.close()

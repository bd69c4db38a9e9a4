"""The counter hot path, end to end and against the general path.

The client serves ``add``/``check`` through a lean path when a pooled connection is
ready (no spin due) and the reply arrives whole; the server serves a well-formed ADD
in place (``quick_add``). Every test here runs the same calls through both client
paths, and the server's quick path is checked against its general one (``_op_add``,
the reference), so a divergence between them fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpucoll.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from gpucoll.store import TCPStore
from gpucoll.store import _native, _wire as w
from gpucoll.store._links import GRACE
from gpucoll.store._requests import Conn, Requests



def _lean(store: TCPStore) -> None:
    """Every pooled connection takes the lean path on its next requests."""
    for conn in store._links.pool:
        conn.skip_spin = 1 << 30


def _general(store: TCPStore) -> None:
    """Every pooled connection takes the general path (a spin is due) on its next request."""
    for conn in store._links.pool:
        conn.skip_spin = 0


PATHS: dict[str, Callable[[TCPStore], None]] = {"lean": _lean, "general": _general}


@pytest.fixture(params=["compiled", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which loop serves the repeated ADD: the compiled one (gpucoll/store/_native.c), or
    the loop's Python, as where it cannot be built."""
    if request.param == "compiled":
        if _native.module() is None:
            pytest.skip(f"the store's compiled loop is not built here: {_native.why_not()}")
    else:
        monkeypatch.setattr(_native, "_module", None)
        monkeypatch.setattr(_native, "_tried", True)
    return str(request.param)


@pytest.fixture(params=["unix", "tcp"])
def master(request: pytest.FixtureRequest, loop: str) -> Iterator[TCPStore]:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10,
                 max_value_size=100, use_unix_socket=request.param == "unix")
    assert m._server is not None and (m._server.native is None) == (loop == "python")
    try:
        yield m
    finally:
        m.close()


def _client(m: TCPStore, **kw: Any) -> TCPStore:
    kw.setdefault("timeout", 10)
    return TCPStore("127.0.0.1", m.port, use_unix_socket=m._server is not None
                    and m._server.unix_name is not None, **kw)


@pytest.mark.parametrize("path", PATHS)
def test_add_and_check_follow_a_reference_counter(master: TCPStore, path: str) -> None:
    c = _client(master)
    try:
        ref: dict[str, int] = {}
        ops = ([("a", 1)] * 5 + [("a", 7), ("b", 1), ("a", 1), ("b", -3), ("a", 0)]
               + [("big", 10**30), ("big", 1), ("big", -(10**31))] + [("a", 1)] * 3
               + [("c" * 200, 2), ("c" * 200, 2)])
        for key, amount in ops:
            PATHS[path](c)
            ref[key] = ref.get(key, 0) + amount
            assert c.add(key, amount) == ref[key], (key, amount)
            PATHS[path](c)
            assert c.check([key]) is True
            PATHS[path](c)
            assert c.check([key + "/absent"]) is False
        for key, total in ref.items():
            assert master.get(key) == str(total).encode()
    finally:
        c.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_repeated_add_follows_the_counters_changes_between_repeats(master: TCPStore,
                                                                   path: str) -> None:
    """The same ADD frame again and again (the server answers it in its loop when the
    frame and the counter allow) across what other calls do to the counter between
    repeats: a set to a new integer, a delete, a set to text, a value past 19 digits."""
    c = _client(master)

    def set_(value: bytes) -> None:
        master.set("rep", value)
        assert master.get("rep") == value  # the set has landed (a set has no reply)

    try:
        def add(expected: int) -> None:
            PATHS[path](c)
            assert c.add("rep", 5) == expected

        add(5)
        add(10)
        set_(b"-3")
        add(2)
        master.delete_key("rep")
        add(5)
        set_(b"x1")
        PATHS[path](c)
        with pytest.raises(DistStoreError, match="add.*not a decimal integer"):
            c.add("rep", 5)
        assert master.get("rep") == b"x1"
        set_(str(10**25).encode())
        add(10**25 + 5)
        add(10**25 + 10)
        set_(str(10**19 - 6).encode())
        add(10**19 - 1)
        add(10**19 + 4)
        add(10**19 + 9)
        assert master.get("rep") == str(10**19 + 9).encode()
    finally:
        c.close()


def test_the_loops_last_counter_value_is_read_only_from_the_text_it_wrote(master: TCPStore) -> None:
    """The server's loop keeps the text of the counter it wrote last with its value, and
    takes the value without parsing when a counter holds that very text. Repeated adds
    from two connections on two counters, with sets between them to the same digits, to
    other digits and to the empty value (on a fresh server, the first repeat), follow a
    reference counter; the add on the empty value is the general path's error."""
    a, b = _client(master), _client(master)

    def set_(key: str, value: bytes) -> None:
        master.set(key, value)
        assert master.get(key) == value  # the set has landed (a set has no reply)

    try:
        _lean(a)
        assert a.add("e", 1) == 1
        set_("e", b"")
        _lean(a)
        with pytest.raises(DistStoreError, match="add.*not a decimal integer"):
            a.add("e", 1)  # the same frame again: served by the loop, or left to the general path
        ref = {"p": 0, "q": 0}
        steps: list[tuple[TCPStore, str, int]] = [(a, "p", 3), (b, "q", 2)] * 4
        for i, (c, key, amount) in enumerate(steps * 3):
            if i == 8:
                set_("p", str(ref["p"]).encode())  # the same digits, another object
            elif i == 12:
                set_("q", str(ref["p"]).encode())  # the other counter's digits
                ref["q"] = ref["p"]
            elif i == 17:
                set_("p", b"40")
                ref["p"] = 40
            _lean(c)
            ref[key] += amount
            assert c.add(key, amount) == ref[key], (i, key)
        assert master.get("p") == str(ref["p"]).encode() and master.get("q") == str(ref["q"]).encode()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("path", PATHS)
def test_add_on_a_non_integer_is_an_error_and_the_connection_stays_usable(
        master: TCPStore, path: str) -> None:
    c = _client(master)
    try:
        c.set("text", b"not a number")
        PATHS[path](c)
        with pytest.raises(DistStoreError, match="add.*not a decimal integer"):
            c.add("text", 1)
        PATHS[path](c)
        assert c.add("n", 2) == 2
        assert master.get("text") == b"not a number"
    finally:
        c.close()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["add", "check"])
def test_a_failed_quiet_set_surfaces_on_the_next_call(master: TCPStore, path: str, op: str) -> None:
    c = _client(master)
    try:
        # The server's limit is 100 bytes; a client that believes otherwise sends the
        # set, which the server refuses after the client has returned.
        c.max_value_size = 1000
        c.set("big", b"x" * 500)
        PATHS[path](c)
        with pytest.raises(DistStoreError, match=rf"earlier set.*exceeds.*this {op} itself was"):
            if op == "add":
                c.add("after", 5)
            else:
                c.check(["after"])
        if op == "add":
            assert master.get("after") == b"5"  # it was carried out
        PATHS[path](c)
        assert c.add("after", 1) == (6 if op == "add" else 1)
        assert not master.check(["big"])
    finally:
        c.close()


# -- set's quick path (a key set again with a value of the same size) ----------------------

def _set_general(store: TCPStore) -> None:
    """The next set takes the general path (_set), as for a key never set before."""
    store._last_set = (None, 0, b"", 0.0, 0)


SET_PATHS: dict[str, Callable[[TCPStore], None]] = {"quick": lambda store: None,
                                                    "general": _set_general}


@pytest.mark.parametrize("path", SET_PATHS)
def test_sets_leave_what_a_reference_dict_holds(master: TCPStore, path: str) -> None:
    c = _client(master)
    try:
        ref: dict[str, bytes] = {}
        ops = ([("a", b"%02d" % i) for i in range(5)] + [("a", b"longer"), ("b", b"xy"), ("a", b"again!")]
               + [("a", b""), ("a", b""), ("b", b"z" * 90), ("b", b"w" * 90), ("k" * 150, b"v")] * 2)
        for key, value in ops:
            SET_PATHS[path](c)
            c.set(key, value)
            ref[key] = value
            assert c.get(key) == value, (key, value)
            assert master.get(key) == value
        for key, value in ref.items():
            assert master.get(key) == value
    finally:
        c.close()


def test_a_quick_set_follows_a_lowered_limit_and_a_new_timeout(master: TCPStore) -> None:
    c = _client(master)
    try:
        c.set("k", b"x" * 50)
        c.set("k", b"y" * 50)
        c.set_timeout(3.0)
        c.set("k", b"z" * 50)
        assert c.get("k") == b"z" * 50  # on the same connection: after the set
        assert [conn.timeout for conn in c._links.pool] == [3.0 + GRACE]
        c.max_value_size = 40
        with pytest.raises(ValueError, match="value of 50 bytes exceeds the limit of 40 bytes"):
            c.set("k", b"w" * 50)
        assert c.get("k") == b"z" * 50
        c.set("k", b"v" * 30)
        c.set("k", b"u" * 30)
        assert c.get("k") == b"u" * 30
        c.close()
        with pytest.raises(DistStoreError, match="set on a closed"):
            c.set("k", b"t" * 30)
        assert master.get("k") == b"u" * 30
    finally:
        c.close()


@pytest.mark.parametrize("op", ["add", "check"])
def test_a_failed_quick_set_surfaces_on_the_next_call(master: TCPStore, op: str) -> None:
    c = _client(master)
    try:
        c.max_value_size = 1000  # the server's limit is 100 bytes
        c.set("big", b"x" * 500)
        with pytest.raises(DistStoreError, match=r"earlier set.*exceeds"):
            c.check(["any"])
        c.set("big", b"y" * 500)  # the quick path: the same key, the same size
        with pytest.raises(DistStoreError, match=rf"earlier set.*exceeds.*this {op} itself was"):
            if op == "add":
                c.add("after", 5)
            else:
                c.check(["after"])
        assert not master.check(["big"])
    finally:
        c.close()


# -- a server in another process, to stop and kill ---------------------------------------

def _serve(conn: Pipe) -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    conn.send(m.port)
    conn.recv()


@pytest.fixture
def remote() -> Iterator[tuple[Any, int]]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    assert parent.poll(30), "store server did not start"
    port = parent.recv()
    try:
        yield proc, port
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.join(10)


def _wait_stopped(pid: int) -> None:
    """Return once every thread of ``pid`` is stopped (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["add", "check"])
def test_a_stalled_server_times_out_naming_the_call(remote: tuple[Any, int], path: str,
                                                    op: str) -> None:
    proc, port = remote
    c = TCPStore("127.0.0.1", port, timeout=0.5)
    try:
        assert c.add("warm", 1) == 1
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_stopped(proc.pid)
        PATHS[path](c)
        t0 = time.monotonic()
        with pytest.raises(DistStoreTimeoutError, match=rf"{op} got no reply from .* within"):
            c.add("n", 1) if op == "add" else c.check(["n"])
        assert time.monotonic() - t0 < 5
        os.kill(proc.pid, signal.SIGCONT)
        assert c.add("warm", 1) == 2  # a fresh connection; the store carries on
    finally:
        c.close()


def test_a_quick_set_to_a_dead_server_is_a_network_error_naming_it(remote: tuple[Any, int]) -> None:
    proc, port = remote
    c = TCPStore("127.0.0.1", port, timeout=5)
    try:
        c.set("k", b"1")
        c.set("k", b"2")
        assert c._links.pool and c._last_set[0] == "k"
        proc.kill()
        proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="set"):
            for _ in range(100):  # over TCP the first sends may still be taken by the kernel
                c.set("k", b"3")
        assert time.monotonic() - t0 < 5
    finally:
        c.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_dead_server_is_a_network_error_naming_the_call(remote: tuple[Any, int],
                                                          path: str) -> None:
    proc, port = remote
    c = TCPStore("127.0.0.1", port, timeout=5)
    try:
        assert c.add("warm", 1) == 1
        proc.kill()
        proc.join(10)
        PATHS[path](c)
        t0 = time.monotonic()
        with pytest.raises(DistNetworkError, match="add"):
            c.add("n", 1)
        assert time.monotonic() - t0 < 5
    finally:
        c.close()


# -- the server's quick add against its general path --------------------------------------

def _frame(key: bytes, amount: bytes) -> bytes:
    return w.encode_frame(w.ADD, [key, amount])


def _general_reply(server: Requests, frame: bytes) -> bytes | str:
    conn = Conn(None)  # type: ignore[arg-type]
    try:
        fields = w.decode_fields(frame, 5, len(frame))
        server._op_add(conn, fields)
    except (DistStoreError, w.ProtocolError, ValueError) as e:
        return type(e).__name__
    return b"".join(bytes(p) for p in conn.out)


values = st.one_of(st.integers(-10**25, 10**25).map(lambda i: b"%d" % i),
                   st.sampled_from([b"", b"x", b" 3", b"1_000", b"--1"]))
amounts = st.one_of(st.integers(-10**40, 10**40).map(lambda i: b"%d" % i),
                    st.sampled_from([b"", b"abc", b" 7 ", b"1_0", b"+5", b"\xff"]))
keys = st.binary(min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(state=st.dictionaries(keys, values, max_size=4), key=keys, amount=amounts,
       tail=st.binary(max_size=16))
def test_quick_add_answers_as_the_general_path_or_leaves_the_frame_to_it(
        state: dict[bytes, bytes], key: bytes, amount: bytes, tail: bytes) -> None:
    quick = Requests(token=None, max_key_size=8, max_value_size=1 << 20)
    general = Requests(token=None, max_key_size=8, max_value_size=1 << 20)
    for k, v in state.items():
        quick.kv.set(k, v)
        general.kv.set(k, v)
    frame = _frame(key, amount)
    # The receive buffer holds whatever came before; only its first n bytes are the frame.
    # The same frame twice on one connection: the second is served from the first's parse.
    conn = Conn(None)  # type: ignore[arg-type]
    for _ in range(2):
        _serve_both(quick, general, conn, frame, tail)


def _serve_both(quick: Requests, general: Requests, conn: Conn, frame: bytes, tail: bytes) -> None:
    """``frame`` served by quick_add on ``quick`` (by the general path where quick_add
    declines it, as the server does) and by the general path on ``general``: the same
    reply and the same store after."""
    before = dict(quick.kv.data)
    reply = quick.quick_add(conn, bytearray(frame + tail), len(frame))
    expected = _general_reply(general, frame)
    if reply is None:
        assert quick.kv.data == before  # left untouched for the general path
        _general_reply(quick, frame)
    else:
        assert reply == expected
    assert quick.kv.data == general.kv.data


@settings(max_examples=200, deadline=None)
@given(frames=st.lists(st.tuples(st.sampled_from([b"a", b"bb", b"a" * 9, b"x"]),
                                 st.sampled_from([b"1", b"2", b"-1", b"x", b"10"])), max_size=12),
       tail=st.binary(max_size=8))
def test_quick_add_over_a_connections_frames_answers_as_the_general_path(
        frames: list[tuple[bytes, bytes]], tail: bytes) -> None:
    """A connection's frames in turn, repeating or not (the key "x" holds text, "a" * 9 is
    over the key limit): each is answered as the general path answers it."""
    quick = Requests(token=None, max_key_size=8, max_value_size=1 << 20)
    general = Requests(token=None, max_key_size=8, max_value_size=1 << 20)
    quick.kv.set(b"x", b"text")
    general.kv.set(b"x", b"text")
    conn = Conn(None)  # type: ignore[arg-type]
    for key, amount in frames:
        _serve_both(quick, general, conn, _frame(key, amount), tail)


@settings(max_examples=300, deadline=None)
@given(fields=st.one_of(st.binary(max_size=40), st.tuples(keys, amounts)),
       n_extra=st.integers(0, 8), code=st.one_of(st.just(w.ADD), st.integers(0, 255)),
       skew=st.sampled_from([0, 0, 1, -1]))
def test_quick_add_never_misreads_a_malformed_frame(fields: bytes | tuple[bytes, bytes],
                                                   n_extra: int, code: int, skew: int) -> None:
    """Any frame (any bytes or two well-formed fields, any request code, a length that
    does not match what was read) is served only if the general path reads it as a
    two-field ADD, and then as it would."""
    server = Requests(token=None, max_key_size=64, max_value_size=1 << 20)
    body = fields if isinstance(fields, bytes) else w.encode_frame(code, list(fields))[5:]
    frame = w.HEADER.pack(max(0, 1 + len(body) + skew), code) + body
    reply = server.quick_add(Conn(None), bytearray(frame + b"\0" * n_extra), len(frame))  # type: ignore[arg-type]
    if reply is not None:
        assert code == w.ADD and skew == 0
        # Only a frame that the general path reads as a two-field ADD is served.
        fields = w.decode_fields(frame, 5, len(frame))
        assert len(fields) == 2
        assert reply == _general_reply(Requests(token=None, max_key_size=64,
                                                     max_value_size=1 << 20), frame)

"""TCPStore beyond the shared contract: construction, limits, threads, scale, and faults
(a server that goes away or stops answering, connections that send garbage)."""

from __future__ import annotations

import inspect
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import gpucoll.store
import gpucoll.store._client
import gpucoll.store._requests
import gpucoll.store._server
import gpucoll.store.tcp
from gpucoll.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from gpucoll.store import TCPStore
from gpucoll.store import _wire as w


@pytest.fixture(params=["unix", "tcp"])
def master(request: pytest.FixtureRequest) -> Iterator[TCPStore]:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10,
                 token="s3cret", use_unix_socket=request.param == "unix")
    try:
        yield m
    finally:
        m.close()


def _client(m: TCPStore, **kw: Any) -> TCPStore:
    kw.setdefault("timeout", 10)
    kw.setdefault("token", "s3cret")
    return TCPStore("127.0.0.1", m.port, use_unix_socket=m._server is not None
                    and m._server.unix_name is not None, **kw)


def _hello(token: bytes = b"s3cret") -> bytes:
    return w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"), token, b""])


def _raw(port: int, hello: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if hello:
        s.sendall(_hello())
        code, _ = _read_frame(s)
        assert code == w.OK
    return s


def _read_frame(s: socket.socket) -> tuple[int, list[bytes]]:
    reader = w.FrameReader(1 << 30)
    while True:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("closed")
        frames = reader.feed(data)
        if frames:
            assert len(frames) == 1
            return frames[0]


def _closed_by_server(s: socket.socket, within: float = 2.0) -> bool:
    s.settimeout(within)
    try:
        while True:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _healthy(m: TCPStore) -> None:
    c = _client(m)
    c.set("health", b"ok")
    assert c.get("health") == b"ok"
    c.close()


# -- construction ---------------------------------------------------------------------------

def test_port_zero_picks_a_port_and_clients_connect(master: TCPStore) -> None:
    assert 0 < master.port < 65536
    assert master.is_master
    c = _client(master)
    assert not c.is_master and c.port == master.port
    c.set("k", b"v")
    assert master.get("k") == b"v"
    c.close()


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"port": 70000}, ValueError, "port"),
    ({"port": -1}, ValueError, "port"),
    ({"port": 0, "is_master": False}, ValueError, "port 0"),
    ({"port": 0, "is_master": True, "world_size": 0}, ValueError, "TCPStore world size cannot be 0"),
    ({"port": 0, "is_master": True, "token": 5}, TypeError, "token"),
    ({"port": 0, "is_master": True, "max_value_size": 0}, ValueError, "max_value_size"),
    ({"port": 0, "is_master": True, "timeout": -2}, ValueError, "timeout"),
])
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], exc: type, match: str) -> None:
    kwargs.setdefault("wait_for_workers", False)
    with pytest.raises(exc, match=match):
        TCPStore("127.0.0.1", **kwargs)


def test_port_in_use_is_a_network_error() -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_unix_socket=False)
    try:
        with pytest.raises(DistNetworkError, match=str(m.port)):
            TCPStore("127.0.0.1", m.port, is_master=True, wait_for_workers=False)
    finally:
        m.close()


def test_connect_timeout_names_address() -> None:
    # A port nothing listens on: bind one, note it, close it.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - t0 < 1.5


def test_wrong_token_is_refused_and_server_carries_on(master: TCPStore,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUCOLL_STORE_TOKEN", raising=False)
    with pytest.raises(DistStoreError, match="token rejected"):
        _client(master, token="wrong")
    with pytest.raises(DistStoreError, match="token rejected"):
        _client(master, token=None)  # no token at all (env unset in tests)
    _healthy(master)


def test_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOLL_STORE_TOKEN", "from-env")
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5)
    try:
        c = TCPStore("127.0.0.1", m.port, timeout=5)
        c.set("a", b"1")
        with pytest.raises(DistStoreError, match="token rejected"):
            TCPStore("127.0.0.1", m.port, timeout=5, token="other")
        c.close()
    finally:
        m.close()


def test_wait_for_workers_counts_and_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=r"waiting for clients. 1/2 clients joined"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    m = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5)
    try:
        # The join counter is the store's own key: counted by num_keys as torch counts
        # its init key, invisible to list_keys.
        assert m.num_keys() == 1 and m.list_keys() == []
        c = TCPStore("127.0.0.1", m.port, world_size=3, timeout=5)
        c2 = TCPStore("127.0.0.1", m.port, world_size=3, timeout=5)
        m.wait([])  # nothing pending
        assert m.num_keys() == 1
        c.close()
        c2.close()
    finally:
        m.close()


def test_closed_store_raises_and_close_is_idempotent(master: TCPStore) -> None:
    c = _client(master)
    c.close()
    c.close()
    with pytest.raises(DistStoreError, match="closed"):
        c.set("k", b"v")


# -- limits ---------------------------------------------------------------------------------

def test_value_of_64_mib_roundtrips(master: TCPStore) -> None:
    value = os.urandom(1 << 20) * 64
    c = _client(master)
    c.set("big", value)
    assert c.get("big") == value
    assert master.multi_get(["big"])[0] == value
    c.close()


def test_limits_are_clear_errors_on_the_client() -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5,
                 max_key_size=64, max_value_size=1000)
    try:
        c = TCPStore("127.0.0.1", m.port, timeout=5)  # learns the limits on connect
        assert (c.max_key_size, c.max_value_size) == (64, 1000)
        with pytest.raises(ValueError, match="1001 bytes exceeds the limit of 1000"):
            c.set("k", b"x" * 1001)
        with pytest.raises(ValueError, match="exceeds the limit of 64"):
            c.get("k" * 65)
        with pytest.raises(ValueError, match="desired_value"):
            c.compare_set("k", b"", b"x" * 2000)
        c.set("k", b"x" * 1000)
        with pytest.raises(DistStoreError, match="over the server's limit"):
            c.append("k", b"y")
        assert c.get("k") == b"x" * 1000
        c.close()
    finally:
        m.close()


def test_server_enforces_value_limit_on_raw_frames() -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5,
                 max_value_size=1000)
    try:
        s = socket.create_connection(("127.0.0.1", m.port), timeout=5)
        s.sendall(_hello(b""))
        assert _read_frame(s)[0] == w.OK
        s.sendall(w.encode_frame(w.SET, [b"k", b"v" * 1001]))
        code, fields = _read_frame(s)
        assert code == w.ERROR and b"exceeds the server's limit of 1000" in fields[0]
        s.close()
        assert not m.check(["k"])
    finally:
        m.close()


# -- threads and scale ----------------------------------------------------------------------

def test_one_client_shared_by_threads(master: TCPStore) -> None:
    c = _client(master)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                c.add("n", 1)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    blocked = threading.Thread(target=lambda: c.get("later", timeout=10))
    blocked.start()  # a blocked get must not stall the others
    for t in ts:
        t.join(30)
    assert not errors
    assert c.get("n") == b"1600"
    c.set("later", b"x")
    blocked.join(5)
    assert not blocked.is_alive()
    c.close()


def _raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def test_1024_concurrent_clients_blocked_in_get() -> None:
    _raise_nofile(4 * 1024 + 100)
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=60)
    clients: list[TCPStore] = []
    try:
        clients = [TCPStore("127.0.0.1", m.port, timeout=60) for _ in range(1024)]
        assert m._server is not None and m._server.connections >= 1025
        got: list[bytes] = []
        lock = threading.Lock()

        def one(c: TCPStore) -> None:
            c.add("joined", 1)
            v = c.get("go")
            with lock:
                got.append(v)

        ts = [threading.Thread(target=one, args=(c,)) for c in clients]
        for t in ts:
            t.start()
        m.wait(["joined"])
        deadline = time.monotonic() + 30
        while int(m.get("joined")) < 1024 and time.monotonic() < deadline:
            time.sleep(0.01)
        m.set("go", b"all")
        for t in ts:
            t.join(30)
        assert got == [b"all"] * 1024
    finally:
        for c in clients:
            c.close()
        m.close()


# -- no reverse DNS -------------------------------------------------------------------------

def test_no_reverse_name_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a: Any, **k: Any) -> Any:
        raise AssertionError(f"reverse name lookup called with {a}")

    for name in ("gethostbyaddr", "getfqdn", "getnameinfo", "gethostname"):
        monkeypatch.setattr(socket, name, forbidden)
    for unix in (True, False):
        m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=5,
                     use_unix_socket=unix)
        c = TCPStore("127.0.0.1", m.port, timeout=5, use_unix_socket=unix)
        c.set("k", b"v")
        assert m.get("k") == b"v"
        c.close()
        m.close()
    # And nothing in the package's source reaches for them.
    for mod in (gpucoll.store.tcp, gpucoll.store._client, gpucoll.store._server,
                gpucoll.store._requests):
        src = inspect.getsource(mod)
        for name in ("gethostbyaddr", "getfqdn", "getnameinfo"):
            assert name not in src, (mod.__name__, name)


# -- the server going away, or hanging ------------------------------------------------------

def test_server_gone_fails_blocked_and_later_calls_promptly(master: TCPStore) -> None:
    c = _client(master, timeout=30)
    errors: list[BaseException] = []
    when: list[float] = []

    def blocked() -> None:
        try:
            c.get("never")
        except BaseException as e:
            errors.append(e)
            when.append(time.monotonic())

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    master.close()
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], DistNetworkError), errors
    assert when[0] - t0 < 1.0
    t1 = time.monotonic()
    with pytest.raises(DistNetworkError):
        c.set("k", b"v")
    with pytest.raises(DistNetworkError):
        c.get("k")
    assert time.monotonic() - t1 < 1.0
    c.close()


class _SilentServer:
    """Accepts, answers HELLO (with ``hello_reply``), then never replies: a hung server."""

    def __init__(self, hello_reply: bytes = w.encode_frame(w.OK, [b"100", b"1000000", b"3000000"])
                 ) -> None:
        self.hello_reply = hello_reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            reader = w.FrameReader(1 << 20)
            while not reader.feed(conn.recv(65536)):
                pass
            conn.sendall(self.hello_reply)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_hung_server_calls_time_out() -> None:
    srv = _SilentServer()
    try:
        c = TCPStore("127.0.0.1", srv.port, timeout=0.4, use_unix_socket=False, protocol="gpucoll")
        c.set("k", b"v")  # no round trip: a set does not wait for the server
        for call in (lambda: c.check(["k"]), lambda: c.add("k", 1),
                     lambda: c.get("k", timeout=0.3), lambda: c.wait(["k"], timeout=0.3)):
            t0 = time.monotonic()
            with pytest.raises(DistStoreTimeoutError):
                call()
            assert time.monotonic() - t0 < 0.4 + 0.5
        c.close()
    finally:
        srv.close()


@pytest.mark.parametrize("reply", [
    w.encode_frame(w.OK, [b"x", b"y", b"z"]),
    w.encode_frame(w.OK, []),
    w.encode_frame(w.TIMEOUT, [b"1", b"2", b"3"]),
])
def test_not_a_store_server_is_a_clear_error(reply: bytes) -> None:
    srv = _SilentServer(reply)
    try:
        with pytest.raises(DistStoreError, match="is it a gpucoll TCPStore"):
            TCPStore("127.0.0.1", srv.port, timeout=2, use_unix_socket=False, protocol="gpucoll")
    finally:
        srv.close()


# -- bad connections ------------------------------------------------------------------------

def test_garbage_is_dropped_and_others_carry_on(master: TCPStore) -> None:
    s = _raw(master.port, hello=False)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _closed_by_server(s)
    _healthy(master)


def test_request_before_hello_is_dropped(master: TCPStore) -> None:
    s = _raw(master.port, hello=False)
    s.sendall(w.encode_frame(w.SET, [b"k", b"v"]))
    assert _closed_by_server(s)
    assert not master.check(["k"])


@pytest.mark.parametrize("hello", [False, True])
def test_absurd_length_is_dropped_at_once(master: TCPStore, hello: bool) -> None:
    s = _raw(master.port, hello=hello)
    s.sendall(struct.pack("<I", 0xFFFFFFF0) + b"\x02")
    assert _closed_by_server(s, within=1.0)
    _healthy(master)


def test_zero_length_frame_is_dropped(master: TCPStore) -> None:
    s = _raw(master.port)
    s.sendall(struct.pack("<I", 0))
    assert _closed_by_server(s)


def test_truncated_frame_then_close(master: TCPStore) -> None:
    s = _raw(master.port)
    frame = w.encode_frame(w.SET, [b"half", b"x" * 100])
    s.sendall(frame[: len(frame) // 2])
    s.close()
    _healthy(master)
    assert not master.check(["half"])


@pytest.mark.parametrize("frame", [
    w.encode_frame(200, []),                                   # unknown opcode
    w.encode_frame(w.SET, [b"k"]),                             # too few fields
    w.encode_frame(w.MULTI_SET, [b"a", b"1", b"b"]),           # odd key/value list
    w.encode_frame(w.GET, [b"short", b"k"]),                   # timeout not 8 bytes
    w.encode_frame(w.GET, [w.F64.pack(float("nan")), b"k"]),   # NaN timeout
    w.encode_frame(w.ADD, [b"k", b"12x"]),                     # amount not decimal
    w.HEADER.pack(10, w.SET) + struct.pack("<I", 500) + b"abcde",  # field past frame end
])
def test_malformed_requests_are_dropped(master: TCPStore, frame: bytes) -> None:
    s = _raw(master.port)
    s.sendall(frame)
    assert _closed_by_server(s)
    _healthy(master)


def test_pipelined_requests_answered_in_order(master: TCPStore) -> None:
    s = _raw(master.port)
    frames = [w.encode_frame(w.ADD, [b"p", b"1"]) for _ in range(5)]
    frames.append(w.encode_frame(w.GET, [w.F64.pack(5.0), b"p"]))
    s.sendall(b"".join(frames))
    reader = w.FrameReader(1 << 20)
    got: list[tuple[int, list[bytes]]] = []
    while len(got) < 6:
        got += reader.feed(s.recv(65536))
    assert got == [(w.OK, [str(i).encode()]) for i in range(1, 6)] + [(w.OK, [b"5"])]
    s.close()


def test_requests_behind_a_blocked_get_wait_their_turn(master: TCPStore) -> None:
    s = _raw(master.port)
    s.sendall(w.encode_frame(w.GET, [w.F64.pack(5.0), b"gate"]) +
              w.encode_frame(w.ADD, [b"behind", b"1"]))
    time.sleep(0.2)
    assert not master.check(["behind"])  # not served while the GET is parked
    master.set("gate", b"open")
    reader = w.FrameReader(1 << 20)
    got: list[tuple[int, list[bytes]]] = []
    while len(got) < 2:
        got += reader.feed(s.recv(65536))
    assert got == [(w.OK, [b"open"]), (w.OK, [b"1"])]
    s.close()


def test_dropped_waiter_does_not_leak_into_later_clients(master: TCPStore) -> None:
    s = _raw(master.port)
    s.sendall(w.encode_frame(w.QPOP, [w.F64.pack(30.0), b"jobs"]))
    time.sleep(0.1)
    s.close()
    time.sleep(0.1)
    c = _client(master)
    c.queue_push("jobs", b"j1")
    # The closed connection's pop must not have swallowed the item.
    assert c.queue_pop("jobs", timeout=2) == b"j1"
    c.close()


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, -1.0, 0.0])
def test_extreme_timeouts_on_the_wire(master: TCPStore, timeout: float) -> None:
    s = _raw(master.port)
    s.sendall(w.encode_frame(w.GET, [w.F64.pack(timeout), b"xt"]))
    time.sleep(0.1)
    _healthy(master)
    master.set("xt", b"now")
    code, fields = _read_frame(s)
    if timeout > 0:
        assert (code, fields) == (w.OK, [b"now"])
    else:
        assert (code, fields) == (w.TIMEOUT, [b"xt"])
    s.close()


def test_huge_client_timeouts_work(master: TCPStore) -> None:
    c = _client(master, timeout=1e12)
    c.set("k", b"v")
    assert c.get("k", timeout=1e300) == b"v"
    c.close()

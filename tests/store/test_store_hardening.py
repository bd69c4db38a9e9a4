"""The TCPStore server under hostile clients, a restarted server, and FileStore's lock
held by a stopped process.

Hostile clients talk raw bytes to a server in its own process (so that its memory
and descriptors are its own, and measurable); every loop is bounded and every socket
has a timeout.
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from gpucoll.errors import DistError, DistNetworkError, DistStoreError
from gpucoll.store import FileStore, TCPStore
from gpucoll.store import _torch_wire as tw
from gpucoll.store import _wire as w
from gpucoll.store._server import StoreServer

_REPO = str(Path(__file__).resolve().parents[2])
_GIB = 1 << 30


def _hello(token: bytes = b"") -> bytes:
    pad = b"" if (19 + len(token)) % 256 else b"\x01"
    return w.encode_frame(w.HELLO, [w.MAGIC + w.VERSION.to_bytes(2, "little"), token, pad])


class _Server:
    """A StoreServer in a child process; ``rss()`` is its resident memory in bytes."""

    def __init__(self, *, token: bytes | None = None, hello_timeout: float = 5.0,
                 nofile: int | None = None) -> None:
        code = textwrap.dedent(f"""
            import resource, sys
            if {nofile!r} is not None:
                # Hard and soft: the server raises its soft limit to the hard one.
                resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile!r}, {nofile!r}))
            from gpucoll.store._server import StoreServer
            s = StoreServer("127.0.0.1", 0, token={token!r}, max_key_size=65536,
                            max_value_size=512 << 20, hello_timeout={hello_timeout!r})
            print(s.port, flush=True)
            sys.stdin.read()
            s.close()
        """)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": _REPO})
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def connect(self, hello: bool = True, token: bytes = b"") -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        if hello:
            s.sendall(_hello(token))
            code, fields = _read_frame(s)
            assert code == w.OK, fields
        return s

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(5)
        except Exception:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    try:
        yield srv
    finally:
        srv.close()


def _read_frame(s: socket.socket) -> tuple[int, list[bytes]]:
    reader = w.FrameReader(1 << 30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("closed")
        frames = reader.feed(data)
        if frames:
            return frames[0]
    raise TimeoutError


def _closed_by_peer(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (TimeoutError, socket.timeout):
        return False


def _good_client(port: int, unix: bool = False) -> TCPStore:
    return TCPStore("127.0.0.1", port, timeout=10, use_unix_socket=unix)


# -- memory ------------------------------------------------------------------------------


def test_announced_gigabyte_frames_do_not_grow_the_server(server: _Server) -> None:
    """Two connections (HELLO without a token) announce ~1 GiB frames and send 5 bytes:
    the server's memory must not follow the announced length."""
    before = server.rss()
    socks = []
    for _ in range(2):
        s = server.connect()
        s.sendall(struct.pack("<IB", _GIB, w.SET) + b"abcd")
        socks.append(s)
    # A torch-protocol client that announces a huge key before its PING is dropped.
    t = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    t.sendall(tw.PREFIX + bytes([tw.Q.SET]) + struct.pack("<Q", 500 << 20) + b"x")
    assert _closed_by_peer(t, 2)  # at once, not at the HELLO deadline (5 s)
    t.close()
    time.sleep(0.3)
    grown = server.rss() - before
    assert grown < 32 << 20, f"server RSS grew by {grown >> 20} MiB for two announced 1 GiB frames"
    good = _good_client(server.port)
    good.set("k", b"v")
    assert good.get("k") == b"v"
    good.close()
    for s in socks:
        s.close()


def test_large_values_still_arrive_whole(server: _Server) -> None:
    good = _good_client(server.port)
    value = random.Random(1).randbytes(9 << 20)
    good.set("big", value)
    assert good.get("big") == value
    good.close()


# -- idle and slow connections -------------------------------------------------------------


def test_slowloris_connections_are_dropped_after_the_hello_deadline() -> None:
    srv = _Server(hello_timeout=0.5)
    socks = []
    try:
        for i in range(40):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(_hello()[: 1 + i % 10])  # a HELLO that never completes
            socks.append(s)
        good = _good_client(srv.port)  # completes its HELLO: kept
        t0 = time.monotonic()
        dropped = sum(_closed_by_peer(s, max(0.05, t0 + 3 - time.monotonic())) for s in socks)
        assert dropped == 40
        time.sleep(0.6)
        good.set("after", b"1")
        assert good.get("after") == b"1"
        good.close()
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_300_idle_connections_do_not_lock_out_a_client() -> None:
    """The server has 128 descriptors; 300 connections never say HELLO. A legitimate
    client (over TCP, like the attackers) still connects and is served."""
    srv = _Server(hello_timeout=60.0, nofile=128)
    socks = []
    try:
        for _ in range(300):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        time.sleep(0.2)
        t0 = time.monotonic()
        good = _good_client(srv.port)
        good.set("k", b"v")
        assert good.add("n", 2) == 2
        assert good.get("k") == b"v"
        assert time.monotonic() - t0 < 5
        good.close()
        # Those still open were never served; most were dropped to make room.
        open_ = sum(not _closed_by_peer(s, 0.01) for s in socks)
        assert open_ <= 128
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_token_server_drops_big_frames_before_hello() -> None:
    srv = _Server(token=b"secret")
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(struct.pack("<IB", _GIB, w.HELLO))
        assert _closed_by_peer(s, 5)
        s.close()
        ok = srv.connect(token=b"secret")
        ok.close()
    finally:
        srv.close()


# -- fairness ------------------------------------------------------------------------------

_FUZZER = textwrap.dedent("""
    import random, socket, struct, sys
    port, frames, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    def frame():
        kind = rng.random()
        if kind < 0.3:   # random bytes
            return rng.randbytes(rng.randint(1, 200))
        if kind < 0.5:   # a huge announced length, a few bytes of it
            return struct.pack("<IB", rng.randint(1 << 20, 1 << 30), rng.randint(0, 20)) + b"x" * 5
        if kind < 0.8:   # a valid header, random fields
            body = bytes([rng.randint(0, 20)]) + rng.randbytes(rng.randint(0, 64))
            return struct.pack("<I", len(body)) + body
        code = rng.choice([2, 3, 4, 6, 7, 13])   # well-formed requests with odd contents
        key = rng.randbytes(8)
        if code in (3, 6, 13):
            fields = [struct.pack("<d", rng.choice([0.0, 1e-3, -1.0])), key]
        elif code == 4:
            fields = [key, rng.choice([b"1", b"x", b"9" * 70])]
        else:
            fields = [key, rng.randbytes(rng.randint(0, 1000))]
        body = bytes([code]) + b"".join(struct.pack("<I", len(f)) + f for f in fields)
        return struct.pack("<I", len(body)) + body
    magic = b"GPCS" + (1).to_bytes(2, "little")
    fields = [magic, b"", b""]
    body = bytes([1]) + b"".join(struct.pack("<I", len(f)) + f for f in fields)
    hello = struct.pack("<I", len(body)) + body
    sent = 0
    s = None
    while sent < frames:
        if s is None:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(hello)
        try:
            s.sendall(frame())
            sent += 1
        except OSError:
            s.close()
            s = None
    print(sent, flush=True)
""")


def test_a_fuzzing_client_does_not_starve_a_good_one(server: _Server) -> None:
    """1,500 fuzzed frames from an authenticated client while a good client works: its
    worst latency stays bounded (bench/store_fairness_bench.py measures it precisely;
    this bound is generous for a loaded CI machine)."""
    good = _good_client(server.port)
    good.set("warm", b"1")
    fuzzer = subprocess.Popen([sys.executable, "-c", _FUZZER, str(server.port), "1500", "7"],
                              stdout=subprocess.PIPE, text=True)
    worst = 0.0
    n = 0
    try:
        deadline = time.monotonic() + 20
        while fuzzer.poll() is None and time.monotonic() < deadline:
            t0 = time.perf_counter()
            good.set(f"k{n % 50}", b"v" * 100)
            assert good.get(f"k{n % 50}") == b"v" * 100
            assert good.add("count", 1) == n + 1
            worst = max(worst, time.perf_counter() - t0)
            n += 1
        assert fuzzer.wait(10) == 0
    finally:
        if fuzzer.poll() is None:
            fuzzer.kill()
            fuzzer.wait(5)
    assert n > 0
    assert worst < 1.0, f"a good client's request took {worst * 1e3:.0f} ms under the fuzzer"
    assert server.proc.poll() is None
    good.close()


# -- same-host credentials -------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_unix_socket_refuses_another_user() -> None:
    srv = StoreServer("127.0.0.1", 0, token=None, max_key_size=1024, max_value_size=1024)
    try:
        assert srv.unix_name is not None
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = b"?"
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(srv.unix_name)
                try:
                    s.sendall(_hello())
                    code = b"C" if s.recv(64) == b"" else b"S"
                except OSError:
                    code = b"C"
            except BaseException:
                code = b"E"
            finally:
                os.write(wfd, code)
                os._exit(0)
        os.close(wfd)
        got = os.read(r, 1)
        os.waitpid(pid, 0)
        os.close(r)
        assert got == b"C", "another uid was served on the store's Unix socket"
        # This user still is (through the same name).
        me = TCPStore("127.0.0.1", srv.port, timeout=5)
        me.set("k", b"v")
        assert me.get("k") == b"v"
        me.close()
    finally:
        srv.close()


# -- a restarted server ----------------------------------------------------------------------


@pytest.mark.parametrize("unix", [True, False])
def test_a_restarted_server_is_reported_not_used(unix: bool) -> None:
    first = StoreServer("127.0.0.1", 0, token=None, max_key_size=1024, max_value_size=1024)
    port = first.port
    client = TCPStore("127.0.0.1", port, timeout=5, use_unix_socket=unix)
    assert client.add("n", 5) == 5
    client.set("k", b"v")
    first.close()
    second = StoreServer("127.0.0.1", port, token=None, max_key_size=1024, max_value_size=1024)
    try:
        with pytest.raises(DistError, match="restarted") as info:
            client.add("n", 1)
        assert isinstance(info.value, (DistNetworkError, DistStoreError))
        # Never the new, empty store: every later call says so too.
        for _ in range(3):
            with pytest.raises(DistStoreError, match="restarted"):
                client.get("k")
        with pytest.raises(DistStoreError, match="restarted"):
            client.clone()
        # A new client of the new server is fine.
        fresh = TCPStore("127.0.0.1", port, timeout=5, use_unix_socket=unix)
        assert fresh.add("n", 1) == 1
        fresh.close()
    finally:
        client.close()
        second.close()


# -- FileStore's lock ------------------------------------------------------------------------


def _bounded(fn: Callable[[], object], seconds: float) -> tuple[BaseException | None, float]:
    """Run ``fn`` on a thread; (its exception or None, seconds taken). Fails, instead of
    hanging, when it has not returned within ``seconds`` (the caller then releases it)."""
    out: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[0] = e

    t0 = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"still blocked after {seconds} s"
    return out[0], time.monotonic() - t0


def test_filestore_lock_held_by_a_stopped_process_times_out(tmp_path: Path) -> None:
    path = tmp_path / "locked.store"
    store = FileStore(str(path), timeout=1.0)
    store.set("k", b"v")
    code = textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(path)!r}, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        os.kill(holder.pid, signal.SIGSTOP)
        err, took = _bounded(lambda: store.get("k"), 5.0)
        assert isinstance(err, DistStoreError), err
        assert 0.9 < took < 3.0, took
        msg = str(err)
        assert str(path) in msg and f"pid {holder.pid}" in msg, msg
        store.set_timeout(0.3)
        err, took = _bounded(lambda: store.set("k2", b"x"), 5.0)
        assert isinstance(err, DistStoreError) and "could not lock" in str(err), err
        assert took < 2.0
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait(5)
    # The holder is gone: the store works again.
    store.set_timeout(5)
    assert store.get("k") == b"v"
    store.close()


def test_filestore_lock_wait_succeeds_when_released_in_time(tmp_path: Path) -> None:
    path = tmp_path / "brief.store"
    store = FileStore(str(path), timeout=5.0)
    store.set("k", b"v")
    fd = os.open(str(path), os.O_RDWR)  # another open file description: it excludes the store
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        timer = threading.Timer(0.3, fcntl.flock, (fd, fcntl.LOCK_UN))
        timer.start()
        err, took = _bounded(lambda: store.get("k"), 10.0)
        timer.join()
        assert err is None, err
        assert 0.25 < took < 3, took
    finally:
        os.close(fd)
        store.close()


# -- no token across hosts -------------------------------------------------------------------


def test_a_multi_host_job_without_a_token_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from gpucoll import _rendezvous

    monkeypatch.setattr(_rendezvous, "_warned_no_token", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rendezvous._warn_if_open("127.0.0.1", 29500, 2, None)  # one host: quiet
        _rendezvous._warn_if_open("127.0.0.1", 29500, 4, "secret")  # a token: quiet
    with pytest.warns(RuntimeWarning, match="GPUCOLL_STORE_TOKEN") as rec:
        _rendezvous._warn_if_open("127.0.0.1", 29500, 4, None)  # 2 of 4 ranks here
    assert "several hosts" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _rendezvous._warn_if_open("10.255.255.1", 29500, 4, None)  # once per process
    monkeypatch.setattr(_rendezvous, "_warned_no_token", False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.warns(RuntimeWarning, match="several hosts"):
        _rendezvous._warn_if_open("10.255.255.1", 29500, 4, None)  # a master on another host

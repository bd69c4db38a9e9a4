"""The store at scale: the benchmark's load generator against the real clients, the
open-file limit raised at server start and refused when too low, and a burst of
connections that the server accepts without dropping any."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Generator

import pytest

from gpucoll.store import TCPStore

_REPO = str(Path(__file__).resolve().parents[2])


def _loadgen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("store_loadgen",
                                                  os.path.join(_REPO, "bench", "store_loadgen.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


lg = _loadgen()


# -- the load generator speaks the protocols as the real clients do -------------------------

_VALUE = bytes(range(256)) * 3


def _steps(client: int) -> list[tuple[str, tuple[Any, ...]]]:
    """One client's requests: every kind the generator makes, keys shared between
    clients (counters) and keys of its own."""
    return [
        ("add", ("shared/count", 3)),
        ("set", (f"own/{client}", _VALUE[client:])),
        ("add", (f"own/n{client}", -client)),
        ("get", (f"own/{client}",)),
        ("check", ([f"own/{client}", "absent"],)),
        ("check", ([f"own/{client}"],)),
        ("add", ("shared/count", 1)),
        ("set", ("shared/last", b"%d" % client)),
        ("wait", (["shared/last"],)),
    ]


def _state(store: TCPStore) -> dict[str, bytes]:
    return {k: store.get(k) for k in sorted(store.list_keys())}


def _by_real_client(port: int, protocol: str, clients: int) -> list[list[Any]]:
    """The same requests through the real client: gpucoll's, or torch's for torch's wire."""
    answers = []
    for c in range(clients):
        if protocol == "torch":
            import torch.distributed as dist
            from datetime import timedelta

            store: Any = dist.TCPStore("127.0.0.1", port, None, False,  # type: ignore[attr-defined]
                                       timedelta(seconds=30))
        else:
            store = TCPStore("127.0.0.1", port, timeout=30, protocol="gpucoll",
                             use_unix_socket=False)
        got = []
        for op, args in _steps(c):
            r = getattr(store, op)(*args)
            got.append(None if op in ("set", "wait") else r)
        answers.append(got)
        if protocol != "torch":
            store.close()
    return answers


def _by_generator(port: int, protocol: str, clients: int) -> list[list[Any]]:
    answers: list[list[Any]] = [[] for _ in range(clients)]

    def script_of(c: int) -> Callable[[Any], Generator[Any, object, None]]:
        def script(ops: Any) -> Generator[Any, object, None]:
            for op, args in _steps(c):
                answers[c].append((yield getattr(ops, op)(*args)))
        return script

    # One after another, as the real clients above ran (the shared keys' final values
    # depend on the order).
    for c in range(clients):
        lg.drive("127.0.0.1", port, protocol, [script_of(c)], timeout=30)
    return answers


@pytest.mark.parametrize("protocol", ["gpucoll", "torch"])
def test_load_generator_leaves_the_state_the_real_client_leaves(protocol: str) -> None:
    if protocol == "torch":
        pytest.importorskip("torch.distributed")
    clients = 3
    servers = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
               for _ in range(2)]
    try:
        real = _by_real_client(servers[0].port, protocol, clients)
        gen = _by_generator(servers[1].port, protocol, clients)
        # torch's client returns check as bool and get as bytes, as gpucoll's does.
        assert gen == real
        assert _state(servers[1]) == _state(servers[0])
        # And the state is what the requests say (an independent reference).
        expected = {"shared/count": b"%d" % (4 * clients), "shared/last": b"%d" % (clients - 1)}
        for c in range(clients):
            expected[f"own/{c}"] = _VALUE[c:]
            expected[f"own/n{c}"] = b"%d" % -c
        assert _state(servers[0]) == dict(sorted(expected.items()))
    finally:
        for s in servers:
            s.close()


def test_load_generator_reports_a_rejected_greeting() -> None:
    """A server that answers the greeting with an error fails the run, naming it."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30,
                      token="right")
    try:
        def script(ops: Any) -> Generator[Any, object, None]:
            yield ops.add("k", 1)
        with pytest.raises(RuntimeError, match="hello: status 2"):
            lg.drive("127.0.0.1", master.port, "gpucoll", [script], timeout=10)
        assert not master.check(["k"])
    finally:
        master.close()


# -- a whole job connecting at once -------------------------------------------------------

def _releaser(master: TCPStore, tag: str, errors: list[BaseException],
              before: Callable[[], object] | None = None) -> threading.Thread:
    """The rendezvous script's master, in a thread: once ``{tag}/all`` is set, release every
    client with ``{tag}/go`` (``before()`` first); errors go to ``errors``."""
    def release() -> None:
        try:
            master.wait([f"{tag}/all"], timeout=60)
            if before is not None:
                before()
            master.set(f"{tag}/go", b"1")
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=release)
    t.start()
    return t


def test_a_burst_of_connections_is_served_without_dropping_any() -> None:
    """1,500 clients connect at once and each says HELLO only once its connect is done:
    the server holds them all while their HELLOs arrive (it once kept 256 and dropped
    the oldest, which then had to reconnect)."""
    n = 1500
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=60)
    stats: dict[str, int] = {}
    errors: list[BaseException] = []
    t = _releaser(master, "burst", errors)
    try:
        ends = lg.drive("127.0.0.1", master.port, "gpucoll", [lg.rendezvous_script("burst", n)] * n,
                        timeout=60, stats=stats)
        t.join(60)
        assert not errors
        assert len(ends) == n and all(ends)
        assert master.get("burst/joined") == b"%d" % n
        assert stats.get("retries", 0) == 0
    finally:
        master.close()
        t.join(5)


def _store_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("store_bench",
                                                  os.path.join(_REPO, "bench", "store_bench.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("store_bench", mod)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["store_bench"])
    return sys.modules["store_bench"]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_the_benchmarks_floor_server_serves_the_rendezvous_script_and_counts_its_cpu() -> None:
    """bench/store_floor.c (the floor the benchmark compares the servers with) builds,
    answers HELLO and every request of the generator's rendezvous script, for a burst
    of clients and pipelined frames alike, serves gpucoll's own client (the --ops-only
    add-throughput rows), and its CPU is readable for the report."""
    sb = _store_bench()
    floor = sb._FloorServer()
    try:
        n = 600
        before = sb._cpu_seconds(floor.pid)
        ends = lg.drive("127.0.0.1", floor.port, "gpucoll", [lg.rendezvous_script("floor", 10 ** 6)] * n,
                        timeout=60)
        assert len(ends) == n and all(ends)
        assert sb._cpu_seconds(floor.pid) >= before
        _answers_as_a_floor(floor.port)
    finally:
        floor.stop()
    with pytest.raises(SystemExit):
        sb.main(["--impl", "floor"])  # without --ops-only the floor has only the rendezvous rows
    with pytest.raises(SystemExit):
        sb.main(["--impl", "floor", "--ops-only", "--rendezvous-only"])


def _answers_as_a_floor(port: int) -> None:
    """A do-nothing floor server on ``port`` answers as the benchmark needs: three frames in
    one write get three replies (OK, one field "1"), in order; gpucoll's own client (the
    add-throughput rows of --ops-only) says HELLO, is given limits, and reaches it by the
    abstract Unix socket it tries first, as it reaches gpucoll's server; every add is
    answered "1"."""
    from gpucoll.store import TCPStore

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(struct.pack("<IB", 1, 4) * 3)
        got = b""
        while len(got) < 30:
            more = s.recv(64)
            assert more
            got += more
        assert got == (struct.pack("<IBI", 6, 0, 1) + b"1") * 3
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ux:
        ux.connect(f"\0gpucoll-store/127.0.0.1:{port}")
    client = TCPStore("127.0.0.1", port, timeout=10)
    try:
        assert [client.add("n", 1) for _ in range(3)] == [1, 1, 1]
    finally:
        client.close()

def test_the_benchmarks_python_floor_answers_as_the_c_floor() -> None:
    """bench/store_floor.py (``--impl floor-py``) answers what store_floor.c answers:
    pipelined frames each get OK "1" in order, gpucoll's client reaches it by the Unix
    socket and every add is answered "1"; the benchmark refuses it outside --ops-only."""
    sb = _store_bench()
    floor = sb._PyFloorServer()
    try:
        _answers_as_a_floor(floor.port)
    finally:
        floor.stop()
    with pytest.raises(SystemExit):
        sb.main(["--impl", "floor-py"])


def test_the_ops_rows_give_each_servers_cpu_per_add_beside_its_rate() -> None:
    """store_bench --ops-only: each add-throughput row has a server-CPU row beside it, one
    value per server, read from that server's process: positive, and no more than the
    wall time per add (one server thread cannot use more than one core)."""
    import argparse

    sb = _store_bench()
    args = argparse.Namespace(iters=50, seconds=0.5, repeats=1, clients=[2])
    rows = {r.name: r for r in sb.interleaved_ops(["gpucoll", "floor-py"], args)}
    rate, cpu = rows["add throughput, 2 clients"], rows["server CPU per add, 2 clients"]
    assert cpu.unit == "us" and not cpu.higher_is_better and rate.higher_is_better
    for impl in ("gpucoll", "floor-py"):
        ops = rate.values[impl]
        assert isinstance(ops, float) and ops > 0
        per_add = cpu.values[impl]
        assert isinstance(per_add, float)
        # 10 ms ticks over half a second of a busy server: some ticks, never more than
        # the wall time of the adds it served (with a tick of slack for the rounding).
        assert 0 < per_add <= (1e6 / ops) * 1.1 + 0.01 / (ops * args.seconds) * 1e6, (impl, per_add, ops)



def test_the_ops_rows_split_the_cpu_and_compare_two_checkouts_servers() -> None:
    """store_bench --ops-only --base-tree: ``gpucoll-base`` is the server of another
    checkout (here this one), beside this checkout's, each serving the add rows in a
    process of its own; each server's CPU per add is split into user and system rows that
    add up to it. Without --ops-only and --base-tree the benchmark refuses gpucoll-base."""
    import argparse

    sb = _store_bench()
    args = argparse.Namespace(iters=50, seconds=0.5, repeats=1, clients=[2], base_tree=_REPO)
    rows = {r.name: r for r in sb.interleaved_ops(["gpucoll", "gpucoll-base"], args)}
    rate = rows["add throughput, 2 clients"]
    cpu, user, system = (rows[f"{k}, 2 clients"] for k in ("server CPU per add", "  user", "  system"))
    for impl in ("gpucoll", "gpucoll-base"):
        assert isinstance(rate.values[impl], float) and rate.values[impl] > 0
        u, s, total = user.values[impl], system.values[impl], cpu.values[impl]
        assert isinstance(u, float) and isinstance(s, float) and isinstance(total, float)
        assert u >= 0 and s >= 0 and u + s == pytest.approx(total) and total > 0, (impl, u, s, total)
    assert "gpucoll/gpucoll-base" in sb.report(list(rows.values()), ["gpucoll", "gpucoll-base"], True)
    for argv in (["--impl", "gpucoll,gpucoll-base", "--ops-only"],
                 ["--impl", "gpucoll,gpucoll-base", "--base-tree", _REPO]):
        with pytest.raises(SystemExit):
            sb.main(argv)

def test_the_ops_rows_time_a_bare_send_on_each_transport_beside_set() -> None:
    """store_bench --ops-only --impl send-unix,send-tcp: the set rows of a bare send from
    Python over each transport, to a reader that keeps draining (20,000 frames are many
    times a socket buffer: without the reader the sends would block); the benchmark
    refuses them outside --ops-only."""
    import argparse

    sb = _store_bench()
    for kind in sb._SENDS:
        srv = sb._DrainServer(kind)
        try:
            med, p99 = sb._send_latency(srv, 20000)
            assert 0 < med <= p99, (kind, med, p99)
        finally:
            srv.stop()
        with pytest.raises(SystemExit):
            sb.main(["--impl", kind])
    args = argparse.Namespace(iters=200, seconds=0.2, repeats=1, clients=[1])
    rows = {r.name: r for r in sb.interleaved_ops(["gpucoll", "send-unix", "send-tcp"], args)}
    assert set(rows["set latency, median"].values) == {"gpucoll", "send-unix", "send-tcp"}
    assert set(rows["get latency, median"].values) == {"gpucoll"}  # set rows only
    assert set(rows["add throughput, 1 clients"].values) == {"gpucoll"}


def _threads_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of ``pid`` and the CPUs the kernel lets it run on, from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        cpus: set[int] = set()
        for part in line.split(":", 1)[1].strip().split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out[int(tid)] = cpus
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_placement_rows_pin_every_server_thread_and_give_the_cpus_back() -> None:
    """store_bench --ops-only --placement: inside each placement every thread of the
    server's process (gpucoll's loop runs in a thread of its own) may run on one CPU only,
    the client's thread on that CPU (same core) or on another (other core), as the kernel
    reports them in /proc; afterwards both have every CPU they had. The pinned set rows
    come for a store server and for a bare send alike; --placement needs --ops-only."""
    import argparse

    sb = _store_bench()
    srv = sb._Server("gpucoll")
    try:
        before, mine = _threads_cpus(srv.pid), _threads_cpus(os.getpid())[threading.get_native_id()]
        assert len(before) >= 2, before
        for where in sb._PLACEMENTS:
            with sb._placed(srv.pid, where) as (server_cpu, client_cpu):
                pinned = _threads_cpus(srv.pid)
                assert all(c == {server_cpu} for c in pinned.values()), pinned
                assert _threads_cpus(os.getpid())[threading.get_native_id()] == {client_cpu}
                assert (server_cpu == client_cpu) == (where == "same core")
            assert _threads_cpus(srv.pid) == before
            assert _threads_cpus(os.getpid())[threading.get_native_id()] == mine
        with pytest.raises(ValueError):
            with sb._placed(srv.pid, "anywhere"):
                pass
    finally:
        srv.stop()
    args = argparse.Namespace(iters=200, seconds=0.2, repeats=1, clients=[], placement=True)
    rows = {r.name: r for r in sb.interleaved_ops(["gpucoll", "send-unix"], args)}
    for where in sb._PLACEMENTS:
        got = rows[f"set latency, {where}, median"].values
        assert set(got) == {"gpucoll", "send-unix"}
        assert all(isinstance(v, float) and v > 0 for v in got.values()), got
    assert os.sched_getaffinity(0) == mine
    with pytest.raises(SystemExit):
        sb.main(["--impl", "gpucoll", "--placement"])

# -- the open-file limit -------------------------------------------------------------------

def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": _REPO})


def test_the_server_raises_its_open_file_limit_to_the_hard_limit() -> None:
    r = _child("""
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        low = 200 if hard == resource.RLIM_INFINITY else min(200, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        from gpucoll.store import TCPStore
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low  # import alone: unchanged
        m = TCPStore("127.0.0.1", 0, is_master=True, world_size=1, timeout=10)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(low, now[0], now[1], hard)
        m.close()
    """)
    assert r.returncode == 0, r.stderr
    low, soft, hard_now, hard = (int(x) for x in r.stdout.split())
    assert hard_now == hard
    assert soft == (hard if hard != -1 else 1 << 20) and soft >= low


def test_too_low_a_hard_limit_is_refused_naming_it_and_the_clients() -> None:
    r = _child("""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
        from gpucoll.errors import DistStoreError
        from gpucoll.store import TCPStore
        # Enough for 100 clients: starts (and times out waiting for them, quickly).
        m = TCPStore("127.0.0.1", 0, is_master=True, world_size=100, wait_for_workers=False)
        m.close()
        try:
            TCPStore("127.0.0.1", 0, is_master=True, world_size=5000, timeout=600)
        except DistStoreError as e:
            print(e)
        else:
            print("NOT REFUSED")
    """)
    assert r.returncode == 0, r.stderr
    msg = r.stdout
    assert "NOT REFUSED" not in msg
    assert "RLIMIT_NOFILE" in msg and "300" in msg and "5000 clients" in msg


def test_accepted_connections_keep_nodelay_and_leave_the_poll_set_on_close() -> None:
    """The server sets TCP_NODELAY once, on its listeners (accepted connections inherit
    it on Linux), and a closed connection takes no further events."""
    import socket
    import time

    from gpucoll.store._server import StoreServer

    srv = StoreServer("127.0.0.1", 0, token=None, max_key_size=1024, max_value_size=1024,
                      unix_socket=False)
    try:
        clients = [TCPStore("127.0.0.1", srv.port, timeout=10, use_unix_socket=False)
                   for _ in range(3)]
        deadline = time.monotonic() + 5
        while srv.connections < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        socks = [c.sock for c in list(srv._conns.values()) if c.sock is not None]
        assert len(socks) == 3
        assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
        clients[0].close()
        while srv.connections > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.connections == 2
        clients[1].set("k", b"v")  # the server carries on serving the others
        assert clients[2].get("k") == b"v"
        for c in clients[1:]:
            c.close()
    finally:
        srv.close()


def test_a_port_held_by_a_reuseport_listener_is_refused_not_joined() -> None:
    """The server listens on several SO_REUSEPORT sockets, yet never joins a group that
    another process (or socket) already holds on the port: that would hand it part of
    the other's connections."""
    import socket

    from gpucoll.errors import DistNetworkError
    from gpucoll.store._server import StoreServer

    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    try:
        port = other.getsockname()[1]
        with pytest.raises(DistNetworkError, match=str(port)):
            StoreServer("127.0.0.1", port, token=None, max_key_size=1024, max_value_size=1024,
                        expected_clients=12000)
        # With the port free, the same server gets several accept queues on it.
        srv = StoreServer("127.0.0.1", 0, token=None, max_key_size=1024, max_value_size=1024,
                          expected_clients=12000, unix_socket=False)
        try:
            ports = {ls.getsockname()[1] for ls in srv._listeners}
            assert ports == {srv.port} and len(srv._listeners) > 1
            c = TCPStore("127.0.0.1", srv.port, timeout=10, use_unix_socket=False)
            assert c.add("n", 2) == 2
            c.close()
        finally:
            srv.close()
    finally:
        other.close()


def test_the_generator_reaches_a_relay_through_its_unix_socket() -> None:
    """The relay bench's clients reach their node's relay as gpucoll-run's ranks do, through
    the relay's abstract Unix socket: the rendezvous completes through it, the server counts
    every join, and the relay carried the clients (no TCP connection was made to it)."""
    from gpucoll.store._relay import StoreRelay
    from gpucoll.store._sockets import unix_socket_name

    n = 300
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=60)
    relay = StoreRelay("127.0.0.1", master.port, token=None, timeout=60)
    errors: list[BaseException] = []
    carried: list[int] = []
    t = _releaser(master, "ux", errors, lambda: carried.append(relay.clients))
    try:
        ends = lg.drive("127.0.0.1", relay.port, "gpucoll", [lg.rendezvous_script("ux", n)] * n, timeout=60,
                        unix=unix_socket_name("127.0.0.1", relay.port))
        t.join(60)
        assert not errors
        assert len(ends) == n and all(ends)
        assert master.get("ux/joined") == b"%d" % n
        assert carried and carried[0] >= n - 1  # the clients were the relay's while parked
        # A name nobody listens on is a connect error naming the address, not a hang.
        with pytest.raises(RuntimeError, match="connect to Unix socket .*gpucoll-store.*ECONNREFUSED"):
            lg.drive("127.0.0.1", relay.port, "gpucoll", [lg.rendezvous_script("no", 1)], timeout=5,
                     unix=unix_socket_name("127.0.0.1", 1))
    finally:
        relay.close()
        master.close()
        t.join(5)

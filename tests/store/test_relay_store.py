"""Node-local store relays (gpucoll/store/_relay.py) and the server's multiplexed
connections (gpucoll/store/_mux.py), in-process and with the relay in a process of its own.

The reference for every answer is a direct client of the same server: a request made
through the relay must get what the same request gets directly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpucoll.errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from gpucoll.store import TCPStore
from gpucoll.store._collectives import StoreCollectives
from gpucoll.store._relay import StoreRelay, relay_address, relay_client

TOKEN = "relay-secret"
_REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture()
def master() -> Iterator[TCPStore]:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=20, token=TOKEN)
    yield m
    m.close()


@pytest.fixture()
def relay(master: TCPStore) -> Iterator[StoreRelay]:
    r = StoreRelay("127.0.0.1", master.port, token=TOKEN, timeout=10)
    yield r
    r.close()


def _via(r: StoreRelay, master: TCPStore, timeout: float = 20.0, token: str = TOKEN) -> TCPStore:
    return relay_client(("127.0.0.1", r.port), f"127.0.0.1:{master.port}", None, timeout=timeout, token=token)


def _direct(master: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, timeout=20, token=TOKEN)


def _root_connections(master: TCPStore) -> int:
    server = master._server
    assert server is not None
    return int(server.connections)


def test_every_store_call_answers_as_directly(master: TCPStore, relay: StoreRelay) -> None:
    via, direct = _via(relay, master), _direct(master)
    if sys.platform.startswith("linux"):
        # A rank on the relay's host reaches it through its abstract Unix socket.
        assert via._links.pool[0].sock.family == socket.AF_UNIX
    big = os.urandom(3 << 20)  # several of the relay's reads, and the server's large-frame path
    for name, store in (("v", via), ("d", direct)):
        store.set(f"{name}/k", b"1")
        store.multi_set([f"{name}/a", f"{name}/b"], [b"x", b""])
        store.append(f"{name}/a", b"yz")
        store.set(f"{name}/big", big)
        store.queue_push(f"{name}/q", b"first")
        store.queue_push(f"{name}/q", b"second")
    results: dict[str, list[Any]] = {}
    for name, store in (("v", via), ("d", direct)):
        results[name] = [
            store.get(f"{name}/k"), store.add(f"{name}/n", 5), store.add(f"{name}/n", -7),
            store.compare_set(f"{name}/k", b"1", b"2"), store.compare_set(f"{name}/k", b"1", b"3"),
            store.compare_set(f"{name}/none", b"", b"new"),
            store.check([f"{name}/k"]), store.check([f"{name}/k", f"{name}/absent"]),
            store.multi_get([f"{name}/a", f"{name}/b"]), store.get(f"{name}/big") == big,
            store.queue_len(f"{name}/q"), store.queue_pop(f"{name}/q"), store.queue_pop(f"{name}/q", block=False),
            store.delete_key(f"{name}/k"), store.delete_key(f"{name}/k"), store.check([f"{name}/k"]),
        ]
        store.wait([f"{name}/a"], 1.0)
    assert results["v"] == results["d"]
    assert results["v"][1:3] == [5, -2]
    # One key space: what one wrote, the other reads; num_keys and list_keys agree.
    via.set("from-relay", b"r")
    assert direct.get("from-relay") == b"r"
    direct.set("from-direct", b"d")
    assert via.get("from-direct") == b"d"
    assert via.num_keys() == direct.num_keys()
    assert sorted(via.list_keys()) == sorted(direct.list_keys())
    with pytest.raises(DistStoreTimeoutError, match="store relay 127.0.0.1:"):
        via.get("never", timeout=0.2)
    with pytest.raises(DistStoreError):
        via.add("v/a", 1)  # not an integer: the server's error, through the relay
    assert via.add("v/n", 1) == -1  # and the channel still works
    via.close()
    direct.close()


def test_the_store_collectives_and_barrier_through_relays(master: TCPStore) -> None:
    world = 3
    relays = [StoreRelay("127.0.0.1", master.port, token=TOKEN, timeout=10) for _ in range(2)]
    try:
        # Ranks 0 and 1 on one "node", rank 2 on another.
        stores = [_via(relays[0], master), _via(relays[0], master), _via(relays[1], master)]
        out: list[Any] = [None] * world
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                c = StoreCollectives(stores[r], r, world)
                got = c.all_gather("ag", f"r{r}".encode(), timeout=10)
                total = c.all_sum("sum", r + 1, timeout=10)
                if r:
                    b = c.broadcast_recv("bc", timeout=10)
                else:
                    c.broadcast_send("bc", b"hi", timeout=10)
                    b = b"hi"
                c.barrier("bar", timeout=10)
                stores[r].barrier("b2", world, timeout=10)
                out[r] = (got, total, b)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert out == [([b"r0", b"r1", b"r2"], 6, b"hi")] * world
        # The master's own client, and one connection per relay.
        assert _root_connections(master) == 1 + 2
        for s in stores:
            s.close()
    finally:
        for r in relays:
            r.close()


def test_parked_waits_of_many_clients_do_not_block_the_others(master: TCPStore, relay: StoreRelay) -> None:
    n = 24
    waiters = [_via(relay, master) for _ in range(n)]
    other = _via(relay, master)
    woken: list[float] = []
    timed_out: list[str] = []
    lock = threading.Lock()

    def park(i: int) -> None:
        s = waiters[i]
        if i % 4 == 3:
            # A quarter time out on their own, at their own deadline.
            try:
                s.wait(["never"], 0.5)
            except DistStoreTimeoutError as e:
                with lock:
                    timed_out.append(str(e))
            return
        s.wait([f"go/{i % 2}"], 20)
        with lock:
            woken.append(time.monotonic())

    threads = [threading.Thread(target=park, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while relay.clients < n + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the waits are parked on the server now
    # Every kind of request from a neighbour on the same upstream connection is answered
    # while they wait, each within a fraction of the waits' timeouts.
    t0 = time.monotonic()
    for i in range(50):
        assert other.add("busy", 1) == i + 1
    other.set("k", b"v")
    assert other.get("k") == b"v"
    assert time.monotonic() - t0 < 5.0
    assert not woken
    t_set = time.monotonic()
    other.set("go/0", b"1")
    deadline = time.monotonic() + 10
    while len(woken) < 12 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(woken) == 12  # the go/0 ones (even i) only
    assert max(woken) - t_set < 2.0  # woken by the write, not by some later event
    t_set = time.monotonic()
    other.set("go/1", b"1")
    for t in threads:
        t.join(20)
    assert len(woken) == 18
    assert max(woken) - t_set < 2.0
    assert len(timed_out) == 6 and all("still missing: ['never']" in m for m in timed_out)
    assert _root_connections(master) == 2
    for s in [*waiters, other]:
        s.close()


def test_a_client_gone_frees_its_channel_and_its_parked_wait(master: TCPStore, relay: StoreRelay) -> None:
    server = master._server
    assert server is not None
    watchers = server.requests.kv._key_waiters
    # A raw client: HELLO through the relay, then a wait parked on the server.
    c = _via(relay, master)
    conn = c._links.pool[0]
    conn.sock.sendall(_wait_frame("later", 30.0))
    deadline = time.monotonic() + 5
    while b"later" not in watchers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b"later" in watchers and sum(map(len, server.mux.channels.values())) == 1
    conn.sock.close()  # the rank goes away under its parked wait
    deadline = time.monotonic() + 5
    while (sum(map(len, server.mux.channels.values())) or watchers.get(b"later")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(map(len, server.mux.channels.values())) == 0
    assert not watchers.get(b"later")
    # Its relay connection carries on for the others.
    other = _via(relay, master)
    assert other.add("still", 2) == 2
    other.close()


def _wait_frame(key: str, timeout: float) -> bytes:
    from gpucoll.store import _wire as w

    return w.encode_frame(w.WAIT, [w.timeout_field(timeout), key.encode()])


def test_tokens_are_checked_for_the_relay_and_for_each_client(master: TCPStore, relay: StoreRelay) -> None:
    with pytest.raises(DistStoreError, match="refused the relay: token rejected"):
        StoreRelay("127.0.0.1", master.port, token="wrong", timeout=5)
    with pytest.raises(DistStoreError, match="store relay 127.0.0.1:.*token rejected"):
        _via(relay, master, token="wrong", timeout=5)
    ok = _via(relay, master)
    assert ok.add("after", 1) == 1
    ok.close()


def test_relay_address_reads_the_environment() -> None:
    assert relay_address({}) is None
    assert relay_address({"GPUCOLL_STORE_RELAY": ""}) is None
    assert relay_address({"GPUCOLL_STORE_RELAY": "127.0.0.1:4567"}) == ("127.0.0.1", 4567)
    assert relay_address({"GPUCOLL_STORE_RELAY": "[::1]:80"}) == ("::1", 80)
    for bad in ("nohost", "h:", ":1", "h:0", "h:x"):
        with pytest.raises(ValueError, match="GPUCOLL_STORE_RELAY must be HOST:PORT"):
            relay_address({"GPUCOLL_STORE_RELAY": bad})


def test_the_store_going_away_ends_the_relay_and_fails_its_clients() -> None:
    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=20, token=TOKEN)
    r = StoreRelay("127.0.0.1", m.port, token=TOKEN, timeout=10)
    c = _via(r, m, timeout=5)
    errors: list[BaseException] = []

    def park() -> None:
        try:
            c.wait(["never"], 30)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=park)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    m.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(errors[0], DistNetworkError), errors
    assert "store relay 127.0.0.1:" in str(errors[0])
    deadline = time.monotonic() + 5
    while r.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not r.running and r.error is not None and f"127.0.0.1:{m.port}" in r.error
    r.close()


_RELAY_PROCESS = """
import sys, time
from gpucoll.store._relay import StoreRelay
r = StoreRelay("127.0.0.1", int(sys.argv[1]), token=sys.argv[2], timeout=10)
print(r.port, flush=True)
time.sleep(600)
"""


def test_a_relay_killed_under_parked_waits_is_a_clear_error_within_the_timeout(master: TCPStore) -> None:
    env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _RELAY_PROCESS, str(master.port), TOKEN],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        r = ("127.0.0.1", port)
        clients = [relay_client(r, f"127.0.0.1:{master.port}", None, timeout=30, token=TOKEN) for _ in range(3)]
        errors: list[tuple[BaseException, float]] = []

        def park(c: TCPStore) -> None:
            try:
                c.wait(["never"], 30)
            except BaseException as e:
                errors.append((e, time.monotonic()))

        threads = [threading.Thread(target=park, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(15)
        assert len(errors) == 3
        for e, when in errors:
            assert isinstance(e, DistNetworkError), e
            assert f"store relay 127.0.0.1:{port}" in str(e)
            assert when - killed < 5.0  # not the 30 s of the wait
        # A new request fails as clearly (nothing listens there any more).
        with pytest.raises(DistNetworkError, match=f"store relay 127.0.0.1:{port}"):
            clients[0].get("x")
        # The server dropped the dead relay's channels with its connection.
        server = master._server
        assert server is not None
        deadline = time.monotonic() + 5
        while server.mux.channels and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not server.mux.channels
    finally:
        proc.kill()
        proc.wait(10)


def test_torch_clients_through_a_relay() -> None:
    """A channel is a byte tunnel: torch's own client (its c10d protocol) works through
    a relay as directly, on a server without a token (torch's clients have none)."""
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    m = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=20)
    r = StoreRelay("127.0.0.1", m.port, token=None, timeout=10)
    try:
        t = dist.TCPStore("127.0.0.1", r.port, None, False, timedelta(seconds=10))
        t.set("tk", "tv")
        assert m.get("tk") == b"tv"
        assert t.add("tn", 4) == 4 and m.add("tn", 1) == 5
        m.set("from-gpucoll", b"g")
        assert t.get("from-gpucoll") == b"g"
        done = threading.Event()

        def waiting() -> None:
            t2 = dist.TCPStore("127.0.0.1", r.port, None, False, timedelta(seconds=10))
            t2.wait(["later"])
            done.set()

        th = threading.Thread(target=waiting)
        th.start()
        time.sleep(0.3)
        assert not done.is_set() and t.check(["tk"])  # a neighbour's torch wait does not block t
        m.set("later", b"1")
        th.join(10)
        assert done.is_set()
        server = m._server
        assert server is not None and server.connections == 2  # the master's own, the relay's
    finally:
        r.close()
        m.close()

"""gpucoll's TCPStore and torch 2.13's, both ways, over every Store call.

torch is a test-only dependency: these tests skip where it is absent. torch's queue
calls hold the GIL while they block, so a gpucoll server that torch clients queue on
runs in a process of its own.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpucoll.errors import DistStoreError, DistStoreTimeoutError
from gpucoll.store import HashStore, PrefixStore, Store, TCPStore

torch = pytest.importorskip("torch", reason="interop with torch's TCPStore needs torch (test-only)")
tdist = pytest.importorskip("torch.distributed", reason="torch.distributed is needed")

REPO = Path(__file__).resolve().parents[2]
SERVER = ("import sys; from gpucoll.store import TCPStore; "
          "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
          "print(s.port, flush=True); sys.stdin.read()")


@pytest.fixture(scope="module")
def gpucoll_port() -> Iterator[int]:
    env = {"PYTHONPATH": str(REPO)}
    import os
    env = {**os.environ, **env}
    env.pop("GPUCOLL_STORE_TOKEN", None)
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env, text=True)
    try:
        assert p.stdout is not None
        yield int(p.stdout.readline())
    finally:
        p.kill()
        p.wait(10)


def _torch_client(port: int, seconds: float = 5.0) -> Any:
    return tdist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=seconds))


# -- torch client -> gpucoll server ----------------------------------------------------------

def test_torch_client_every_call(gpucoll_port: int) -> None:
    t = _torch_client(gpucoll_port)
    g = TCPStore("127.0.0.1", gpucoll_port, timeout=5)
    assert g.protocol == "gpucoll"
    t.set("tk", "v")
    assert t.get("tk") == b"v" and g.get("tk") == b"v"
    g.set("gk", b"from-gpucoll")
    assert t.get("gk") == b"from-gpucoll"
    assert t.add("n", 5) == 5 and g.add("n", 1) == 6 and t.add("n", 0) == 6
    assert t.compare_set("tk", "v", "w") == b"w" and g.get("tk") == b"w"
    assert t.compare_set("tk", "nope", "x") == b"w"
    assert t.compare_set("absent", "", "y") == b"y"
    assert t.check(["tk"]) and not t.check(["tk", "missing"])
    t.wait(["tk", "gk"])
    t0 = time.monotonic()
    with pytest.raises(tdist.DistStoreError):
        t.wait(["missing"], timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 3
    with pytest.raises(tdist.DistStoreError):  # get of a missing key: torch's client times out
        _torch_client(gpucoll_port, 0.3).get("missing")
    t.set("gone", "1")
    assert t.delete_key("gone") and not t.delete_key("gone") and not g.check(["gone"])
    # torch's client does not wait for a reply to APPEND, and a server orders requests per
    # connection only: a round trip on the writer's own connection orders it before the
    # other client's request.
    t.append("ap", "x")
    assert t.get("ap") == b"x"
    g.append("ap", b"y")
    assert g.get("ap") == b"xy"
    assert t.get("ap") == b"xy"
    assert t.multi_get(["ap", "n"]) == [b"xy", b"6"]
    t.multi_set(["m1", "m2"], ["1", "2"])
    assert g.multi_get(["m1", "m2"]) == [b"1", b"2"]
    t.queue_push("q", "a")
    g.queue_push("q", b"b")
    assert t.queue_len("q") == 2 and g.queue_len("q") == 2
    assert t.check(["q"]) and g.check(["q"])  # a non-empty queue is visible to check
    assert t.queue_pop("q") == b"a" and g.queue_pop("q") == b"b"
    assert not t.check(["q"])
    with pytest.raises(Exception, match="empty"):
        t.queue_pop("q", block=False)
    keys = set(t.list_keys())
    assert {"tk", "gk", "n", "ap", "m1", "m2", "absent"} <= keys
    assert keys == set(g.list_keys())
    assert t.num_keys() == g.num_keys() == len(keys)
    big = bytes(range(256)) * (80 << 10)  # 20 MiB: over torch's own server limit
    t.set("big", big)
    assert g.get("big") == big and t.get("big") == big
    c = t.clone()
    assert c.get("tk") == b"w"
    t.barrier("b1", 1)
    g.close()


def test_wait_answers_cancel_and_late_keys(gpucoll_port: int) -> None:
    t = _torch_client(gpucoll_port)
    g = TCPStore("127.0.0.1", gpucoll_port, timeout=5)
    timer = threading.Timer(0.2, lambda: g.set("late", b"1"))
    timer.start()
    t.wait(["late"], timedelta(seconds=5))  # woken by a gpucoll client's set
    timer.join()
    for _ in range(3):  # the connection stays usable after cancelled waits
        with pytest.raises(tdist.DistStoreError):
            t.wait(["never"], timedelta(seconds=0.1))
        assert t.get("late") == b"1"
    g.close()


def test_mixed_job_on_one_server(gpucoll_port: int) -> None:
    """One rank on torch's store API, one on gpucoll's, rendezvous through one server."""
    world = 2
    results: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store: Any = _torch_client(gpucoll_port) if r == 0 else TCPStore("127.0.0.1", gpucoll_port, timeout=5)
            store.set(f"mixed/addr{r}", f"rank{r}")
            if store.add("mixed/joined", 1) == world:
                store.set("mixed/go", "1")
            store.wait(["mixed/go"])
            results[r] = [store.get(f"mixed/addr{i}") for i in range(world)]
            store.barrier("mixed/bar", world) if r == 1 else tdist.Store.barrier(store, "mixed/bar", world)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert not errors, errors
    assert results == {r: [b"rank0", b"rank1"] for r in range(world)}


# -- gpucoll client -> torch server ------------------------------------------------------------

@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def torch_server(request: Any) -> Iterator[Any]:
    srv = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         use_libuv=request.param, timeout=timedelta(seconds=5))
    yield srv


def test_gpucoll_client_every_call(torch_server: Any) -> None:
    srv = torch_server
    libuv = srv.libuvBackend
    c = TCPStore("127.0.0.1", srv.port, timeout=5)
    assert c.protocol == "torch" and "torch" in repr(c._links.where)
    c.set("k", b"v")
    assert c.get("k") == b"v" and srv.get("k") == b"v"
    srv.set("t", "from-torch")
    assert c.get("t") == b"from-torch"
    assert c.add("n", 5) == 5 and srv.add("n", 1) == 6 and c.add("n", 0) == 6
    assert c.compare_set("k", b"v", b"w") == b"w" and srv.get("k") == b"w"
    assert c.compare_set("absent", b"", b"y") == b"y"
    assert c.check(["k"]) and not c.check(["k", "missing"])
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="missing"):
        c.wait(["missing"], timeout=0.3)
    with pytest.raises(DistStoreTimeoutError):
        c.get("missing", timeout=0.3)
    assert time.monotonic() - t0 < 3
    assert c.get("k") == b"w"  # usable after the cancelled waits
    assert c.num_keys() == srv.num_keys()
    assert c.delete_key("k") and not c.delete_key("k")
    c.append("ap", b"x")
    c.append("ap", b"y")
    assert c.get("ap") == b"xy"  # a round trip on c's connection: both appends are served
    assert srv.get("ap") == b"xy"
    assert c.multi_get(["ap", "n"]) == [b"xy", b"6"]
    c.multi_set(["m1", "m2"], [b"1", b"2"])
    assert srv.multi_get(["m1", "m2"]) == [b"1", b"2"]
    if libuv:  # torch's legacy server has no queues
        c.queue_push("q", b"a")
        assert c.queue_len("q") == 1 and c.check(["q"])
        assert c.queue_pop("q", timeout=2) == b"a"
        with pytest.raises(DistStoreError, match="empty"):
            c.queue_pop("q", block=False)
        assert set(c.list_keys()) == set(srv.list_keys())
    with pytest.raises(ValueError, match="8388608 bytes"):
        c.set("big", b"x" * ((8 << 20) + 1))  # refused before sending, naming the limit
    c.set("big", b"x" * (8 << 20))
    assert len(srv.get("big")) == 8 << 20
    d = c.clone()
    assert d.protocol == "torch" and d.get("n") == b"6"
    c.barrier("b", 1)
    d.close()
    c.close()


def test_token_with_torch_server_is_refused(torch_server: Any) -> None:
    with pytest.raises(DistStoreError, match="no token"):
        TCPStore("127.0.0.1", torch_server.port, timeout=2, token="secret")
    with pytest.raises(DistStoreError):  # an explicit protocol that does not match
        TCPStore("127.0.0.1", torch_server.port, timeout=1, protocol="gpucoll")


def test_not_a_store_is_a_quick_clear_error() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="did not answer"):
        TCPStore("127.0.0.1", silent.getsockname()[1], timeout=1.0)
    assert time.monotonic() - t0 < 3
    silent.close()

    closer = socket.socket()
    closer.bind(("127.0.0.1", 0))
    closer.listen()
    stop = threading.Event()

    def run() -> None:
        closer.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = closer.accept()
            except OSError:
                continue
            conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            conn.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="not a TCPStore"):
        TCPStore("127.0.0.1", closer.getsockname()[1], timeout=30)
    assert time.monotonic() - t0 < 3
    stop.set()
    th.join(5)
    closer.close()


# -- torch's API on gpucoll's stores -----------------------------------------------------------

def test_torch_keywords_and_extras() -> None:
    a = TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False,
                 multi_tenant=True, use_libuv=True, timeout=5)
    b = TCPStore(host_name="127.0.0.1", port=a.port, is_master=True, wait_for_workers=False,
                 multi_tenant=True, timeout=5)  # the same server, as torch's multi_tenant
    a.set("shared", b"1")
    assert b.get("shared") == b"1"
    a.close()
    assert b.get("shared") == b"1"  # the server lives while one tenant does
    assert a.has_extended_api() and HashStore().has_extended_api()
    b.close()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen()
    port = ls.getsockname()[1]
    m = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=ls.detach(),
                 timeout=5)
    t = _torch_client(port)
    t.set("fd", "ok")
    assert m.get("fd") == b"ok"
    m.close()
    with pytest.raises(TypeError):
        TCPStore("127.0.0.1", 1, host_name="127.0.0.1")


def test_store_subclassed_torch_way() -> None:
    import numpy as np

    import gpucoll

    class DictStore(Store):
        def __init__(self) -> None:
            super().__init__()
            self.d: dict[str, bytes] = {}

        def set(self, key: str, value: Any) -> None:
            self.d[key] = value.encode() if isinstance(value, str) else bytes(value)

        def get(self, key: str) -> bytes:  # type: ignore[override]
            return self.d[key]

        def add(self, key: str, amount: int) -> int:
            self.d[key] = str(int(self.d.get(key, b"0")) + amount).encode()
            return int(self.d[key])

        def check(self, keys: Any) -> bool:
            return all(k in self.d for k in keys)

        def delete_key(self, key: str) -> bool:
            return self.d.pop(key, None) is not None

    s = DictStore()
    p = PrefixStore("ns", s)
    p.set("a", b"1")
    assert s.d["ns/a"] == b"1" and p.get("a") == b"1" and p.add("c", 2) == 2
    p.wait(["a"], timeout=1)
    with pytest.raises(DistStoreTimeoutError):
        p.wait(["never"], timeout=0.05)
    s.barrier("bar", 1)
    gpucoll.init_process_group(store=s, rank=0, world_size=1)
    try:
        x = np.arange(4.0)
        gpucoll.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
        objs: list[Any] = [None]
        gpucoll.all_gather_object(objs, {"k": 1})
        assert objs == [{"k": 1}]
    finally:
        gpucoll.destroy_process_group()


def test_queue_visible_to_check_and_wait_like_torch() -> None:
    ours = HashStore()
    theirs = tdist.HashStore()
    for s in (ours, theirs):
        s.queue_push("q", b"1")
    assert ours.check(["q"]) == theirs.check(["q"]) == True  # noqa: E712
    ours.wait(["q"], timeout=1)
    theirs.wait(["q"], timedelta(seconds=1))
    timer = threading.Timer(0.1, lambda: ours.queue_push("q2", b"x"))
    timer.start()
    ours.wait(["q2"], timeout=5)  # woken by a push
    timer.join()

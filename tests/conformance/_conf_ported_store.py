"""torch's own tests, ported check by check (not only their intent): test_store.py,
test_control_collectives.py, and the ReduceOp / Backend / debug-level tests of
test_c10d_common.py and distributed_test.py, as of torch 2.13.

Every assertion of the original is kept: the exception type, the message pattern it
matches (``match_re`` is ``assertRaisesRegex``: a regular expression searched in the
message, case-sensitive), the defaults it relies on, the names it calls. Only what the
two libraries spell differently is adapted, through :func:`name`: torch's private
``_StoreCollectives`` is gpucoll's public ``StoreCollectives``; a ``torch.tensor``
factor is a NumPy 0-d array on gpucoll. Hosts are 127.0.0.1 instead of "localhost"
(torch may wait on a reverse DNS lookup for it). Each check names its torch test.

Not ported (torch-only machinery, no counterpart to check): RPC, ``dist.rendezvous``
handlers, libuv switches of torch's server, ``TCPStore.__repr__``'s C++ layout, torch's
wire bytes (``TestClientProtocol``), ``c10d._get_process_group_store``.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from multiprocessing.pool import ThreadPool
from typing import Any, Callable

import numpy as np

from _conf_core import Impl, section

STORE = "test/distributed/test_store.py"
CONTROL = "test/distributed/test_control_collectives.py"
COMMON = "test/distributed/test_c10d_common.py"
DIST = "torch/testing/_internal/distributed/distributed_test.py"

S = section("ported_store", world_sizes=(1,), init=False, timeout=240.0)
C = section("ported_control", world_sizes=(1,), init=False, timeout=60.0)
R = section("ported_c10d", world_sizes=(1,), init=False, timeout=60.0)
G = section("ported_get_backend", world_sizes=(2, 3), pg_timeout=10.0, timeout=60.0)

HOST = "127.0.0.1"


# ----------------------------------------------------------------------------- helpers

def name(T: Impl, torch_name: str) -> Any:
    """torch's name on torch, its gpucoll spelling on gpucoll."""
    if T.is_torch:
        return getattr(T.dist, torch_name)
    return getattr(T.dist, {"_StoreCollectives": "StoreCollectives"}.get(torch_name, torch_name))


def scalar_array(T: Impl, value: float) -> Any:
    """``torch.tensor(value)`` on torch; a 0-d NumPy array on gpucoll."""
    return T.torch.tensor(value) if T.is_torch else np.array(value)


def match_re(excs: Any, pattern: str | None, fn: Callable[[], Any]) -> BaseException:
    """``assertRaisesRegex(excs, pattern)`` (``assertRaises`` when ``pattern`` is None)."""
    try:
        fn()
    except excs as exc:
        if pattern is not None and not re.search(pattern, str(exc)):
            raise AssertionError(f"{type(exc).__name__} message does not match {pattern!r}: {exc}") from exc
        return exc
    except Exception as exc:
        raise AssertionError(f"expected {excs} matching {pattern!r}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {excs} matching {pattern!r}, nothing was raised")


def free_port() -> int:
    """torch's common_utils.find_free_port: bind port 0, read it, close."""
    # the wildcard address (IPv6 dual-stack where there is one): a port free there is free
    # on every address, as torch's server binds it (localhost alone may collide with a
    # client connection's port on this busy process)
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
            s6.bind(("::", 0))
            return int(s6.getsockname()[1])
    except OSError:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s4:
            s4.bind(("", 0))
            return int(s4.getsockname()[1])


def tmpfile(T: Impl) -> str:
    """tempfile.NamedTemporaryFile(delete=False).name, in the check's work folder."""
    fd, path = tempfile.mkstemp(dir=T.workdir)
    os.close(fd)
    return path


def create_tcp_store(T: Impl, world_size: int | None = 1, wait_for_workers: bool = True,
                     use_libuv: bool = True) -> Any:
    """torch's common_distributed.create_tcp_store: a master on a free port."""
    return T.dist.TCPStore(HOST, 0, world_size, True, wait_for_workers=wait_for_workers,
                           timeout=timedelta(seconds=300), use_libuv=use_libuv)


# StoreTestBase subclasses: how each makes its store, and its num_keys_total
def _file(T: Impl) -> Any:
    st = T.dist.FileStore(tmpfile(T), 1)
    st.set_timeout(timedelta(seconds=300))
    return st


def _hash(T: Impl) -> Any:
    st = T.dist.HashStore()
    st.set_timeout(timedelta(seconds=300))
    return st


def _prefix_file(T: Impl) -> Any:
    fs = T.dist.FileStore(tmpfile(T), 1)
    fs.set_timeout(timedelta(seconds=300))
    return T.dist.PrefixStore("test_prefix", fs)


def _tcp(T: Impl, use_libuv: bool = False) -> Any:
    st = create_tcp_store(T, use_libuv=use_libuv)
    st.set_timeout(timedelta(seconds=300))
    return st


def _prefix_tcp(T: Impl) -> Any:
    st = create_tcp_store(T)
    st.set_timeout(timedelta(seconds=300))
    return T.dist.PrefixStore("test_prefix", st)


STORES: dict[str, tuple[Callable[[Impl], Any], int]] = {
    "FileStoreTest": (_file, 6),
    "HashStoreTest": (_hash, 5),
    "PrefixFileStoreTest": (_prefix_file, 6),
    "TCPStoreTest": (lambda T: _tcp(T, False), 6),
    "LibUvTCPStoreTest": (lambda T: _tcp(T, True), 6),
    "PrefixTCPStoreTest": (_prefix_tcp, 6),
}


_OVERRIDDEN = {cls: ("test_append", "test_multi_set", "test_multi_get")
               for cls in ("TCPStoreTest", "LibUvTCPStoreTest")}
"""StoreTestBase tests that TCPStoreTest (and so LibUvTCPStoreTest) overrides."""


def _for_each_store(fn: Callable[[Any, Impl, Any, int], None]) -> Callable[..., None]:
    """One check per StoreTestBase subclass for a body ``fn(self, T, store, num_keys_total)``."""
    test = fn.__name__.removeprefix("check_")
    for cls, (make, total) in STORES.items():
        if test in _OVERRIDDEN.get(cls, ()):
            continue  # the subclass's own version is ported below
        def body(T: Impl, make: Callable[[Impl], Any] = make, total: int = total) -> None:
            fn(None, T, make(T), total)
        body.__name__ = f"{test}[{cls}]"
        S.check(f"{STORE}::{cls}::{test}")(body)
    return fn


class _Skip(Exception):
    pass


def _store_or_skip_if_no_queues(T: Impl, store: Any) -> Any:
    """StoreTestBase._create_store_or_skip_if_no_queues."""
    try:
        store.queue_push("test_queue_support", "1")
    except NotImplementedError:
        T.skip("Store does not support queues")
    return store


# ----------------------------------------------------------------------------- test_store.py: StoreTestBase

@_for_each_store
def check_test_set_get_check(_: Any, T: Impl, fs: Any, num_keys_total: int) -> None:
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    fs.add("key3", 2)
    fs.set("key2", "value2")
    fs.add("key3", 3)
    fs.add("key3", 4)
    fs.add("key3", 5)
    fs.add("key3", 6)
    assert fs.num_keys() == num_keys_total, (fs.num_keys(), num_keys_total)
    assert fs.get("key") == b"6"
    assert fs.get("key0") == b"value0"
    assert fs.get("key1") == b"value1"
    assert fs.get("key2") == b"value2"
    assert fs.get("key3") == b"21"
    assert fs.check(["key3"])
    assert not fs.check(["Randomkey3"])
    fs.set("-key3", "7")
    assert fs.get("-key3") == b"7"
    fs.delete_key("-key3")
    assert fs.num_keys() == num_keys_total, (fs.num_keys(), num_keys_total)


@_for_each_store
def check_test_compare_set(_: Any, T: Impl, store: Any, total: int) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    store.set("cs_key0", "value0")
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


@_for_each_store
def check_test_simple_wait(_: Any, T: Impl, fs: Any, total: int) -> None:
    match_re(RuntimeError, "[t -i]imeout", lambda: fs.wait(["bad_key"], timedelta(seconds=0.25)))
    fs.add("good_key", 1)
    fs.wait(["good_key"])


@_for_each_store
def check_test_append(_: Any, T: Impl, store: Any, total: int) -> None:
    if not store.has_extended_api():
        return
    store.set("foo", "po")
    store.append("foo", "tato")
    store.append("bar", "po")
    store.append("bar", "tato")
    assert store.get("foo") == b"potato"
    assert store.get("bar") == b"potato"


@_for_each_store
def check_test_queues(_: Any, T: Impl, store: Any, total: int) -> None:
    store = _store_or_skip_if_no_queues(T, store)
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0
    store.queue_push("foo", "1")
    store.queue_push("foo", "2")
    assert store.check(["foo"])
    assert store.queue_len("foo") == 2
    store.wait(["foo"])
    assert store.queue_pop("foo") == b"1"
    assert store.queue_pop("foo") == b"2"
    assert not store.check(["foo"])
    assert store.queue_len("foo") == 0


@_for_each_store
def check_test_queues_nonblocking(_: Any, T: Impl, store: Any, total: int) -> None:
    store = _store_or_skip_if_no_queues(T, store)
    match_re(T.dist.QueueEmptyError, "empty", lambda: store.queue_pop("foo", block=False))
    store.queue_push("foo", "a")
    assert store.queue_pop("foo", block=False) == b"a"


@_for_each_store
def check_test_queues_bidirectional(_: Any, T: Impl, store: Any, total: int) -> None:
    store = _store_or_skip_if_no_queues(T, store)

    def worker_a() -> None:
        local_store = store.clone()
        local_store.queue_push("a", "a1")
        assert local_store.queue_pop("b") == b"b1"

    def worker_b() -> None:
        local_store = store.clone()
        assert local_store.queue_pop("a") == b"a1"
        local_store.queue_push("b", "b1")

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(worker_a), pool.submit(worker_b)]
        for fut in futures:
            fut.result(timeout=60)


@_for_each_store
def check_test_queues_timeout(_: Any, T: Impl, store: Any, total: int) -> None:
    store = _store_or_skip_if_no_queues(T, store)
    store.set_timeout(timedelta(seconds=0.01))
    match_re(T.dist.DistStoreError, "timeout", lambda: store.queue_pop("non_existant"))


@_for_each_store
def check_test_multi_set(_: Any, T: Impl, store: Any, total: int) -> None:
    if not store.has_extended_api():
        return
    store.multi_set(["foo", "bar"], ["po", "tato"])
    assert store.get("foo") == b"po"
    assert store.get("bar") == b"tato"


@_for_each_store
def check_test_multi_get(_: Any, T: Impl, store: Any, total: int) -> None:
    if not store.has_extended_api():
        return
    store.set("foo", "po")
    store.set("bar", "tato")
    v0, v1 = store.multi_get(["foo", "bar"])
    assert v0 == b"po"
    assert v1 == b"tato"


@_for_each_store
def check_test_clone(_: Any, T: Impl, a: Any, total: int) -> None:
    b = a.clone()
    assert isinstance(b, T.dist.Store)
    a.set("foo", "bar")
    assert b.get("foo") == b"bar"


# ----------------------------------------------------------------------------- test_store.py: per store

@S.check(f"{STORE}::FileStoreTest::test_refcount")
def check_filestore_test_refcount(T: Impl) -> None:
    path = tmpfile(T)
    store = T.dist.FileStore(path, 1)
    store2 = T.dist.FileStore(path, 1)
    del store
    assert os.path.exists(path)
    del store2
    assert not os.path.exists(path)


@S.check(f"{STORE}::PrefixStoreTest::test_get_underlying_store")
def check_prefixstore_test_get_underlying_store(T: Impl) -> None:
    tcp_store = T.dist.TCPStore(host_name=HOST, port=0, world_size=1, is_master=True)
    hash_store = T.dist.HashStore()
    file_store = T.dist.FileStore(tmpfile(T), world_size=1)
    for store in [tcp_store, hash_store, file_store]:
        prefix_store = T.dist.PrefixStore("prefix", store)
        assert prefix_store.underlying_store == store, type(store)
    match_re(ValueError, None, lambda: T.dist.PrefixStore("prefix", None))


def _tcp_checks(cls: str, use_libuv: bool) -> None:
    d = lambda T: T.dist  # noqa: E731

    def test_address_already_in_use(T: Impl) -> None:
        port = free_port()
        held: list[Any] = []

        def two() -> None:
            held.append(d(T).TCPStore(HOST, port, 1, True, use_libuv=use_libuv))
            held.append(d(T).TCPStore(HOST, port, 1, True, use_libuv=use_libuv))

        match_re(d(T).DistNetworkError, f"^The server socket has failed to listen on any local .*{port}", two)
        assert held[0].libuvBackend == use_libuv

    def test_multitenancy(T: Impl) -> None:
        port = free_port()
        store1 = d(T).TCPStore(HOST, port, 1, True, multi_tenant=True, use_libuv=use_libuv)
        store2 = d(T).TCPStore(HOST, port, 1, True, multi_tenant=True, use_libuv=use_libuv)
        assert store1.libuvBackend == use_libuv
        assert store2.libuvBackend == use_libuv

    def test_take_over_listen_socket(T: Impl) -> None:
        listen_sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen_sock.bind((HOST, 0))
        addr, port, *_ = listen_sock.getsockname()
        listen_fd = listen_sock.detach()
        store = d(T).TCPStore(addr, port, 1, is_master=True, master_listen_fd=listen_fd, use_libuv=use_libuv)
        assert store.libuvBackend == use_libuv
        store.set("key", "value")
        assert store.get("key") == b"value"

    def test_numkeys_delkeys(T: Impl) -> None:
        fs = _tcp(T, use_libuv)
        assert fs.num_keys() == 1
        fs.add("key", 1)
        fs.add("key", 2)
        fs.add("key", 3)
        fs.set("key0", "value0")
        fs.add("key3", 1)
        fs.set("key1", "value1")
        assert fs.num_keys() == 5
        fs.delete_key("key")
        assert fs.num_keys() == 4
        fs.set_timeout(timedelta(seconds=2))
        match_re(RuntimeError, None, lambda: fs.get("key"))
        fs.delete_key("key0")
        fs.delete_key("key3")
        assert fs.num_keys() == 2
        fs.set("key4", "value2")
        assert fs.num_keys() == 3
        assert fs.get("key1") == b"value1"
        assert fs.get("key4") == b"value2"

    def _multi_worker_helper(T: Impl, world_size: int | None) -> None:
        server_store = create_tcp_store(T, world_size, wait_for_workers=False, use_libuv=use_libuv)
        assert server_store.libuvBackend == use_libuv
        server_store.set("key", "value")
        port = server_store.port
        for i in range(world_size if world_size else 1):
            client_store = d(T).TCPStore(HOST, port, world_size=world_size, timeout=timedelta(seconds=10),
                                         use_libuv=use_libuv)
            assert client_store.get("key") == b"value"
            client_store.set(f"new_key{i}", f"new_value{i}")
            assert client_store.compare_set(f"new_key{i}", f"new_value{i}", f"next_value{i}") == \
                f"next_value{i}".encode()

    def test_multi_worker_with_fixed_world_size(T: Impl) -> None:
        _multi_worker_helper(T, 5)

    def test_multi_worker_with_nonfixed_world_size(T: Impl) -> None:
        _multi_worker_helper(T, None)

    def test_append(T: Impl) -> None:
        store = _tcp(T, use_libuv)
        assert store.libuvBackend == use_libuv
        store.set("foo", "po")
        store.append("foo", "tato")
        store.append("bar", "po")
        store.append("bar", "tato")
        assert store.get("foo") == b"potato"
        assert store.get("bar") == b"potato"

    def test_multi_set(T: Impl) -> None:
        store = _tcp(T, use_libuv)
        assert store.libuvBackend == use_libuv
        store.multi_set(["foo", "bar"], ["po", "tato"])
        assert store.get("foo") == b"po"
        assert store.get("bar") == b"tato"

    def test_multi_get(T: Impl) -> None:
        store = _tcp(T, use_libuv)
        assert store.libuvBackend == use_libuv
        store.set("foo", "po")
        store.set("bar", "tato")
        v0, v1 = store.multi_get(["foo", "bar"])
        assert v0 == b"po" and v1 == b"tato"

    def test_store_timeout_on_missing_clients(T: Impl) -> None:
        match_re(d(T).DistStoreError, r"Timed out after \d+ seconds waiting for clients. \d+/\d+ clients joined.",
                 lambda: d(T).TCPStore(HOST, 0, 2, True, timeout=timedelta(seconds=2), use_libuv=use_libuv))
        d(T).TCPStore(HOST, 0, 2, True, timeout=timedelta(seconds=2), wait_for_workers=False, use_libuv=use_libuv)

    def test_world_size_0_raises(T: Impl) -> None:
        match_re(ValueError, "TCPStore world size cannot be 0",
                 lambda: d(T).TCPStore(HOST, 0, world_size=0, is_master=False))

    def test_agent_store(T: Impl) -> None:
        store = _tcp(T, use_libuv)
        match_re(d(T).DistNetworkError, "The server socket has failed to listen on any local network address",
                 lambda: d(T).TCPStore(host_name=HOST, port=store.port, world_size=1, is_master=True,
                                       use_libuv=use_libuv))
        old = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT")}
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "1"
        os.environ["MASTER_PORT"] = str(store.port)
        try:
            second_server = d(T).TCPStore(host_name=HOST, port=store.port, world_size=1, is_master=True,
                                          use_libuv=use_libuv)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        assert second_server.port == store.port

    for fn in (test_address_already_in_use, test_multitenancy, test_take_over_listen_socket,
               test_numkeys_delkeys, test_multi_worker_with_fixed_world_size,
               test_multi_worker_with_nonfixed_world_size, test_append, test_multi_set, test_multi_get,
               test_store_timeout_on_missing_clients, test_world_size_0_raises, test_agent_store):
        def body(T: Impl, fn: Callable[[Impl], None] = fn) -> None:
            fn(T)
        body.__name__ = f"{fn.__name__}[{cls}]"
        S.check(f"{STORE}::{cls}::{fn.__name__}")(body)


_tcp_checks("TCPStoreTest", False)
_tcp_checks("LibUvTCPStoreTest", True)


@S.check(f"{STORE}::PrefixTCPStoreTest::test_underlying_non_prefix_store")
def check_prefixtcp_test_underlying_non_prefix_store(T: Impl) -> None:
    tcpstore = create_tcp_store(T)
    tcpstore.set_timeout(timedelta(seconds=300))
    store = T.dist.PrefixStore("test_prefix", tcpstore)
    wrapped_store = T.dist.PrefixStore("test_prefix", T.dist.PrefixStore("test_prefix", store))
    assert store._underlying_non_prefix_store == tcpstore
    assert wrapped_store._underlying_non_prefix_store == tcpstore


# ----------------------------------------------------------------------------- test_store.py: Python stores

def _python_stores(T: Impl) -> tuple[type, type]:
    """MyPythonStore and DummyStore of test_store.py, as subclasses of this library's Store."""

    class MyPythonStore(T.dist.Store):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.store: dict[Any, bytes] = {}

        def set(self, key: Any, value: Any) -> None:
            if not isinstance(key, (str, bytes)):
                raise AssertionError("Expected set to be called with string key")
            if type(value) is not bytes:
                raise AssertionError("Expected set to be called with bytes value")
            self.store[key] = value

        def get(self, key: Any) -> bytes:
            value = self.store.get(key, b"")
            if type(value) is not bytes:
                raise AssertionError("Expected get to return bytes value")
            return value

        def add(self, key: Any, value: int) -> int:
            new = int(self.store.get(key, 0)) + value
            self.set(key, bytes(str(new).encode("utf-8")))
            return new

        def compare_set(self, key: Any, expected: Any, newValue: Any) -> Any:  # noqa: N803
            if type(expected) is not bytes:
                raise AssertionError("compare_set::expected not bytes")
            if type(newValue) is not bytes:
                raise AssertionError("compare_set::newValue not bytes")
            val = self.store.get(key, None)
            if expected == val or val is None:
                val = self.store[key] = newValue
            return val

        def clone(self) -> "MyPythonStore":
            return self

    class DummyStore(T.dist.Store):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            self.appends: list[Any] = []
            self.multi_sets: list[Any] = []
            self.multi_gets: list[Any] = []
            self.multi_get_res: list[Any] = []
            super().__init__()

        def append(self, key: Any, value: Any) -> None:
            self.appends.append((key, value))

        def multi_get(self, keys: Any) -> Any:
            self.multi_gets.append(keys)
            return self.multi_get_res.pop(0)

        def multi_set(self, keys: Any, values: Any) -> None:
            self.multi_sets.append((keys, values))

        def has_extended_api(self) -> bool:
            return True

    return MyPythonStore, DummyStore


def _through_the_library(store: Any) -> None:
    """What torch's C++ ``_test_python_store`` does through its trampoline: the calls the
    library itself makes on a user's store (gpucoll: the protected methods its process
    groups and PrefixStore call), checked against the expected values."""
    for k, v in (("key", 1), ("key", 2), ("key", 3)):
        store._add(k, v)
    store._set("key0", b"value0")
    store._add("key3", 1)
    store._set("key1", b"value1")
    store._add("key3", 2)
    store._set("key2", b"value2")
    for v in (3, 4, 5, 6):
        store._add("key3", v)
    for key, want in (("key", b"6"), ("key0", b"value0"), ("key1", b"value1"), ("key2", b"value2"),
                      ("key3", b"21")):
        got = store._get([key], 10.0)[0]
        if got != want:
            raise AssertionError(f"Expected {key} to hold {want!r}; got {got!r}")


def _newer_than_213(T: Impl) -> None:
    """These two tests come from torch after 2.13 (its PrefixStore now passes a Python
    store's has_extended_api through and falls back to compare_set/get/set); torch 2.13
    itself does neither, so only gpucoll is checked against them."""
    if T.is_torch and T.torch.__version__.startswith("2.13"):
        T.skip("torch 2.13 predates this test (PrefixStore over a Python store: no pass-through, no fallbacks)")


@S.check(f"{STORE}::PythonStoreTest::test_set_get")
def check_pythonstoretest_test_set_get(T: Impl) -> None:
    MyPythonStore, _ = _python_stores(T)
    if T.is_torch:
        T.dist._test_python_store(MyPythonStore())
    else:
        _through_the_library(MyPythonStore())


@S.check(f"{STORE}::TestPythonStore::test_optional_methods_fail")
def check_testpythonstore_test_optional_methods_fail(T: Impl) -> None:
    class TestStore(T.dist.Store):  # type: ignore[name-defined,misc]
        pass

    store = TestStore()
    assert not store.has_extended_api()
    match_re(RuntimeError, "Not implemented.", lambda: store.append("foo", "bar"))
    match_re(RuntimeError, "Not implemented.", lambda: store.multi_get(["foo", "bar"]))
    match_re(RuntimeError, "Not implemented.", lambda: store.multi_set(["foo", "bar"], [b"v", b"v"]))


@S.check(f"{STORE}::TestPythonStore::test_has_extended_api_passthrough")
def check_testpythonstore_test_has_extended_api_passthrough(T: Impl) -> None:
    class TestStore(T.dist.Store):  # type: ignore[name-defined,misc]
        pass

    store = T.dist.PrefixStore("p", TestStore())
    assert not store.has_extended_api()
    match_re(RuntimeError, "Not implemented.", lambda: store.append("foo", "bar"))
    match_re(RuntimeError, "Not implemented.", lambda: store.multi_get(["foo", "bar"]))
    match_re(RuntimeError, "Not implemented.", lambda: store.multi_set(["foo", "bar"], [b"v", b"v"]))


@S.check(f"{STORE}::TestPythonStore::test_has_extended_api_roundtrip")
def check_testpythonstore_test_has_extended_api_roundtrip(T: Impl) -> None:
    _newer_than_213(T)
    _, DummyStore = _python_stores(T)
    assert T.dist.PrefixStore("p", DummyStore()).has_extended_api()


@S.check(f"{STORE}::TestPythonStore::test_append_roundtrip")
def check_testpythonstore_test_append_roundtrip(T: Impl) -> None:
    _, DummyStore = _python_stores(T)
    store = DummyStore()
    prefix = T.dist.PrefixStore("p", store)
    prefix.append("foo", "bar")
    assert len(store.appends) == 1
    assert store.appends[0] == ("p/foo", b"bar")


@S.check(f"{STORE}::TestPythonStore::test_multi_get_roundtrip")
def check_testpythonstore_test_multi_get_roundtrip(T: Impl) -> None:
    _, DummyStore = _python_stores(T)
    store = DummyStore()
    prefix = T.dist.PrefixStore("p", store)
    store.multi_get_res.append([b"x", b"y"])
    res = prefix.multi_get(["foo", "bar"])
    assert len(store.multi_gets) == 1
    assert store.multi_gets[0] == ["p/foo", "p/bar"]
    assert res == [b"x", b"y"]


@S.check(f"{STORE}::TestPythonStore::test_multi_set_roundtrip")
def check_testpythonstore_test_multi_set_roundtrip(T: Impl) -> None:
    _, DummyStore = _python_stores(T)
    store = DummyStore()
    prefix = T.dist.PrefixStore("p", store)
    prefix.multi_set(["foo", "bar"], [b"x", b"y"])
    assert len(store.multi_sets) == 1
    assert store.multi_sets[0][0] == ["p/foo", "p/bar"]
    assert store.multi_sets[0][1] == [b"x", b"y"]


@S.check(f"{STORE}::TestPythonStore::test_extended_methods_fallbacks")
def check_testpythonstore_test_extended_methods_fallbacks(T: Impl) -> None:
    _newer_than_213(T)
    MyPythonStore, _ = _python_stores(T)
    store = T.dist.PrefixStore("p", MyPythonStore())
    assert not store.has_extended_api()
    store.append("foo", b"po")
    store.append("foo", b"tato")
    assert store.get("foo") == b"potato"
    store.multi_set(["a", "b"], [b"c", b"d"])
    assert store.multi_get(["a", "b", "foo"]) == [b"c", b"d", b"potato"]


# ----------------------------------------------------------------------------- test_store.py: threads

def _two_threads(body: Callable[[int], None]) -> None:
    """MultiThreadedTestCase with world_size 2: ``body(rank)`` on two threads."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def _test_wait(store: Any, rank: int) -> None:
    store.set_timeout(timedelta(seconds=2))
    if rank == 0:
        store.wait(["key1"])
        assert store.get("key1") == b"value1"
    if rank == 1:
        store.set("key1", "value1")


def _wait_kinds() -> dict[str, Callable[[Impl], Any]]:
    return {
        "test_wait_hash_store": lambda T: T.dist.HashStore(),
        "test_wait_file_store": lambda T: T.dist.FileStore(tmpfile(T), 1),
        "test_wait_prefix_file_store": lambda T: T.dist.PrefixStore("pre", T.dist.FileStore(tmpfile(T), 1)),
    }


for _test, _make in _wait_kinds().items():
    def _body(T: Impl, make: Callable[[Impl], Any] = _make) -> None:
        store = make(T)
        _two_threads(lambda rank: _test_wait(store, rank))
    _body.__name__ = _test
    S.check(f"{STORE}::TestMultiThreadedWait::{_test}")(_body)


for _test, _uv in (("test_wait_tcp_store", False), ("test_wait_tcp_store_uv", True)):
    def _tbody(T: Impl, uv: bool = _uv) -> None:
        master_store = create_tcp_store(T, use_libuv=uv)
        stores = [master_store, T.dist.TCPStore(host_name=master_store.host, port=master_store.port,
                                                is_master=False, wait_for_workers=False, use_libuv=False)]
        _two_threads(lambda rank: _test_wait(stores[rank], rank))
        prefixed = [T.dist.PrefixStore("pre", s) for s in stores]
        _two_threads(lambda rank: _test_wait(prefixed[rank], rank))
    _tbody.__name__ = _test
    S.check(f"{STORE}::TestMultiThreadedWait::{_test}")(_tbody)


@S.check(f"{STORE}::TimeoutTest::test_interrupt_doesnt_break_wait")
def check_timeouttest_test_interrupt_doesnt_break_wait(T: Impl) -> None:
    rank_res: list[Any] = [None, None]

    def run(rank: int, my_store: Any) -> None:
        try:
            if rank == 0:
                time.sleep(4)
                my_store.set("foo", "bar")
            else:
                my_store.wait(["foo"], timedelta(seconds=10))
            rank_res[rank] = True
        except Exception as e:
            rank_res[rank] = e
        time.sleep(1)

    rank0_store = T.dist.TCPStore(host_name=HOST, port=0, world_size=2, is_master=True, wait_for_workers=False)
    rank1_store = T.dist.TCPStore(host_name=HOST, port=rank0_store.port, world_size=2, is_master=False,
                                  wait_for_workers=False)
    threads = []
    for i in range(2):
        t = threading.Thread(target=run, args=(i, [rank0_store, rank1_store][i]))
        t.start()
        threads.append(t)
    old = signal.signal(signal.SIGUSR1, lambda a, b: None)
    try:
        time.sleep(1)
        assert threads[1].ident is not None
        signal.pthread_kill(threads[1].ident, signal.SIGUSR1)
        for t in threads:
            t.join(30)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert rank_res[0] is True, f"rank0: {rank_res[0]!r}"
    assert rank_res[1] is True, f"rank1: {rank_res[1]!r}"


# ----------------------------------------------------------------------------- test_control_collectives.py

def _pool(world_size: int, f: Callable[[int], None]) -> None:
    with ThreadPool(world_size) as pool:
        pool.map(f, range(world_size))


@C.check(f"{CONTROL}::TestCollectives::test_barrier")
def check_test_barrier(T: Impl) -> None:
    store = T.dist.HashStore()

    def f(rank: int) -> None:
        name(T, "_StoreCollectives")(store, rank, 2).barrier("foo", timedelta(seconds=10), True)

    _pool(2, f)


@C.check(f"{CONTROL}::TestCollectives::test_broadcast")
def check_test_broadcast(T: Impl) -> None:
    store, timeout = T.dist.HashStore(), timedelta(seconds=10)

    def f(rank: int) -> None:
        collectives = name(T, "_StoreCollectives")(store, rank, 4)
        if rank == 2:
            collectives.broadcast_send("foo", b"data", timeout)
        else:
            assert collectives.broadcast_recv("foo", timeout) == b"data"

    _pool(4, f)


@C.check(f"{CONTROL}::TestCollectives::test_gather")
def check_test_gather(T: Impl) -> None:
    store, timeout = T.dist.HashStore(), timedelta(seconds=10)

    def f(rank: int) -> None:
        collectives = name(T, "_StoreCollectives")(store, rank, 4)
        if rank == 2:
            assert collectives.gather_recv("foo", str(rank), timeout) == [b"0", b"1", b"2", b"3"]
        else:
            collectives.gather_send("foo", str(rank), timeout)

    _pool(4, f)


@C.check(f"{CONTROL}::TestCollectives::test_scatter")
def check_test_scatter(T: Impl) -> None:
    store, timeout = T.dist.HashStore(), timedelta(seconds=10)

    def f(rank: int) -> None:
        collectives = name(T, "_StoreCollectives")(store, rank, 4)
        if rank == 2:
            out = collectives.scatter_send("foo", [str(i) for i in range(4)], timeout)
        else:
            out = collectives.scatter_recv("foo", timeout)
        assert out == str(rank).encode()

    _pool(4, f)


@C.check(f"{CONTROL}::TestCollectives::test_all_sum")
def check_test_all_sum(T: Impl) -> None:
    store, timeout = T.dist.HashStore(), timedelta(seconds=10)

    def f(rank: int) -> None:
        assert name(T, "_StoreCollectives")(store, rank, 4).all_sum("foo", rank, timeout) == sum(range(4))

    _pool(4, f)


def _timeout_check(test: str, pattern: str, call: Callable[[Any, timedelta], Any]) -> None:
    def body(T: Impl) -> None:
        collectives = name(T, "_StoreCollectives")(T.dist.HashStore(), 1, 4)
        match_re(Exception, pattern, lambda: call(collectives, timedelta(milliseconds=1)))
    body.__name__ = test
    C.check(f"{CONTROL}::TestCollectives::{test}")(body)


_timeout_check("test_broadcast_timeout", "Wait timeout", lambda c, t: c.broadcast_recv("foo", t))
_timeout_check("test_gather_timeout", "gather failed -- missing ranks: 0, 2, 3",
               lambda c, t: c.gather_recv("foo", "data", t))
_timeout_check("test_scatter_timeout", "Wait timeout", lambda c, t: c.scatter_recv("foo", t))
_timeout_check("test_all_gather_timeout", "all_gather failed -- missing ranks: 0, 2, 3",
               lambda c, t: c.all_gather("foo", "data", t))
_timeout_check("test_barrier_timeout", "barrier failed -- missing ranks: 0, 2, 3",
               lambda c, t: c.barrier("foo", t, True))
_timeout_check("test_all_sum_timeout", "barrier failed -- missing ranks: 0, 2, 3",
               lambda c, t: c.all_sum("foo", 1, t))


@C.check(f"{CONTROL}::TestCollectives::test_unique")
def check_test_unique(T: Impl) -> None:
    collectives = name(T, "_StoreCollectives")(T.dist.HashStore(), 1, 1)
    collectives.broadcast_send("foo", "bar")
    used = "Key foo has already been used"
    match_re(Exception, used, lambda: collectives.broadcast_send("foo", "bar"))
    match_re(Exception, used, lambda: collectives.broadcast_recv("foo"))
    match_re(Exception, used, lambda: collectives.gather_send("foo", "bar"))
    match_re(Exception, used, lambda: collectives.gather_recv("foo", "asdf"))
    match_re(Exception, used, lambda: collectives.scatter_send("foo", ["asdf"]))
    match_re(Exception, used, lambda: collectives.scatter_recv("foo"))
    match_re(Exception, used, lambda: collectives.all_gather("foo", "bar"))
    match_re(Exception, used, lambda: collectives.all_sum("foo", 2))


@C.check(f"{CONTROL}::TestCollectives::test_simple_user_func")
def check_test_simple_user_func(T: Impl) -> None:
    store = T.dist.HashStore()

    def simple_user_func(collectives: Any, rank: int) -> int:
        timeout = timedelta(seconds=10)
        collectives.barrier("1", timeout, True)
        return int(collectives.all_sum("2", rank, timeout))

    def f(rank: int) -> None:
        assert simple_user_func(name(T, "_StoreCollectives")(store, rank, 4), rank) == sum(range(4))

    _pool(4, f)


# ----------------------------------------------------------------------------- ReduceOp, Backend, debug level

def _ops(T: Impl) -> list[Any]:
    R_ = T.dist.ReduceOp
    return [R_.SUM, R_.AVG, R_.PRODUCT, R_.MIN, R_.MAX, R_.BAND, R_.BOR, R_.BXOR]


@R.check(f"{COMMON}::ReduceOpTest::test_op_isinstance_of_reduceop")
def check_test_op_isinstance_of_reduceop(T: Impl) -> None:
    for reduce_op in _ops(T):
        assert isinstance(reduce_op, T.dist.ReduceOp), reduce_op
    for scale in (scalar_array(T, 1.0), 2.0):
        assert isinstance(T.dist._make_nccl_premul_sum(scale), T.dist.ReduceOp), scale
        premul_sum = T.dist.ReduceOp.PREMUL_SUM(scale)
        assert isinstance(premul_sum, T.dist.ReduceOp), premul_sum
        assert premul_sum.factor == scale, (premul_sum.factor, scale)


@R.check(f"{COMMON}::ReduceOpTest::test_reduceop_copyable")
def check_test_reduceop_copyable(T: Impl) -> None:
    for reduce_op in _ops(T):
        assert copy.copy(reduce_op) == reduce_op
        assert copy.deepcopy(reduce_op) == reduce_op
        assert copy.copy(T.dist.ReduceOp(reduce_op)) == reduce_op
        assert copy.deepcopy(T.dist.ReduceOp(reduce_op)) == reduce_op
    for scale in (scalar_array(T, 1.0), 2.0):
        reduce_op = T.dist._make_nccl_premul_sum(scale)
        assert copy.copy(reduce_op) == reduce_op
        assert copy.deepcopy(reduce_op) == reduce_op


@R.check(f"{COMMON}::ReduceOpTest::test_reduceop_pickle")
def check_test_reduceop_pickle(T: Impl) -> None:
    for reduce_op in _ops(T):
        pickle.loads(pickle.dumps(reduce_op))
        orig = T.dist.ReduceOp(reduce_op)
        assert pickle.loads(pickle.dumps(orig)) == orig
    for scale in (scalar_array(T, 1.0), 2.0):
        reduce_op = T.dist._make_nccl_premul_sum(scale)
        assert pickle.loads(pickle.dumps(reduce_op)) == reduce_op


@R.check(f"{COMMON}::ReduceOpTest::test_reduceop_equal")
def check_test_reduceop_equal(T: Impl) -> None:
    not_reduceop = "abc"
    for reduce_op in _ops(T):
        reduce_op_obj = T.dist.ReduceOp(reduce_op)
        assert reduce_op_obj == reduce_op_obj
        assert reduce_op_obj == reduce_op
        assert reduce_op_obj != not_reduceop
        assert reduce_op != not_reduceop
        if T.is_torch:
            # torch's RedOpType.__eq__(ReduceOp) is False (its test marks this a TODO)
            assert reduce_op != reduce_op_obj
        else:
            # deliberate difference (docs/torch-differences.md): equality is symmetric
            assert reduce_op == reduce_op_obj
        assert None not in (reduce_op, reduce_op_obj)
        assert not_reduceop not in (reduce_op, reduce_op_obj)


@R.check(f"{DIST}::test_Backend_enum_class (BACKEND=gloo)")
def check_test_backend_enum_class(T: Impl) -> None:
    backend = "gloo"
    assert T.dist.Backend("GLOO") == backend
    assert T.dist.Backend("gloo") == backend
    match_re(ValueError, None, lambda: T.dist.Backend(None))
    match_re(ValueError, None, lambda: T.dist.Backend(3))
    match_re(ValueError, None, lambda: T.dist.Backend(["gloo"]))


@R.check(f"{COMMON}::CommonDistributedDataParallelTest::test_debug_level (and str(DebugLevel))")
def check_test_debug_level(T: Impl) -> None:
    DL = T.dist.DebugLevel
    mapping = {"OFF": DL.OFF, "off": DL.OFF, "oFf": DL.OFF, "INFO": DL.INFO, "info": DL.INFO,
               "INfO": DL.INFO, "DETAIL": DL.DETAIL, "detail": DL.DETAIL, "DeTaIl": DL.DETAIL}
    invalid_debug_modes = ["foo", 0, 1, -1]
    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    try:
        for mode in mapping:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = str(mode)
            T.dist.set_debug_level_from_env()
            got = T.dist.get_debug_level()
            assert got == mapping[mode], f"Expected {mode} to map to {mapping[mode]} but got {got}"
        for mode in invalid_debug_modes:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = str(mode)
            match_re(ValueError, "The value of TORCH_DISTRIBUTED_DEBUG must", T.dist.set_debug_level_from_env)
    finally:
        if old is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
        T.dist.set_debug_level_from_env()
    assert str(DL.DETAIL) == "DebugLevel.DETAIL"
    assert str(DL.OFF) == "DebugLevel.OFF"


@G.check(f"{DIST}::test_get_backend (BACKEND=gloo)")
def check_test_get_backend(T: Impl) -> None:
    group = [1, 2] if T.dist.get_world_size() > 2 else [0, 1]
    group_id = T.dist.new_group(group)
    backend_str = "gloo"
    assert T.dist.get_backend() == backend_str
    if T.dist.get_rank() in group:
        assert T.dist.get_backend(group_id) == backend_str
    else:
        match_re(ValueError, "Invalid process group specified",
                 lambda: T.dist.get_backend(group_id))

"""Stores: torch's test/distributed/test_store.py (StoreTestBase and the per-store
classes for FileStore, HashStore, TCPStore, PrefixStore over each), on both
implementations' own store classes. Runs without a process group."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

from _conf_core import Impl, eq, raises, section

SRC = "test/distributed/test_store.py"
S = section("store", world_sizes=(1,), init=False, timeout=90.0)
STORE_KINDS = ("hash", "file", "tcp", "prefix_file", "prefix_tcp")

_counter = [0]


def _make(T: Impl, kind: str) -> Any:
    d = T.dist
    _counter[0] += 1
    path = os.path.join(T.workdir, f"{kind}-{_counter[0]}")
    if kind == "hash":
        st = d.HashStore()
    elif kind in ("file", "prefix_file"):
        st = d.FileStore(path, 1)
    else:
        # 127.0.0.1, not localhost: torch's TCPStore may wait on a reverse DNS lookup
        st = d.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    if kind.startswith("prefix_"):
        st = d.PrefixStore("test_prefix", st)
    st.set_timeout(timedelta(seconds=30))
    return st


def _timeout_errors(T: Impl) -> Any:
    return (RuntimeError,)  # torch raises DistStoreError (a RuntimeError); so should we


def _each_kind(fn: Any) -> Any:
    """Register one check per store kind for a body ``fn(T, store)``."""
    for kind in STORE_KINDS:
        def body(T: Impl, kind: str = kind) -> None:
            fn(T, _make(T, kind))
        body.__name__ = f"{fn.__name__}[{kind}]"
        S.check(f"{SRC}::{fn.__name__.removeprefix('check_')}")(body)
    return fn


@_each_kind
def check_set_get(T: Impl, fs: Any) -> None:
    # torch asserts num_keys against a per-store constant (5, or 6 with the store's own
    # bookkeeping key); the intent is "five user keys were added": compare to the start.
    base = fs.num_keys()
    for k, v in (("key", 1), ("key", 2), ("key", 3)):
        fs.add(k, v)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    fs.add("key3", 2)
    fs.set("key2", "value2")
    for v in (3, 4, 5, 6):
        fs.add("key3", v)
    assert fs.num_keys() - base == 5, (base, fs.num_keys())
    assert fs.get("key") == b"6"
    assert fs.get("key0") == b"value0"
    assert fs.get("key1") == b"value1"
    assert fs.get("key2") == b"value2"
    assert fs.get("key3") == b"21"
    fs.set("-key3", "7")
    assert fs.get("-key3") == b"7"
    fs.delete_key("-key3")
    assert fs.num_keys() - base == 5


@_each_kind
def check_compare_set(T: Impl, store: Any) -> None:
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"wrong_old_value"
    store.set("cs_key0", "value0")
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "wrong_old_value", "new_value0") == b"value0"
    assert store.get("cs_key0") == b"value0"
    assert store.compare_set("cs_key0", "value0", "new_value0") == b"new_value0"
    assert store.get("cs_key0") == b"new_value0"
    assert store.compare_set("cs_key1", "", "new_value1") == b"new_value1"
    assert store.get("cs_key1") == b"new_value1"


@_each_kind
def check_simple_wait(T: Impl, fs: Any) -> None:
    exc = raises(_timeout_errors(T), lambda: fs.wait(["bad_key"], timedelta(seconds=0.25)))
    if T.is_torch:
        assert "imeout" in str(exc), exc
    else:
        # torch's words first ("Wait timeout"), then what timed out, after how long,
        # where, and which keys are still missing; a RuntimeError and a TimeoutError
        assert "imeout" in str(exc), exc
        assert isinstance(exc, TimeoutError) and isinstance(exc, RuntimeError), type(exc)
        assert "timed out after 0.25 s" in str(exc) and "still missing: ['bad_key']" in str(exc), exc
    fs.add("good_key", 1)
    fs.wait(["good_key"])


@_each_kind
def check_get_timeout(T: Impl, fs: Any) -> None:
    # TCPStoreTest.test_numkeys_delkeys: get of a deleted key fails after the store timeout
    fs.set("k", "v")
    fs.delete_key("k")
    fs.set_timeout(timedelta(seconds=0.3))
    t0 = time.monotonic()
    raises(_timeout_errors(T), lambda: fs.get("k"))
    assert time.monotonic() - t0 < 10


@_each_kind
def check_numkeys_delkeys(T: Impl, fs: Any) -> None:
    base = fs.num_keys()
    fs.add("key", 1)
    fs.add("key", 2)
    fs.add("key", 3)
    fs.set("key0", "value0")
    fs.add("key3", 1)
    fs.set("key1", "value1")
    assert fs.num_keys() - base == 4
    assert fs.delete_key("key") is True
    assert fs.num_keys() - base == 3
    fs.delete_key("key0")
    fs.delete_key("key3")
    assert fs.num_keys() - base == 1
    fs.set("key4", "value2")
    assert fs.num_keys() - base == 2
    assert fs.get("key1") == b"value1"
    assert fs.get("key4") == b"value2"


@_each_kind
def check_multi_set_get(T: Impl, fs: Any) -> None:
    # StoreTestBase.test_multi_set / test_multi_get
    fs.multi_set(["ms1", "ms2"], ["v1", b"v2"])
    assert fs.get("ms1") == b"v1"
    assert fs.multi_get(["ms1", "ms2"]) == [b"v1", b"v2"]


@_each_kind
def check_append(T: Impl, fs: Any) -> None:
    fs.set("foo", "po")
    fs.append("foo", "tato")
    fs.append("bar", "po")
    fs.append("bar", "tato")
    assert fs.get("foo") == b"potato"
    assert fs.get("bar") == b"potato"


@_each_kind
def check_check(T: Impl, fs: Any) -> None:
    fs.add("ck1", 1)
    assert fs.check(["ck1"]) is True
    assert fs.check(["ck1", "nokey"]) is False
    fs.set("ck2", "x")
    assert fs.check(["ck1", "ck2"]) is True


@_each_kind
def check_queue(T: Impl, fs: Any) -> None:
    if T.is_torch and type(fs).__name__ in ("FileStore", "HashStore", "PrefixStore") \
            and not hasattr(fs, "queue_push"):
        T.skip("torch store lacks queues")
    try:
        fs.queue_push("q", "a")
    except (RuntimeError, NotImplementedError) as exc:
        if T.is_torch:
            T.skip(f"torch {type(fs).__name__} has no queues: {exc}")
        raise
    fs.queue_push("q", b"b")
    assert fs.queue_len("q") == 2
    assert fs.queue_pop("q") == b"a"
    assert fs.queue_pop("q") == b"b"
    assert fs.queue_len("q") == 0


@S.check(f"{SRC}::PrefixStoreTest::test_get_underlying_store")
def check_get_underlying_store(T: Impl) -> None:
    for kind in ("hash", "file", "tcp"):
        st = _make(T, kind)
        assert T.dist.PrefixStore("prefix", st).underlying_store is st or \
            T.dist.PrefixStore("prefix", st).underlying_store == st, kind


@S.check(f"{SRC}::PrefixStoreTest (keys land prefixed in the base store)")
def check_prefix_isolation(T: Impl) -> None:
    base = T.dist.HashStore()
    a, b = T.dist.PrefixStore("a", base), T.dist.PrefixStore("b", base)
    a.set("k", "1")
    b.set("k", "2")
    assert a.get("k") == b"1" and b.get("k") == b"2"
    assert base.get("a/k") == b"1"


@S.check(f"{SRC}::TCPStoreTest::test_multi_worker_with_fixed_world_size")
def check_tcp_multi_worker(T: Impl) -> None:
    d = T.dist
    for ws in (5, None):
        server = d.TCPStore("127.0.0.1", 0, ws, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        server.set("key", "value")
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                c = d.TCPStore("127.0.0.1", server.port, ws, False, timeout=timedelta(seconds=10))
                assert c.get("key") == b"value"
                c.set(f"new_key{i}", f"new_value{i}")
                assert c.compare_set(f"new_key{i}", f"new_value{i}", f"next_value{i}") == f"next_value{i}".encode()
            except BaseException as exc:  # reported below
                errors.append(exc)

        # world_size counts the server; the other ws - 1 (or 4) are clients
        threads = [threading.Thread(target=client, args=(i,)) for i in range((ws or 5) - 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errors:
            raise errors[0]


@S.check(f"{SRC}::TCPStoreTest::test_address_already_in_use")
def check_tcp_address_in_use(T: Impl) -> None:
    s1 = T.dist.TCPStore("127.0.0.1", 0, 1, True)
    exc = raises(Exception, lambda: T.dist.TCPStore("127.0.0.1", s1.port, 1, True, timeout=timedelta(seconds=5)))
    if not T.is_torch:
        assert isinstance(exc, (T.dist.DistError, OSError)), type(exc)


@S.check(f"{SRC}::TimeoutTest::test_interrupt_doesnt_break_wait (wait wakes on a later set)")
def check_wait_wakes_on_set(T: Impl) -> None:
    st = T.dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    other = T.dist.TCPStore("127.0.0.1", st.port, None, False, timeout=timedelta(seconds=10))
    t = threading.Timer(0.2, lambda: other.set("late", "x"))
    t.start()
    st.wait(["late"], timedelta(seconds=5))
    assert st.get("late") == b"x"
    t.join()


@S.check(f"{SRC}::FileStoreTest (two FileStores on one file see each other)")
def check_filestore_shared_file(T: Impl) -> None:
    path = os.path.join(T.workdir, "shared-fs")
    a, b = T.dist.FileStore(path, 2), T.dist.FileStore(path, 2)
    a.set("x", "1")
    assert b.get("x") == b"1"
    assert b.add("n", 2) == 2 and a.add("n", 3) == 5

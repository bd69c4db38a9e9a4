"""The Store contract, run over every store: HashStore, FileStore, TCPStore and a
PrefixStore over each of them. The expected behaviour is torch.distributed's Store
API as specified in docs/stores.md, checked here call by call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest

from gpucoll.errors import DistStoreError, DistStoreTimeoutError
from gpucoll.store import FileStore, HashStore, PrefixStore, Store, TCPStore

KINDS = ["hash", "file", "tcp", "prefix-hash", "prefix-file", "prefix-tcp"]


def _make(kind: str, tmp_path: Path) -> tuple[Store, list[Store]]:
    base_kind = kind.removeprefix("prefix-")
    base: Store
    if base_kind == "hash":
        base = HashStore(timeout=10)
    elif base_kind == "file":
        base = FileStore(tmp_path / "store.log", timeout=10)
    else:
        base = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    if kind.startswith("prefix-"):
        # Something outside the namespace, to check that it stays invisible.
        base.set("outside", b"o")
        return PrefixStore("ns", PrefixStore("outer", base)), [base]
    return base, [base]


@pytest.fixture(params=KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s, owned = _make(request.param, tmp_path)
    try:
        yield s
    finally:
        for o in owned:
            o.close()


def _later(delay: float, fn: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- set / get ------------------------------------------------------------------------------

def test_set_get_roundtrip_bytes_like_and_str(store: Store) -> None:
    store.set("b", b"\x00\xffbin")
    store.set("s", "h\u00e9llo")
    store.set("ba", bytearray(b"ba"))
    store.set("mv", memoryview(b"xmvx")[1:3])
    store.set("empty", b"")
    assert store.get("b") == b"\x00\xffbin"
    assert store.get("s") == "h\u00e9llo".encode()
    assert store.get("ba") == b"ba"
    assert store.get("mv") == b"mv"
    assert store.get("empty") == b""
    assert type(store.get("ba")) is bytes


def test_set_overwrites(store: Store) -> None:
    store.set("k", b"1")
    store.set("k", b"2")
    assert store.get("k") == b"2"


def test_unicode_and_long_keys(store: Store) -> None:
    key = "r\u00e4ng/\u4e2d/" + "x" * 1000
    store.set(key, b"v")
    assert store.get(key) == b"v"
    assert key in store.list_keys()


def test_large_binary_value(store: Store) -> None:
    value = bytes(range(256)) * 8192  # 2 MiB
    store.set("big", value)
    assert store.get("big") == value


def test_get_blocks_until_set(store: Store) -> None:
    t0 = time.monotonic()
    _later(0.2, lambda: store.set("late", b"L"))
    assert store.get("late", timeout=5) == b"L"
    assert 0.15 < time.monotonic() - t0 < 2.0


def test_get_timeout_is_honoured_and_named(store: Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=r"missing: \['(outer/ns/)?absent'\]") as info:
        store.get("absent", timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.8
    assert "0.3 s" in str(info.value)
    assert isinstance(info.value, DistStoreError) and isinstance(info.value, TimeoutError)


def test_default_timeout_applies_and_accepts_timedelta(store: Store) -> None:
    store.set_timeout(timedelta(milliseconds=250))
    assert store.timeout == pytest.approx(0.25)
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError):
        store.get("absent")
    assert 0.25 <= time.monotonic() - t0 < 0.75
    store.set_timeout(3)
    assert store.timeout == 3.0
    with pytest.raises(ValueError, match="timeout"):
        store.set_timeout(0)
    with pytest.raises(TypeError, match="timeout"):
        store.set_timeout("5")  # type: ignore[arg-type]


def test_many_threads_wait_on_one_key(store: Store) -> None:
    results: list[bytes] = []
    lock = threading.Lock()

    def getter() -> None:
        v = store.get("go", timeout=10)
        with lock:
            results.append(v)

    threads = [threading.Thread(target=getter) for _ in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    store.set("go", b"now")
    for t in threads:
        t.join(10)
    assert results == [b"now"] * 12


# -- wait / check ---------------------------------------------------------------------------

def test_wait_for_several_keys(store: Store) -> None:
    store.set("w1", b"1")
    _later(0.1, lambda: store.set("w2", b"2"))
    _later(0.2, lambda: store.set("w3", b"3"))
    t0 = time.monotonic()
    store.wait(["w1", "w2", "w3"], timeout=5)
    assert 0.15 < time.monotonic() - t0 < 2.0
    store.wait(["w1"])
    store.wait("w2")  # one str is one key
    store.wait([])


def test_wait_timeout_names_only_missing_keys(store: Store) -> None:
    store.set("here", b"1")
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError) as info:
        store.wait(["here", "gone1", "gone2"], timeout=timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - t0 < 0.8
    msg = str(info.value)
    missing = msg.split("still missing:")[1]
    assert "gone1" in missing and "gone2" in missing and "here" not in missing


def test_wait_sees_key_deleted_and_set_again(store: Store) -> None:
    store.set("a", b"1")
    store.delete_key("a")
    _later(0.1, lambda: store.set("a", b"2"))
    store.wait(["a"], timeout=5)
    assert store.get("a") == b"2"


def test_check(store: Store) -> None:
    assert not store.check(["c1"])
    store.set("c1", b"")
    assert store.check(["c1"])
    assert store.check("c1")
    assert not store.check(["c1", "c2"])
    assert store.check([])


# -- add / compare_set / append -------------------------------------------------------------

def test_add(store: Store) -> None:
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    assert store.add("n", 0) == -2
    assert store.get("n") == b"-2"
    big = 2**70
    assert store.add("huge", big) == big
    store.set("preset", b"40")
    assert store.add("preset", 2) == 42


def test_add_on_non_integer_raises(store: Store) -> None:
    store.set("text", b"abc")
    with pytest.raises(DistStoreError, match="not a decimal integer"):
        store.add("text", 1)
    assert store.get("text") == b"abc"


def test_compare_set_rules(store: Store) -> None:
    # Absent key, empty expected: set.
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.get("k") == b"first"
    # Present key, wrong expected: unchanged, current value returned.
    assert store.compare_set("k", b"nope", b"x") == b"first"
    assert store.get("k") == b"first"
    # Present key, right expected: swapped.
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.get("k") == b"second"
    # Absent key, non-empty expected: nothing set, expected returned.
    assert store.compare_set("absent", b"exp", b"des") == b"exp"
    assert not store.check(["absent"])


def test_compare_set_wakes_getters(store: Store) -> None:
    _later(0.1, lambda: store.compare_set("cs", b"", b"won"))
    assert store.get("cs", timeout=5) == b"won"


def test_append(store: Store) -> None:
    store.append("log", b"a")
    store.append("log", "b")
    store.append("log", bytearray(b"c"))
    assert store.get("log") == b"abc"


def test_append_wakes_getters(store: Store) -> None:
    _later(0.1, lambda: store.append("ap", b"x"))
    assert store.get("ap", timeout=5) == b"x"


# -- delete / num_keys / list_keys ----------------------------------------------------------

def test_delete_key(store: Store) -> None:
    store.set("d", b"1")
    assert store.delete_key("d") is True
    assert store.delete_key("d") is False
    assert not store.check(["d"])
    with pytest.raises(DistStoreTimeoutError):
        store.get("d", timeout=0.1)


def test_num_keys_and_list_keys(store: Store) -> None:
    # num_keys counts as torch does: a FileStore's bookkeeping key too, and a PrefixStore
    # every key of the store under it (torch's absolute counts are checked in
    # tests/conformance/test_ported_store.py); list_keys lists only this namespace
    base = store.num_keys()
    assert base in (0, 1, 2)
    assert store.list_keys() == []
    store.set("x", b"1")
    store.add("y", 1)
    store.multi_set(["z1", "z2"], [b"", b""])
    store.queue_push("queue", b"q")  # queues are not keys
    assert store.num_keys() == base + 4
    assert sorted(store.list_keys()) == ["x", "y", "z1", "z2"]
    store.delete_key("x")
    assert store.num_keys() == base + 3
    assert sorted(store.list_keys()) == ["y", "z1", "z2"]


# -- multi_get / multi_set ------------------------------------------------------------------

def test_multi_set_multi_get(store: Store) -> None:
    keys = [f"m{i}" for i in range(50)]
    values = [f"v{i}".encode() * i for i in range(50)]
    store.multi_set(keys, values)
    assert store.multi_get(keys) == values
    assert store.multi_get(list(reversed(keys))) == list(reversed(values))
    assert store.multi_get([]) == []
    store.multi_set([], [])
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def test_multi_get_waits_for_all(store: Store) -> None:
    store.set("g1", b"1")
    _later(0.15, lambda: store.set("g2", b"2"))
    assert store.multi_get(["g1", "g2"], timeout=5) == [b"1", b"2"]
    with pytest.raises(DistStoreTimeoutError, match="g3"):
        store.multi_get(["g1", "g3"], timeout=0.2)


# -- queues ---------------------------------------------------------------------------------

def test_queue_fifo(store: Store) -> None:
    for i in range(5):
        store.queue_push("q", f"{i}")
    assert store.queue_len("q") == 5
    assert [store.queue_pop("q") for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]
    assert store.queue_len("q") == 0
    assert store.queue_len("never") == 0


def test_queue_pop_nonblocking_empty_raises(store: Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistStoreError, match="empty") as info:
        store.queue_pop("q", block=False)
    assert not isinstance(info.value, DistStoreTimeoutError)
    assert time.monotonic() - t0 < 0.5


def test_queue_pop_blocks_until_push(store: Store) -> None:
    _later(0.15, lambda: store.queue_push("q", b"item"))
    assert store.queue_pop("q", timeout=5) == b"item"
    assert store.queue_len("q") == 0


def test_queue_pop_timeout(store: Store) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="queue_pop"):
        store.queue_pop("q", timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 0.8
    store.queue_push("q", b"after")
    assert store.queue_pop("q", block=False) == b"after"


def test_queue_items_delivered_once_across_threads(store: Store) -> None:
    got: list[bytes] = []
    lock = threading.Lock()

    def popper() -> None:
        for _ in range(10):
            v = store.queue_pop("work", timeout=10)
            with lock:
                got.append(v)

    threads = [threading.Thread(target=popper) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(40):
        store.queue_push("work", str(i))
    for t in threads:
        t.join(15)
    assert sorted(int(v) for v in got) == list(range(40))


def test_delete_key_removes_queue(store: Store) -> None:
    store.queue_push("dq", b"1")
    assert store.delete_key("dq") is True
    assert store.queue_len("dq") == 0


# -- bad arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("call, arg", [
    (lambda s: s.set(1, b"v"), "key"),
    (lambda s: s.set(b"k", b"v"), "key"),
    (lambda s: s.set("k", 5), "value"),
    (lambda s: s.set("k", None), "value"),
    (lambda s: s.get(3.5), "key"),
    (lambda s: s.add("k", 1.5), "amount"),
    (lambda s: s.add("k", True), "amount"),
    (lambda s: s.add(None, 1), "key"),
    (lambda s: s.compare_set("k", 1, b""), "expected_value"),
    (lambda s: s.compare_set("k", b"", [1]), "desired_value"),
    (lambda s: s.wait([1]), "keys"),
    (lambda s: s.wait(b"k"), "keys"),
    (lambda s: s.check(7), "keys"),
    (lambda s: s.multi_get(["a", 2]), "keys"),
    (lambda s: s.multi_set(["a"], [3]), "values"),
    (lambda s: s.multi_set(["a"], b"x"), "values"),
    (lambda s: s.append("k", 1), "value"),
    (lambda s: s.queue_push(None, b""), "key"),
    (lambda s: s.queue_push("q", 1.0), "value"),
    (lambda s: s.delete_key(1), "key"),
    (lambda s: s.get("k", timeout="1"), "timeout"),
])
def test_wrong_types_raise_typeerror_naming_argument(store: Store, call: Callable[[Store], Any],
                                                       arg: str) -> None:
    with pytest.raises(TypeError, match=rf"\b{arg}\b"):
        call(store)


def test_nonpositive_timeout_is_valueerror(store: Store) -> None:
    with pytest.raises(ValueError, match="timeout"):
        store.get("k", timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        store.wait(["k"], timeout=timedelta(0))


def test_context_manager_closes(tmp_path: Path) -> None:
    with HashStore() as s:
        s.set("a", b"1")
    with FileStore(tmp_path / "f") as f:
        f.set("a", b"1")
    assert not (tmp_path / "f").exists()

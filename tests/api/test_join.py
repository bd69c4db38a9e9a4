"""The start-up head count waits parked on the store: a rank costs the store a fixed
number of requests however long the others take, wakes as soon as the last rank
joins, says who is missing after NOTICE_AFTER, and raises the same message at the
timeout. (The message itself, across processes: tests/api/test_messages.py.)"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest

from gpucoll._group import join
from gpucoll.errors import DistStoreTimeoutError
from gpucoll.store import HashStore


class CountingStore(HashStore):
    """A HashStore that counts each thread's requests by kind."""

    def __init__(self) -> None:
        super().__init__(timeout=30)
        self.calls: dict[int, Counter[str]] = {}
        self._lock2 = threading.Lock()

    def _count(self, kind: str) -> None:
        with self._lock2:
            self.calls.setdefault(threading.get_ident(), Counter())[kind] += 1

    def add(self, key: str, amount: int) -> int:
        self._count("add")
        return super().add(key, amount)

    def set(self, key: str, value: Any) -> None:
        self._count("set")
        super().set(key, value)

    def wait(self, keys: Any, timeout: Any = None) -> None:
        self._count("wait")
        super().wait(keys, timeout)


def _join_in_thread(store: CountingStore, rank: int, world: int, timeout: float,
                    out: dict[int, Any]) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            join.await_all_joined(store, rank, world, timeout)
            out[rank] = ("ok", time.monotonic() - t0, store.calls.get(threading.get_ident()))
        except BaseException as e:  # reported by the test
            out[rank] = (e, time.monotonic() - t0, store.calls.get(threading.get_ident()))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_an_early_rank_waits_parked_and_wakes_when_the_last_joins() -> None:
    """Rank 0 joins 1.5 s before the other two: it makes one add and one wait in that
    time (polling made a request every few hundred ms), and returns as soon as the last
    rank's add completes the count."""
    store = CountingStore()
    out: dict[int, Any] = {}
    early = _join_in_thread(store, 0, 3, 20.0, out)
    time.sleep(1.5)
    late = [_join_in_thread(store, r, 3, 20.0, out) for r in (1, 2)]
    for t in [early, *late]:
        t.join(10)
    assert all(out[r][0] == "ok" for r in range(3)), out
    assert 1.4 < out[0][1] < 3.0, out[0]
    assert out[0][2] == Counter(add=1, wait=1), out[0][2]
    # Exactly one of the late two completed the count and set the key; the other waited.
    kinds = sorted(tuple(sorted(out[r][2].items())) for r in (1, 2))
    assert kinds == [(("add", 1), ("set", 1)), (("add", 1), ("wait", 1))], kinds
    assert store.get(f"{join.JOIN_KEY}/3") == b"1"


def test_a_missing_rank_gives_the_notice_then_the_timeout_with_few_requests(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(join, "NOTICE_AFTER", 0.4)
    store = CountingStore()
    t0 = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="only 1 of world_size=2 processes joined within 2 s"):
        join.await_all_joined(store, 0, 2, 2.0)
    took = time.monotonic() - t0
    assert 1.9 < took < 3.0, took
    err = capsys.readouterr().err
    assert err.count("1 of world_size=2 processes have joined after") == 1, err
    calls = store.calls[threading.get_ident()]
    # The add that joins, then per wake-up (notice, last look, deadline) a wait and a count.
    assert calls["add"] <= 4 and calls["wait"] <= 3, calls


def test_a_count_completed_without_its_key_still_ends_before_the_deadline() -> None:
    """The rank that completed the count died before setting the key: the others see
    the full count at their last look, shortly before the deadline, and go on."""
    store = CountingStore()
    out: dict[int, Any] = {}
    t = _join_in_thread(store, 0, 2, 2.0, out)
    time.sleep(0.2)
    store.add(join.JOIN_KEY, 1)  # rank 1 counted itself in, and died
    t.join(10)
    assert out[0][0] == "ok", out
    assert 1.3 < out[0][1] < 1.9, out[0]


def test_generations_count_apart_on_one_store() -> None:
    """A store that outlives a group counts the next init of the same size afresh."""
    store = CountingStore()
    for gen in range(3):
        out: dict[int, Any] = {}
        ts = [_join_in_thread(store, r, 2, 10.0, out) for r in range(2)]
        for t in ts:
            t.join(10)
        assert all(out[r][0] == "ok" for r in range(2)), (gen, out)
        assert store.check([f"{join.JOIN_KEY}/{2 * (gen + 1)}"])


def test_the_parked_wait_works_on_torchs_store_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the store is torch's TCPStore, spoken to in torch's protocol: the
    timed wait (woken at the notice) and the count read after it work there too."""
    torch_dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    from gpucoll.store import TCPStore

    monkeypatch.setattr(join, "NOTICE_AFTER", 0.3)
    server = torch_dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    out: dict[int, Any] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        store = TCPStore("127.0.0.1", server.port, timeout=30, use_unix_socket=False)
        t0 = time.monotonic()
        try:
            join.await_all_joined(store, r, 2, 10.0)
            out[r] = ("ok", time.monotonic() - t0)
        except BaseException as e:  # reported by the test
            out[r] = (e, time.monotonic() - t0)
        finally:
            store.close()

    ts = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 1.0))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    assert 0.8 < out[0][1] < 3.0, out
    assert server.check([f"{join.JOIN_KEY}/2"])  # the key the last rank set, seen by torch

"""The CPU backend's lean host path: what it does differently must not change a result.

- all-gather of bytes and objects moves each rank's size and the start of its payload
  in one fixed-size exchange and only the rest in a second one: payloads on both sides
  of that boundary, mixed across ranks, match a reference built independently on the
  test's side; the size limit still fails every rank alike and leaves the group usable;
  with an async op queued ahead, the op takes the Work path and keeps the issue order.
- a synchronous all_reduce of any size runs on the caller's thread: large ones too.
- a shared-memory wait whose spin was preempted cuts its spin budget (a slow peer does
  not), does not spin at all when its peer last waited on the same CPU, and still
  returns when the peer posts and raises a named timeout when it never does.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._objects import FIRST_BYTES
from gpucoll.testing import run_spmd

HEAD = FIRST_BYTES - 8  # payload bytes that ride with the size in the first exchange
# One size per rank (rank r takes entry r % len): both sides of the boundary, mixed.
PATTERNS = [
    [0],
    [HEAD],
    [HEAD + 1],
    [0, HEAD - 1, HEAD + 1, 1],
    [5, 3 * FIRST_BYTES + 17, 0],
    [300_000, 12],  # the second exchange is larger than a shared-memory slot
]


def payload(rank: int, size: int, salt: int) -> bytes:
    return ((np.arange(size, dtype=np.int64) * (rank + 3) + salt) % 251).astype(np.uint8).tobytes()


def gather_body() -> dict[str, Any]:
    import gpucoll
    from gpucoll._env import MAX_OBJECT_BYTES_ENV

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    bad: list[str] = []
    for k, pattern in enumerate(PATTERNS):
        sizes = [pattern[j % len(pattern)] for j in range(n)]
        got = gpucoll.all_gather_bytes(payload(r, sizes[r], k))
        if got != [payload(j, sizes[j], k) for j in range(n)]:
            bad.append(f"bytes {pattern}: {[len(g) for g in got]}")
        objs: list[Any] = [None] * n
        gpucoll.all_gather_object(objs, {"rank": r, "blob": payload(r, sizes[r], k)})
        if objs != [{"rank": j, "blob": payload(j, sizes[j], k)} for j in range(n)]:
            bad.append(f"objects {pattern}")

    # An async op queued ahead (a large all_reduce goes to the worker thread): the
    # gather waits its turn (Work path) and both results are right.
    big = np.full(1 << 19, r + 1, np.float32)  # 2 MiB
    work = gpucoll.all_reduce(big, async_op=True)
    got = gpucoll.all_gather_bytes(payload(r, 100 + r, 99))
    assert work is not None
    work.wait()
    if got != [payload(j, 100 + j, 99) for j in range(n)]:
        bad.append("bytes behind an async op")
    if not np.all(big == n * (n + 1) / 2):
        bad.append("async all_reduce ahead of the gather")

    # A synchronous large all_reduce (caller's thread now) in rank order.
    x = np.arange(1 << 19, dtype=np.float64) * (r + 1)
    gpucoll.all_reduce(x)
    if not np.array_equal(x, np.arange(1 << 19, dtype=np.float64) * (n * (n + 1) // 2)):
        bad.append("large synchronous all_reduce")

    # The size limit: every rank raises the same ValueError, naming the rank over it,
    # and the group stays usable.
    os.environ[MAX_OBJECT_BYTES_ENV] = str(2 * FIRST_BYTES)
    over = n - 1
    try:
        gpucoll.all_gather_bytes(payload(r, 3 * FIRST_BYTES if r == over else 10, 7))
    except ValueError as exc:
        limit_msg = str(exc)
    else:
        limit_msg = "returned"
    del os.environ[MAX_OBJECT_BYTES_ENV]
    got = gpucoll.all_gather_bytes(payload(r, 10, 8))
    if got != [payload(j, 10, 8) for j in range(n)]:
        bad.append("after the limit")
    return {"bad": bad, "limit": limit_msg}


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_all_gather_bytes_and_objects_across_the_first_exchange(world_size: int) -> None:
    for r, res in enumerate(run_spmd(gather_body, world_size, timeout=180)):
        assert res["bad"] == [], (world_size, r, res["bad"])
        msg = res["limit"]
        assert f"rank {world_size - 1}'s payload of {3 * FIRST_BYTES} bytes exceeds the limit" in msg, (r, msg)


class _Clock:
    """``time`` for shm.py: perf_counter advances 1 µs per read (a spin never sees a gap the
    test did not ask for, whatever the machine does), and by ``gap`` more once, after
    ``after`` reads (a spin that was preempted); monotonic is the real clock."""

    def __init__(self, gap: float = 0.0, after: int = 1 << 30) -> None:
        self.gap, self.after, self.reads, self.t = gap, after, 0, 0.0

    def perf_counter(self) -> float:
        self.reads += 1
        self.t += 1e-6 + (self.gap if self.reads == self.after + 1 else 0.0)
        return self.t

    def monotonic(self) -> float:
        return time.monotonic()


def test_the_spin_budget_is_cut_by_preemption_not_by_a_slow_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll.errors import DistBackendError
    from gpucoll.store import HashStore
    from gpucoll._backends.cpu import shm

    store = HashStore()
    segs: list[Any] = [None, None]
    ts = [threading.Thread(target=lambda r=r: segs.__setitem__(r, shm.ShmSegment(
        store, r, 2, small_bytes=4096, bulk_bytes=4096, timeout=10.0, spin_seconds=200e-6))) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    a, b = segs
    crowded = [False]
    monkeypatch.setattr(a, "_crowded", lambda: crowded[0])  # the machine's real load stays out
    try:
        assert a.spin_now == 200e-6
        # A slow peer (posts long after any spin) on an idle machine: the wait spins its
        # 200 µs, sleeps, and the budget stays.
        clock = _Clock()
        monkeypatch.setattr(shm, "time", clock)
        threading.Timer(0.05, b.post).start()
        t0 = time.monotonic()
        a.wait(1, 1, time.monotonic() + 10.0, lambda: None, lambda: "op")
        assert time.monotonic() - t0 < 5.0 and b.counter(1) == 1
        assert a.spin_now == 200e-6 and clock.reads > 150
        # A spin that was preempted: the budget drops to SPIN_SECONDS, and the wait
        # still returns when the peer posts.
        monkeypatch.setattr(shm, "time", _Clock(gap=1e-3, after=3))
        threading.Timer(0.05, b.post).start()
        a.wait(1, 2, time.monotonic() + 10.0, lambda: None, lambda: "op")
        assert b.counter(1) == 2
        assert a.spin_now == shm.SPIN_SECONDS < 200e-6
        # A spin that ran out on a crowded machine: cut too.
        a.spin_now = 200e-6
        crowded[0] = True
        monkeypatch.setattr(shm, "time", _Clock())
        threading.Timer(0.05, b.post).start()
        a.wait(1, 3, time.monotonic() + 10.0, lambda: None, lambda: "op")
        assert b.counter(1) == 3 and a.spin_now == shm.SPIN_SECONDS
        crowded[0] = False
        a.spin_now = 200e-6
        monkeypatch.setattr(shm, "time", time)
        a.wait(1, 3, time.monotonic() + 10.0, lambda: None, lambda: "op")  # already there: at once
        with pytest.raises(DistBackendError, match=r"op: timed out waiting for rank 1 \(its progress 3, needed 4\)"):
            a.wait(1, 4, time.monotonic() + 0.2, lambda: None, lambda: "op")
        assert a.timed_out_on == 1

        # A peer last seen waiting on this rank's own CPU: no spin at all (it could not
        # run meanwhile), one yield, then the sleep; the peer's post still ends the wait.
        mine = os.sched_getaffinity(0)
        cpu = min(mine)
        os.sched_setaffinity(0, {cpu})  # this thread only: the CPU it reads is the one it runs on
        try:
            b.ctl[b.rank * shm.REC_WORDS + 6] = cpu + 1  # rank 1's "last waited on" word
            clock = _Clock()
            monkeypatch.setattr(shm, "time", clock)
            a.spin_now = 200e-6
            threading.Timer(0.05, b.post).start()
            a.wait(1, 4, time.monotonic() + 10.0, lambda: None, lambda: "op")
            assert b.counter(1) == 4
            assert clock.reads <= 3, clock.reads  # a 200 µs spin reads it some 200 times
            assert a.ctl[a.rank * shm.REC_WORDS + 6] == cpu + 1
            assert a.spin_now == 200e-6  # no spin this time is not a smaller budget next time
            # The peer runs during the yield and posts: the wait ends without sleeping,
            # and the budget stays whole.
            monkeypatch.setattr(shm.os, "sched_yield", b.post)
            a.wait(1, 5, time.monotonic() + 10.0, lambda: None, lambda: "op")
            assert b.counter(1) == 5 and a.spin_now == 200e-6
        finally:
            os.sched_setaffinity(0, mine)
    finally:
        for s in segs:
            s.close()

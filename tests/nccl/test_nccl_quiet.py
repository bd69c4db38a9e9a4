"""A group's synchronous device op with no completion hook is issued with no Work
(IssuesQuietly; gpucoll/_backends/nccl/hot.py): the results, the caller's stream
order, the flight recorder and the timeout are what a Work gives, and a hook, an
async caller or a new kind of op still gets its Work."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll._backends.nccl import hot as _hot
from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._backends.nccl.work import NCCLWork
from gpucoll._work import WorkInfo

from _nccl_fake import FakeRuntime
from _fake_gpu_world import FakeDeviceArray, run_groups


def _count_works(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each op the backend issues with a Work (its all_reduce or broadcast)."""
    made: list[str] = []
    for name in ("all_reduce", "broadcast"):
        method = getattr(NCCLBackend, name)

        def counted(self: Any, *args: Any, _name: str = name, _method: Any = method) -> Any:
            made.append(_name)
            return _method(self, *args)
        monkeypatch.setattr(NCCLBackend, name, counted)
    return made


def test_synchronous_ops_without_a_hook_make_no_work_and_keep_every_record(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _count_works(monkeypatch)
    records: list[str] = []

    class CountedQuiet(_hot.Quiet):
        __slots__ = ()

        def __init__(self, op_type: str, *args: Any) -> None:
            records.append(op_type)
            super().__init__(op_type, *args)
    monkeypatch.setattr(_hot, "Quiet", CountedQuiet)

    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        size = pg.size()
        x = FakeDeviceArray(rt, np.zeros(5, np.float32))
        y = FakeDeviceArray(rt, np.zeros(3, np.int64))
        for i in range(3 * _hot.PRUNE_AT):
            x.rt.fabric.mem.view(x.buf.ptr, 20)[:] = np.full(5, rank + i, np.float32).view(np.uint8)
            pg.all_reduce(x)
            want = sum(r + i for r in range(size))
            assert x.get().tolist() == [want] * 5, (i, x.get())  # as the caller's stream sees it
            if i % 7 == 0:
                pg.broadcast(y, i % size)
        # Once the GPU caught up, every op's flight-recorder entry says completed.
        x.get()
        while pg._nccl.poll_pending() is not None:
            pass
        entries = pg._issuer.recorder.snapshot()["entries"]
        assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
        assert {e["state"] for e in entries} == {"completed"}, {e["state"] for e in entries}
        assert all(isinstance(e["active_duration"], float) for e in entries)

    run_groups(3, body, monkeypatch)
    # One Work per rank for each kind of op's first call (the general path makes its
    # Work then), none after: 3 ranks x (all_reduce, a broadcast from each of 3 roots).
    assert sorted(made) == sorted(["all_reduce"] * 3 + ["broadcast"] * 9), made
    # Every later synchronous op was a record in the backend's queue instead: per rank,
    # every all_reduce but the first, and the broadcasts after each root's first (3 roots).
    broadcasts = len(range(0, 3 * _hot.PRUNE_AT, 7))
    assert records.count("all_reduce") == 3 * (3 * _hot.PRUNE_AT - 1), len(records)
    assert records.count("broadcast") == 3 * (broadcasts - 3), len(records)


def test_a_hook_or_an_async_caller_still_gets_works(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[int]:
        x = FakeDeviceArray(rt, np.ones(4, np.float32))
        pg.all_reduce(x)
        pg.all_reduce(x)
        work = pg.all_reduce(x, async_op=True)  # an async caller: a Work
        assert isinstance(work, NCCLWork) and work.seq == 3
        work.wait()
        seen: list[WorkInfo] = []
        pg.register_on_completion_hook(seen.append)
        for _ in range(4):
            pg.all_reduce(x)  # a hook: every op has its Work, so the hook gets its WorkInfo
        assert x.get().tolist() == [3.0 ** 7] * 4
        pg._destroy()  # delivers the hooks still queued
        return sorted(i.seq for i in seen)
    assert run_groups(3, body, monkeypatch) == [[4, 5, 6, 7]] * 3

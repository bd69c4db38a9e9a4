"""The device hot path's derived state (gpucoll/_group/group.py, ``ProcessGroup._restate``):
``_device_runs`` and ``_device_seen`` are the issuer's dicts only while no completion hook,
no DETAIL debug level, no coalescing block and no destruction asks for the general path,
and empty otherwise. Every writer of those four facts is flipped here, after the array's
DeviceRun exists, and each test checks that the op then goes the general path (the
issuer's ``run_device`` is not called) and gives what that path gives. Also the
identity cache in front of the runs' key (``Issuer.saw``): another op object on the same
array, a shape set in place, an entry of a dead array whose id was reused."""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._group.core import Issuer
from gpucoll._reduce_op import ReduceOp
from gpucoll._work import WorkInfo

from _fake_cupy_costs import CupyOnFake, cupy_or_none
from _nccl_fake import FakeRuntime, read_on_stream
from _fake_gpu_world import run_groups
from test_nccl_device_runs import _array, _put, _RankRuntime, cupy_fake  # noqa: F401 (cupy_fake: a fixture)

pytestmark = pytest.mark.skipif(cupy_or_none() is None, reason="CuPy is not installed")


@pytest.fixture
def run_device_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ops went through ``Issuer.run_device`` (the hot path), by rank thread's group."""
    calls: list[int] = []
    real = Issuer.run_device

    def counted(self: Issuer, run: Any, tensor: Any, async_op: bool = False) -> Any:
        calls.append(self.rank)
        return real(self, run, tensor, async_op)
    monkeypatch.setattr(Issuer, "run_device", counted)
    return calls


def _fast(pg: Any) -> bool:
    issuer = pg._issuer
    return pg._device_runs is issuer.device_runs and pg._device_seen is issuer.device_seen


def test_each_writer_of_the_four_facts_turns_the_hot_path_off_and_on(
        cupy_fake: CupyOnFake, run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        size, bad = pg.size(), []
        base = np.arange(8, dtype=np.float32)
        x, buf = _array(cupy_fake, rt, base + rank)
        want = sum(base + r for r in range(size))

        def check(what: str, hot: bool) -> None:
            before = run_device_calls.count(rank)
            _put(rt, buf, base + rank)
            pg.all_reduce(x)
            if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20), want):
                bad.append(f"{what}: values")
            if (run_device_calls.count(rank) > before) != hot:
                bad.append(f"{what}: hot path {'not ' if hot else ''}taken")
            if _fast(pg) != hot:
                bad.append(f"{what}: derived state {_fast(pg)}")

        pg.all_reduce(x)  # plans the op and makes its DeviceRun
        read_on_stream(rt, buf, np.float32).get(timeout=20)  # (done before the host writes x again)
        check("steady state", True)
        # A coalescing block: ops inside are deferred (no hot path), and after it the
        # hot path is back.
        _put(rt, buf, base + rank)
        with gpucoll.coalescing(pg) as cm:
            if _fast(pg):
                bad.append("coalescing: derived state still fast")
            before = run_device_calls.count(rank)
            pg.all_reduce(x)
            if run_device_calls.count(rank) != before:
                bad.append("coalescing: hot path taken inside the block")
        cm.wait()
        if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20), want):
            bad.append("coalescing: values")
        check("after coalescing", True)
        # A completion hook (hooks are never removed): the general path, which feeds it.
        infos: list[WorkInfo] = []
        pg.register_on_completion_hook(infos.append)
        check("with a hook", False)
        deadline = time.monotonic() + 10
        while not infos and time.monotonic() < deadline:
            time.sleep(0.01)
        if not infos or infos[-1].op_type != "all_reduce":
            bad.append(f"hook saw {infos}")
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]


def test_a_destroyed_group_refuses_an_array_it_has_a_run_for(
        cupy_fake: CupyOnFake, run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        x, buf = _array(cupy_fake, rt, np.ones(8, np.float32))
        pg.all_reduce(x)
        pg.all_reduce(x)
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        bad = [] if _fast(pg) else ["not fast before"]
        pg._destroy()
        if _fast(pg) or pg._device_runs or pg._device_seen:
            bad.append("derived state still fast once destroyed")
        before = len(run_device_calls)
        try:
            pg.all_reduce(x)
            bad.append("no error")
        except RuntimeError as exc:
            if "destroyed" not in str(exc) and "g" not in str(exc):
                bad.append(f"error: {exc}")
        if len(run_device_calls) != before:
            bad.append("hot path taken")
        return bad

    assert run_groups(1, body, monkeypatch) == [[]]


def test_detail_at_the_groups_creation_keeps_the_hot_path_off(
        cupy_fake: CupyOnFake, run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOLL_DEBUG", "DETAIL")
    checked: list[str] = []
    real = Issuer.check_across_ranks

    def counted(self: Issuer, op: str, *args: Any) -> Any:
        checked.append(op)
        return real(self, op, *args)
    monkeypatch.setattr(Issuer, "check_across_ranks", counted)

    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        x, buf = _array(cupy_fake, rt, np.full(8, rank + 1.0, np.float32))
        for _ in range(3):
            pg.all_reduce(x)
        got = read_on_stream(rt, buf, np.float32).get(timeout=20)
        bad = [] if np.array_equal(got, np.full(8, 3.0 * 2 * 2, np.float32)) else [f"values {got}"]
        if _fast(pg):
            bad.append("derived state fast under DETAIL")
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]
    assert run_device_calls == [] and checked.count("all_reduce") == 6, (run_device_calls, checked)


def test_the_identity_cache_never_serves_another_op_or_a_dead_arrays_run(
        cupy_fake: CupyOnFake, run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        size, bad = pg.size(), []
        base = np.arange(16, dtype=np.float32)
        x, buf = _array(cupy_fake, rt, base + rank)
        seen = pg._issuer.device_seen

        def run(arr: Any, op: Any, fill: np.ndarray, want: np.ndarray, what: str) -> None:
            _put(rt, buf, fill)
            pg.all_reduce(arr, op=op)
            got = read_on_stream(rt, buf, np.float32).get(timeout=20)
            if not np.array_equal(got[:want.size], want):
                bad.append(f"{what}: {got}")

        for _ in range(2):
            run(x, ReduceOp.SUM, base + rank, sum(base + r for r in range(size)), "SUM")
        if seen.get(id(x), (None, None))[1] is not ReduceOp.SUM:
            bad.append("SUM not remembered")
        # Another op object on the same array: its own run, never SUM's.
        for _ in range(2):
            run(x, ReduceOp.MAX, base + rank, base + size - 1, "MAX after SUM")
        run(x, ReduceOp.SUM, base + rank, sum(base + r for r in range(size)), "SUM after MAX")
        # A shape set in place (same memory, size and dtype): the same NCCL call, right values.
        x.shape = (4, 4)
        run(x, ReduceOp.SUM, base + rank, sum(base + r for r in range(size)), "reshaped in place")
        x.shape = (16,)
        # A dead array's entry under the id a new array now has: the weak reference is
        # dead, so the entry is not used (the new array here is a half-size view).
        half = x[:8]
        gone = cupy_fake.array(4, "float32", ptr=buf.ptr)
        stale = weakref.ref(gone)
        entry = seen.get(id(x))
        del gone
        if stale() is not None or entry is None:
            bad.append("set-up")
        else:
            seen[id(half)] = (stale, ReduceOp.SUM, entry[2])  # the full array's run under half's id
            run(half, ReduceOp.SUM, base + rank, sum(base[:8] + r for r in range(size)), "dead entry")
            got = read_on_stream(rt, buf, np.float32).get(timeout=20)
            if not np.array_equal(got[8:], base[8:] + rank):  # the rest left alone
                bad.append(f"dead entry's run served: {got}")
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]
    assert run_device_calls, "no op went through a run"


def test_the_module_function_reads_the_same_derived_state(
        run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # gpucoll.all_reduce(x) on the default group makes ProcessGroup.all_reduce's identity
    # look-up itself (gpucoll/_collectives.py): it takes the hot path exactly when the
    # group would, and leaves it for every writer the group's own look-up obeys.
    from test_nccl_per_op_counts import _world

    worlds = _world(monkeypatch, "0")
    _, rt, x, _backend = next(worlds)
    try:
        from gpucoll._world import default_group
        pg = default_group()

        def hot(call: Any) -> bool:
            before = len(run_device_calls)
            call()
            return len(run_device_calls) > before

        gpucoll.all_reduce(x)  # plans the op and makes its DeviceRun
        assert hot(lambda: gpucoll.all_reduce(x)) and hot(lambda: gpucoll.all_reduce(x, async_op=True).wait())
        # Another op object on the array: never the entry's run (MAX has none yet: the
        # general path plans it; then MAX has its own).
        assert not hot(lambda: gpucoll.all_reduce(x, op=ReduceOp.MAX))
        gpucoll.all_reduce(x, op=ReduceOp.MAX)
        assert hot(lambda: gpucoll.all_reduce(x, op=ReduceOp.MAX))
        assert pg._device_seen[id(x)][1] is ReduceOp.MAX
        gpucoll.all_reduce(x)
        # A coalescing block: deferred, not run; after it the hot path is back.
        with gpucoll.coalescing() as cm:
            assert not hot(lambda: gpucoll.all_reduce(x))
        cm.wait()
        gpucoll.all_reduce(x)
        assert hot(lambda: gpucoll.all_reduce(x))
        # A completion hook (never removed): the general path, which feeds it.
        infos: list[WorkInfo] = []
        pg.register_on_completion_hook(infos.append)
        assert not hot(lambda: gpucoll.all_reduce(x))
        rt.finish_all()
        deadline = time.monotonic() + 10
        while not infos and time.monotonic() < deadline:
            pg._nccl.poll_pending()
            time.sleep(0.01)
        assert infos and infos[-1].op_type == "all_reduce", infos
    finally:
        next(worlds, None)


def test_a_run_has_the_watchdog_watch_its_backend_until_it_does(
        run_device_calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # Issuer.run_device asks the watchdog to watch the run's backend until it does
    # (DeviceRun.watched), then asks no more: a backend once watched is never dropped.
    from test_nccl_per_op_counts import _world

    worlds = _world(monkeypatch, "0")
    _, rt, x, backend = next(worlds)
    try:
        from gpucoll._world import default_group
        pg = default_group()
        for _ in range(3):
            gpucoll.all_reduce(x)
        run = pg._device_seen[id(x)][2]
        watchdog = pg._issuer.watchdog
        assert run.watched and any(b is backend for b in watchdog._backends)
        # As if the watchdog had never seen the backend: the next hot op has it watched.
        calls: list[Any] = []
        real = type(watchdog).watch_backend
        monkeypatch.setattr(type(watchdog), "watch_backend",
                            lambda self, b: (calls.append(b), real(self, b))[1])
        with watchdog._lock:
            watchdog._backends = [b for b in watchdog._backends if b is not backend]
        watchdog._last_watched = watchdog.watched = None
        run.watched = False
        for async_op in (False, True, False):
            before = len(run_device_calls)
            work = gpucoll.all_reduce(x, async_op=async_op)
            if work is not None:
                work.wait()
            assert len(run_device_calls) == before + 1
        assert calls == [backend], calls  # once, then the flag
        assert run.watched and any(b is backend for b in watchdog._backends)
    finally:
        next(worlds, None)

"""The NCCL backend under the real ProcessGroup and world API on the fake GPU: sync and
async ops, hooks, coalescing, the watchdog, functional ops, DETAIL checks, timeouts,
new_group/split_group splitting the parent communicator."""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._backends.nccl.lib import Features
from gpucoll.errors import DistBackendError
from gpucoll._reduce_op import ReduceOp
from gpucoll.store import HashStore

from _nccl_fake import FakeRuntime, read, read_on_stream
from _reference import close, np_dtype, reference
from _fake_gpu_world import (DEFAULT_FEATURES, FakeDeviceArray, run_fake_gpu_worlds,
                             run_groups, split_made)


def test_process_group_sync_async_hooks_and_coalescing(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._collectives import coalescing

    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        infos: list[Any] = []
        pg.register_on_completion_hook(infos.append)
        x = FakeDeviceArray(rt, np.full(4, rank + 1, np.float32))
        assert pg.all_reduce(x) is None  # async_op=False: the caller's stream waits
        assert read_on_stream(rt, x.buf, np.float32).get(timeout=10).tolist() == [3.0] * 4
        w = pg.all_reduce(x, op=ReduceOp.MAX, async_op=True)
        assert w.result() == [x]
        w.wait(timeout=10)
        assert w.is_success() and read(rt, x.buf, np.float32).tolist() == [3.0] * 4
        a = FakeDeviceArray(rt, np.full(3, rank, np.int16))
        b = FakeDeviceArray(rt, np.full(2, rank + 5, np.int16))
        with coalescing(pg):
            pg.all_reduce(a, op=ReduceOp.BXOR)
            pg.all_reduce(b, op=ReduceOp.BXOR)
        assert read_on_stream(rt, a.buf, np.int16).get(timeout=10).tolist() == [0 ^ 1] * 3
        assert read_on_stream(rt, b.buf, np.int16).get(timeout=10).tolist() == [5 ^ 6] * 2
        deadline = time.monotonic() + 10
        while len(infos) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [i.op_type for i in infos[:3]] == ["all_reduce", "all_reduce", "all_reduce_coalesced"]
        assert [i.seq for i in infos[:3]] == [1, 2, 3]
        assert all(i.success and 0.0 <= i.active_duration < 10.0 and i.group_name == "g" for i in infos[:3])
    run_groups(2, body, monkeypatch)


def test_the_watchdog_completes_device_ops_through_the_backend_not_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        arrays = [FakeDeviceArray(rt, np.full(2, rank + 1, np.float32)) for _ in range(40)]
        refs = [weakref.ref(a) for a in arrays]
        for a in arrays:
            pg.all_reduce(a)
        assert pg._watchdog.outstanding() == 0  # nothing recorded per device op
        del arrays, a
        deadline = time.monotonic() + 10
        while (pg._nccl.outstanding or any(r() is not None for r in refs)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # every op completed by the watchdog, in order, and every array released
        assert not pg._nccl.outstanding and all(r() is None for r in refs)
    run_groups(2, body, monkeypatch)


def test_functional_all_reduce_on_nccl_is_out_of_place_without_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll import array as array_mod

    def no_copy(*args: Any) -> None:
        raise AssertionError("the NCCL path must not copy the input first")
    monkeypatch.setattr(array_mod, "copy_buffer", no_copy)

    def body(pg: Any, rt: FakeRuntime, rank: int) -> None:
        for name, op, values in (("float32", ReduceOp.SUM, [1.5, -2.0, 3.0]), ("int16", ReduceOp.BXOR, [5, 6, 7]),
                                 ("int32", ReduceOp.AVG, [7, -7, 9])):
            dt = np_dtype(name)
            host = np.array(values, dt) * (rank + 1)
            x = FakeDeviceArray(rt, host)
            y = FakeDeviceArray(rt, np.zeros(3, dt))
            pg._all_reduce_into(y, x, op)
            got = read_on_stream(rt, y.buf, dt).get(timeout=10)
            want = reference([np.array(values, dt) * (r + 1) for r in range(2)], name, op, 2)
            assert close(got, want, name), (name, got, want)
            assert read(rt, x.buf, dt).tolist() == host.tolist()  # the input is left alone
        with pytest.raises(ValueError, match="must match input"):
            pg._all_reduce_into(FakeDeviceArray(rt, np.zeros(2, np.float32)), FakeDeviceArray(rt, np.zeros(3, np.float32)))
    run_groups(2, body, monkeypatch)


def test_debug_detail_catches_collectives_that_differ_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCOLL_DEBUG", "detail")

    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        errors = []
        # Different sizes: NCCL would hang or read past the smaller array.
        x = FakeDeviceArray(rt, np.ones(4 * (rank + 1), np.float32))
        with pytest.raises(DistBackendError) as e1:
            pg.all_reduce(x)
        errors.append(str(e1.value))
        # Different roots, then different reduction ops.
        y = FakeDeviceArray(rt, np.full(3, rank + 1, np.float32))
        with pytest.raises(DistBackendError) as e2:
            pg.broadcast(y, src=rank)
        errors.append(str(e2.value))
        with pytest.raises(DistBackendError) as e3:
            pg.all_reduce(y, op=ReduceOp.SUM if rank == 0 else ReduceOp.MAX)
        errors.append(str(e3.value))
        # Matching ops go through, and per-peer sizes of all_to_all_single may differ.
        pg.all_reduce(y)
        assert read_on_stream(rt, y.buf, np.float32).get(timeout=10).tolist() == [3.0] * 3
        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 1 to each
        out = FakeDeviceArray(rt, np.zeros(2 + rank, np.float32))
        inp = FakeDeviceArray(rt, np.full(3 - rank, rank + 1, np.float32))
        pg.all_to_all_single(out, inp, output_split_sizes=[[1, 1], [2, 1]][rank],
                             input_split_sizes=[[1, 2], [1, 1]][rank])
        got = read_on_stream(rt, out.buf, np.float32).get(timeout=10).tolist()
        assert got == ([1.0, 2.0] if rank == 0 else [1.0, 1.0, 2.0]), got
        return errors
    results = run_groups(2, body, monkeypatch)
    for errors in results:
        sizes, roots, ops = errors
        assert "rank 0: op=all_reduce seq=1 dtype=float32 shape=(4,) reduce op=SUM" in sizes, sizes
        assert "rank 1: op=all_reduce seq=1 dtype=float32 shape=(8,) reduce op=SUM" in sizes, sizes
        assert "group 'g'" in sizes and "GPUCOLL_DEBUG=DETAIL" in sizes
        assert "root (rank 0: 0, rank 1: 1)" in roots, roots
        assert "SUM" in ops and "MAX" in ops
    monkeypatch.setenv("GPUCOLL_DEBUG", "loud")
    from gpucoll._group.registry import debug_level
    with pytest.raises(ValueError, match="The value of GPUCOLL_DEBUG must be OFF, INFO, or DETAIL"):
        debug_level()


def test_debug_detail_body_on_the_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/gpu's test_debug_detail_catches_mismatched_collectives, body and checks, on
    the fake GPU: the GPU-only test cannot drift from the message again."""
    from _shared_bodies import check_debug_detail, debug_detail_body

    monkeypatch.setenv("GPUCOLL_DEBUG", "DETAIL")

    def body(w: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        return debug_detail_body(rank, lambda v: FakeDeviceArray(rt, v), lambda a: a.get().tolist())
    for out in run_fake_gpu_worlds(2, body, monkeypatch):
        check_debug_detail(out)


def test_process_group_timeout_aborts_and_names_op_seq_group(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = HashStore()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> tuple[str, str]:
        x = FakeDeviceArray(rt, np.ones(4, np.float32))
        pg.all_reduce(x)
        if rank == 1:
            shared.wait(["done"], 30.0)  # never joins the next all_reduce
            pg._nccl.abort("the test is over")
            return "", ""
        pg.all_reduce(x)  # hangs on the GPU; the host goes on
        work = pg.all_reduce(x, async_op=True)
        with pytest.raises(DistBackendError) as hung:
            work.wait(timeout=20)
        with pytest.raises(DistBackendError) as later:
            pg.all_reduce(x)
        shared.set("done", "1")
        return str(hung.value), str(later.value)
    first, later = run_groups(2, body, monkeypatch, timeout=1.0)[0]
    assert "all_reduce (seq 3) on group 'g' failed" in first
    assert "(seq 2)" in first and "did not complete within the group's timeout" in first
    assert "all_reduce (seq 4) on group 'g' failed" in later and "(seq 2)" in later


def _sum_over(pg: Any, rt: FakeRuntime, rank: int) -> float:
    """all_reduce(SUM) of each member's global rank + 1 on ``pg``; the result as seen on the caller's stream."""
    x = FakeDeviceArray(rt, np.full(3, rank + 1, np.float32))
    pg.all_reduce(x)
    values = read_on_stream(rt, x.buf, np.float32).get(timeout=10)
    assert len(set(values.tolist())) == 1
    return float(values[0])


@pytest.mark.parametrize("size", [3, 4])
def test_new_group_and_split_group_split_the_parent_communicator(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._group.member import GroupMember

    def body(w: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        evens = gpucoll.new_group([r for r in range(size) if r % 2 == 0])
        if rank % 2:
            assert evens is GroupMember.NON_GROUP_MEMBER
        else:
            assert split_made(evens) and evens.size() == (size + 1) // 2
            assert evens._nccl.device == 0 and evens._device_id == 0
            out["evens"] = _sum_over(evens, rt, rank)
        # Two disjoint groups from one call; with 3 ranks, rank 2 is in neither.
        pairs = [[0, 1], [2, 3]] if size == 4 else [[1, 0]]
        mine = gpucoll.split_group(split_ranks=pairs)
        if rank < 2 * len(pairs):
            assert mine is not None and split_made(mine) and mine.rank() == rank % 2
            out["pair"] = _sum_over(mine, rt, rank)
        else:
            assert mine is None
        # A split of a split; then new_subgroups (one new_group per block).
        if mine is not None:
            solo = gpucoll.split_group(mine, split_ranks=[[1], [0]])
            assert solo.size() == 1 and split_made(solo)
            out["solo"] = _sum_over(solo, rt, rank)
        sub, subs = gpucoll.new_subgroups(1)
        assert len(subs) == size and sub.global_ranks == (rank,) and split_made(sub)
        out["sub"] = _sum_over(sub, rt, rank)
        # The default group still works after all the splits.
        out["all"] = _sum_over(w.default_group(), rt, rank)
        return out
    results = run_fake_gpu_worlds(size, body, monkeypatch)
    evens = sum(r + 1 for r in range(size) if r % 2 == 0)
    for rank, got in enumerate(results):
        assert got["all"] == size * (size + 1) / 2
        assert got["sub"] == rank + 1 and got.get("solo", rank + 1) == rank + 1
        assert got.get("evens", evens) == evens
        if rank < (4 if size == 4 else 2):
            assert got["pair"] == (3.0 if rank < 2 else 7.0)


def test_new_groups_without_a_split_make_their_own_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL without ncclCommSplit, and a default group created lazily: each new group
    # gets a communicator of its own from a fresh unique id; non-members take no part.
    for features, eager in ((Features(version=(2, 17, 1), comm_split=False), True), (DEFAULT_FEATURES, False)):
        def body(w: Any, rt: FakeRuntime, rank: int) -> float | None:
            _sum_over(w.default_group(), rt, rank)  # creates the default communicator (lazily or not)
            assert w.default_group()._nccl.can_split is not eager  # lazily made: splittable, yet not split
            g = gpucoll.new_group([0, 2])
            if rank == 1:
                return None
            if eager:
                assert g._nccl is not None and not split_made(g)
            else:
                assert g._nccl is None  # created by the first device op
            value = _sum_over(g, rt, rank)
            assert not split_made(g)
            return value
        assert run_fake_gpu_worlds(3, body, monkeypatch, features=features, eager=eager) == [4.0, None, 4.0]


def test_a_rank_that_never_joins_the_split_fails_the_others_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(w: Any, rt: FakeRuntime, rank: int) -> str:
        if rank == 2:
            time.sleep(0.1)
            return ""  # never calls new_group
        t0 = time.monotonic()
        with pytest.raises(DistBackendError) as err:
            gpucoll.new_group([0, 1], timeout=1.0)
        assert time.monotonic() - t0 < 8.0
        return str(err.value)
    results = run_fake_gpu_worlds(3, body, monkeypatch, timeout=1.0)
    for msg in results[:2]:
        assert "only 2 of 3 ranks of group 'default' reached its split (ncclCommSplit)" in msg
        assert "'group1'" in msg

"""The NCCL backend's hot path (gpucoll/_backends/nccl/hot.py) on the fake GPU: a
repeated op is issued by its cached NCCL call, is never served a stale call when the
op, dtype, size or device changes, gives way to the general path where that one has
more to do, and finished ops are completed in bulk, in issue order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll._buffer import DTYPES, Buffer, Device
from gpucoll._backends.nccl import hot as _hot
from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._reduce_op import ReduceOp
from gpucoll.errors import DistBackendError

from _nccl_fake import FakeRuntime, read, read_on_stream
from _fake_gpu_world import dev, run_world


def _write(rt: FakeRuntime, buf: Buffer, values: np.ndarray) -> None:
    """Put ``values``' bytes into ``buf``'s fake device memory (no op is running on it)."""
    rt.fabric.mem.view(buf.ptr, values.nbytes)[:] = values.reshape(-1).view(np.uint8)


def _count_general(be: NCCLBackend) -> list[str]:
    """Record each op the general path (``_issue``) issues."""
    seen: list[str] = []
    general = be._issue

    def counted(op_type: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(op_type)
        return general(op_type, *args, **kwargs)
    be._issue = counted  # type: ignore[method-assign]
    return seen


def test_a_repeated_all_reduce_takes_the_hot_path_and_is_never_served_a_stale_call() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        size = be.size
        general = _count_general(be)
        bad: list[str] = []
        buf = dev(rt, np.zeros(8, np.float32))
        for i in range(5):
            _write(rt, buf, np.arange(8, dtype=np.float32) + rank + i)
            be.all_reduce(buf, ReduceOp.SUM).synchronize()
            want = sum(np.arange(8, dtype=np.float32) + r + i for r in range(size))
            if not np.array_equal(read(rt, buf, np.float32), want):
                bad.append(f"SUM round {i}")
        assert general == ["all_reduce"], general  # the first call only
        assert len(be._hot) == 1
        # The same memory, another reduction: a call of its own.
        _write(rt, buf, np.arange(8, dtype=np.float32) * (rank + 1))
        be.all_reduce(buf, ReduceOp.MAX).synchronize()
        if not np.array_equal(read(rt, buf, np.float32), np.arange(8, dtype=np.float32) * size):
            bad.append("MAX after SUM")
        # The same address, fewer bytes: the rest is left alone.
        _write(rt, buf, np.full(8, rank + 1.0, np.float32))
        half = Buffer(buf.ptr, 16, buf.dtype, (4,), buf.device, owner=buf.owner)
        be.all_reduce(half, ReduceOp.SUM).synchronize()
        total = sum(r + 1.0 for r in range(size))
        if read(rt, buf, np.float32).tolist() != [total] * 4 + [rank + 1.0] * 4:
            bad.append(f"half: {read(rt, buf, np.float32).tolist()}")
        # The same bytes read as another dtype: reduced as that dtype.
        _write(rt, buf, np.full(8, rank + 1.0, np.float32))
        be.all_reduce(buf, ReduceOp.PRODUCT).synchronize()
        if read(rt, buf, np.float32).tolist() != [float(np.prod([r + 1.0 for r in range(size)]))] * 8:
            bad.append("float32 PRODUCT")
        _write(rt, buf, np.full(8, rank + 1, np.int32).view(np.float32))
        ints = Buffer(buf.ptr, buf.nbytes, DTYPES["int32"], (8,), buf.device, owner=buf.owner)
        for _ in range(2):
            be.all_reduce(ints, ReduceOp.PRODUCT).synchronize()
            got = read(rt, buf, np.float32).view(np.int32)
        want_prod = int(np.prod([r + 1 for r in range(size)])) ** size  # twice reduced
        if got.tolist() != [want_prod] * 8:
            bad.append(f"int32 PRODUCT: {got.tolist()}")
        assert general == ["all_reduce"] * 5, general  # one general issue per new key
        # A Buffer on another device, same address and size: refused as before.
        other = Buffer(buf.ptr, buf.nbytes, buf.dtype, buf.shape, Device("cuda", 1), owner=buf.owner)
        with pytest.raises(ValueError, match="must be on cuda:0"):
            be.all_reduce(other, ReduceOp.SUM)
        return bad

    for size in (1, 2, 3):
        assert run_world(size, body) == [[]] * size


def test_the_hot_path_gives_way_to_the_general_one() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(4, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        general = _count_general(be)
        # Memory whose producer stream gpucoll cannot order: the general path, whose
        # Work blocks the host in wait().
        producer = rt.new_stream()
        foreign = Buffer(buf.ptr, buf.nbytes, buf.dtype, buf.shape, buf.device, owner=buf.owner,
                         stream=producer.ptr, foreign_stream=True)
        work = be.all_reduce(foreign, ReduceOp.SUM)
        assert work.host_wait and general == ["all_reduce"]
        work.wait()
        # During a capture: the general path, which captures it (not pending, complete).
        rt.begin_capture()
        work = be.all_reduce(buf, ReduceOp.SUM)
        rt.end_capture()
        assert general == ["all_reduce"] * 2 and work.is_completed() and all(w is not work for w in be.outstanding)
        be.all_reduce(buf, ReduceOp.SUM).synchronize()  # and the hot path again after it
        assert general == ["all_reduce"] * 2
        # Aborted: the op fails naming the abort, without an NCCL call.
        be.abort("planted abort")
        with pytest.raises(DistBackendError, match="planted abort"):
            be.all_reduce(buf, ReduceOp.SUM).wait()
    run_world(2, body, shutdown=False)


def test_finished_ops_complete_in_bulk_in_issue_order() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.full(2, rank + 1.0, np.float32))
        order: list[int] = []
        works = []
        for i in range(3 * _hot.PRUNE_AT):
            w = be.all_reduce(buf, ReduceOp.MAX)
            w._add_done_callback(lambda w, i=i: order.append(i))
            works.append(w)
        works[-1].synchronize()
        while be.poll_pending() is not None:
            pass
        assert order == list(range(len(works)))  # every one, once, in order
        assert not be.outstanding and all(w.is_completed() and w.is_success() for w in works)
        assert read(rt, buf, np.float32).tolist() == [float(be.size)] * 2
    run_world(2, body)


def test_a_failed_event_query_aborts_and_fails_the_pending_ops() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(2, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        rt.op_delay = 0.05  # the GPU falls behind, so works stay pending
        works = [be.all_reduce(buf, ReduceOp.SUM) for _ in range(4)]

        def broken(event: int) -> bool:
            raise RuntimeError("planted: an illegal memory access")
        rt.query = broken  # type: ignore[method-assign]
        be.poll_pending()
        assert be.ending.aborted is not None and "planted" in be.ending.aborted
        for w in works:
            with pytest.raises(DistBackendError):
                w.wait()
    run_world(1, body, shutdown=False)


def test_timed_ops_on_the_hot_path_report_gpu_time() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(2, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        be.time_ops()
        before = rt.timing_events
        rt.op_delay = 0.02
        work = be.all_reduce(buf, ReduceOp.SUM)
        assert rt.timing_events == before + 2  # both events of the hot path time
        work.synchronize()
        assert work.active_duration is not None and 0.015 < work.active_duration < 5.0
    run_world(2, body)


def test_repeated_broadcasts_take_the_hot_path_and_sends_and_recvs_stay_right() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        size = be.size
        general = _count_general(be)
        bad: list[str] = []
        buf = dev(rt, np.zeros(6, np.int64))
        out = dev(rt, np.zeros(6, np.int64))
        inbox = dev(rt, np.zeros(6, np.int64))
        for i in range(4):
            for src in range(size):
                _write(rt, buf, np.arange(6, dtype=np.int64) * (rank + 1) + i)
                be.broadcast(buf, src).synchronize()
                if read(rt, buf, np.int64).tolist() != (np.arange(6) * (src + 1) + i).tolist():
                    bad.append(f"broadcast from {src}, round {i}")
            if size > 1:  # a ring: send to the next rank, receive from the previous one
                nxt, prv = (rank + 1) % size, (rank - 1) % size
                _write(rt, out, np.full(6, 10 * rank + i, np.int64))
                works = [be.send(out, nxt, 0), be.recv(inbox, prv, 0)] if rank % 2 == 0 else \
                    [be.recv(inbox, prv, 0), be.send(out, nxt, 0)]
                for w in works:
                    w.synchronize()
                if read(rt, inbox, np.int64).tolist() != [10 * prv + i] * 6:
                    bad.append(f"recv from {prv}, round {i}: {read(rt, inbox, np.int64).tolist()}")
        # One general issue per distinct broadcast (a root); the posted send and receive of
        # each round are issued together, as one NCCL group (posting.py).
        assert sorted(general) == sorted(["broadcast"] * size + (["batch_isend_irecv"] * 4 if size > 1 else [])), \
            general
        return bad

    for size in (1, 2, 3):
        assert run_world(size, body) == [[]] * size


def test_an_op_the_abort_did_not_see_fails_even_if_its_end_fires() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(2, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        work = be.all_reduce(buf, ReduceOp.SUM)  # the hot path
        read_on_stream(rt, buf, np.float32, be.comm_stream.ptr).get(timeout=10)  # its end has fired
        # An abort whose snapshot of the pending ops came before this one was queued:
        # only the flag is set when the sweep sees the op.
        be.ending.aborted = "planted abort"
        be.poll_pending()
        with pytest.raises(DistBackendError, match="planted abort"):
            work.wait()
    run_world(1, body, shutdown=False)


def test_the_sweep_completes_every_work_someone_can_see() -> None:
    """A finished Work only the backend's queue holds is dropped without being completed
    (nothing can tell); one the caller holds, or whose future or callback someone holds,
    is completed by the sweep."""
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(2, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        held, futures, called = [], [], []
        for i in range(2 * _hot.PRUNE_AT):
            w = be.all_reduce(buf, ReduceOp.MAX)
            if i % 5 == 0:
                held.append(w)
            elif i % 5 == 1:
                futures.append(w.get_future())
            elif i % 5 == 2:
                w._add_done_callback(lambda w, i=i: called.append(i))
            del w
        be.all_reduce(buf, ReduceOp.MAX).synchronize()
        while be.poll_pending() is not None:
            pass
        assert all(w._done._flag for w in held)  # completed by the sweep, not by looking
        assert all(f.done() and f.exception() is None for f in futures)
        assert called == list(range(2, 2 * _hot.PRUNE_AT, 5))
        assert not be.outstanding
    run_world(2, body)


def test_a_call_that_fails_on_the_hot_path_aborts_and_names_the_op() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> None:
        buf = dev(rt, np.ones(2, np.float32))
        be.all_reduce(buf, ReduceOp.SUM).synchronize()
        hot = next(iter(be._hot.values()))

        def broken(*args: Any) -> None:
            raise RuntimeError("planted: ncclInternalError")
        hot.call = broken
        with pytest.raises(DistBackendError, match=r"all_reduce on group 'g' failed: RuntimeError: planted") as err:
            be.all_reduce(buf, ReduceOp.SUM)
        assert err.value.__cause__ is not None and err.value.__cause__ is not err.value
        assert be.ending.aborted is not None and "failed while being issued" in be.ending.aborted
        assert buf in be.comm_stream.kept  # part of the op may be queued: its array outlives it
    run_world(1, body, shutdown=False)

"""The Work of an async all_reduce a group issues through a CuPy array's DeviceRun
(``hot.start_async``: the op on the communication stream, its Work of the backend's
``DeviceRunWork`` class, ``work.device_run_work_class``), on the fake GPU with CuPy's own
ndarray over the fake's memory: its ``wait()`` orders the caller's *current* stream
(looked up at ``wait()``, not at the op), ``is_completed()`` says what the GPU did, a
backend's abort fails ``wait()`` with an error naming the op, and each backend's Works
carry that backend's device, timeout and group. The fake runs each stream's work in
order only after what the stream was made to wait for, so a ``wait()`` that ordered
another stream than the caller's reads the rank's own values here."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._work import Work
from gpucoll.errors import DistBackendError

from _fake_cupy_costs import CupyOnFake, cupy_or_none
from _nccl_fake import FakeRuntime, read_on_stream
from _fake_gpu_world import dev, run_groups
from test_nccl_device_runs import _array, _put, _RankRuntime, cupy_fake  # noqa: F401 (cupy_fake: a fixture)

pytestmark = pytest.mark.skipif(cupy_or_none() is None, reason="CuPy is not installed")


def test_wait_orders_the_stream_current_at_wait_while_the_op_is_still_running(
        cupy_fake: CupyOnFake, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 issues the op through its run on the default stream, moves to another
    stream, calls ``wait()`` and queues a read on that stream, all before rank 1 has
    joined: the read must see the sum, so ``wait()`` made the stream current at that
    moment wait for the op. Then ``is_completed()`` is False until rank 1 joins, True
    after ``synchronize()``; and the same again on the default stream."""
    joined = [threading.Event(), threading.Event()]
    queued = [threading.Event(), threading.Event()]

    def body(pg: Any, rt: FakeRuntime, rank: int) -> list[str]:
        _RankRuntime.local.rt = rt
        size, bad = pg.size(), []
        base = np.arange(32, dtype=np.float32)
        x, buf = _array(cupy_fake, rt, base + rank)
        pg.all_reduce(x)   # plans the op and makes the array's run
        pg.all_reduce(x, async_op=True).wait()
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        backend = pg._nccl
        default = rt.current_stream()
        other = rt.new_stream()   # (held: a stream is destroyed with its object)
        for i, stream in enumerate((other.ptr, default)):
            _put(rt, buf, base * (i + 2) + rank)
            want = sum(base * (i + 2) + r for r in range(size))
            if rank == 0:
                work = pg.all_reduce(x, async_op=True)
                if type(work).__name__ != "DeviceRunWork" or not isinstance(work, Work):
                    bad.append(f"not the run's Work: {type(work)}")
                if (type(work)._device, type(work)._default_timeout, type(work)._owner) != \
                        (backend.device_index, backend.timeout, backend):
                    bad.append("the Work's class is not its backend's")
                rt.set_current_stream(stream)
                work.wait()
                got = read_on_stream(rt, buf, np.float32, stream)
                time.sleep(0.05)
                if work.is_completed():
                    bad.append(f"round {i}: complete before the peer joined")
                queued[i].set()
                if not np.array_equal(got.get(timeout=20), want):
                    bad.append(f"round {i}: the stream current at wait() read {got}, not the sum")
                work.synchronize()
                if not work.is_completed() or work.result() != [x] or work.seq != pg._issuer.seq:
                    bad.append(f"round {i}: {work.is_completed()} {work.result()} {work.seq}")
                rt.set_current_stream(default)
                joined[i].wait(20)
            else:
                queued[i].wait(20)
                pg.all_reduce(x, async_op=True).wait()
                if not np.array_equal(read_on_stream(rt, buf, np.float32).get(timeout=20), want):
                    bad.append(f"round {i}: rank 1 read a wrong sum")
                joined[i].set()
        return bad

    assert run_groups(2, body, monkeypatch) == [[], []]


def test_wait_after_the_backend_aborted_names_the_op(cupy_fake: CupyOnFake,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's async op through the run, pending (rank 1 never joins it) when its backend
    is aborted: ``wait()`` raises DistBackendError naming the op and the reason, and
    ``is_completed()`` is True, not a success."""
    done = threading.Event()

    def body(pg: Any, rt: FakeRuntime, rank: int) -> str:
        _RankRuntime.local.rt = rt
        x, buf = _array(cupy_fake, rt, np.ones(16, np.float32))
        pg.all_reduce(x)
        pg.all_reduce(x, async_op=True).wait()
        read_on_stream(rt, buf, np.float32).get(timeout=20)
        if rank == 1:
            done.wait(20)
            return ""
        try:
            work = pg.all_reduce(x, async_op=True)
            if type(work).__name__ != "DeviceRunWork" or work.is_completed():
                return f"not a pending run's Work: {type(work)} {work.is_completed()}"
            pg._nccl.abort("the test aborts it")
            try:
                work.wait()
            except DistBackendError as err:
                if not (work.is_completed() and not work.is_success()):
                    return "failed, but not completed as failed"
                return str(err)
            return "wait() returned"
        finally:
            done.set()

    first, second = run_groups(2, body, monkeypatch)
    assert second == "" and "all_reduce" in first and "the test aborts it" in first, first


def test_each_backend_has_its_own_work_class() -> None:
    """``hot.run_work_class`` makes one class per backend, op name, device and timeout,
    and hands the same one back after: its class attributes are that backend's."""
    from gpucoll._backends.nccl import hot
    from gpucoll._backends.nccl.stream import CommStream
    from gpucoll._backends.nccl.work import DeviceRunWork

    class _Owner:
        def __init__(self, timeout: float, device: int) -> None:
            self.runtime = object()
            self.ending = object()
            self.timeout = timeout
            self.device_index = device
            self.comm_stream = CommStream()

    a, b = _Owner(5.0, 0), _Owner(7.0, 1)
    ca, cb = hot.run_work_class(a, "all_reduce"), hot.run_work_class(b, "all_reduce")  # type: ignore[arg-type]
    assert ca is hot.run_work_class(a, "all_reduce") and ca is not cb  # type: ignore[arg-type]
    assert issubclass(ca, DeviceRunWork) and issubclass(cb, DeviceRunWork)
    assert (ca._owner, ca._device, ca._default_timeout, ca.op_type) == (a, 0, 5.0, "all_reduce")
    assert (cb._owner, cb._device, cb._default_timeout) == (b, 1, 7.0)

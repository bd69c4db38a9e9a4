"""Work.wait() on the CPU backend runs the ops queued up to its Work on the waiting thread
(rather than wake the backend's worker thread for them), but only when the wait may last
as long as the op: a shorter ``wait(timeout)`` returns at its own limit, leaving the op
queued.

The check takes the worker away (rank 0's backend starts and wakes no worker thread), so
only a waiter can run rank 0's op: without the helper its wait() would time out.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gpucoll.testing import run_spmd


def a_waiter_runs_the_queued_op() -> str:
    import gpucoll
    from gpucoll._collectives import _pg

    backend = _pg(None)._cpu
    r, w = gpucoll.get_rank(), gpucoll.get_world_size()
    want = np.full(1 << 20, w * (w + 1) / 2, np.float32)
    x = np.full(1 << 20, r + 1, np.float32)  # 4 MiB: an async op of this size is queued, not run inline
    y = np.full(1 << 20, r + 1, np.float32)
    gpucoll.barrier()
    if r == 0:
        backend._start_worker = lambda: None  # no worker thread runs anything queued from here on
        try:
            work = gpucoll.all_reduce(x, async_op=True)
            second = gpucoll.all_reduce(y, async_op=True)  # queued behind the first
            assert work is not None and second is not None
            assert not work.is_completed()
            t0 = time.monotonic()
            with pytest.raises(gpucoll.DistBackendError, match="did not complete within 0.3 s"):
                work.wait(timeout=0.3)  # shorter than the op may take: not run on this thread
            assert time.monotonic() - t0 < 2.0
            assert not work.is_completed()
            second.wait()  # runs both, in issue order, here
            assert work.is_completed()
            work.wait()
        finally:
            del backend._start_worker
    else:
        time.sleep(1.0)
        gpucoll.all_reduce(x)
        gpucoll.all_reduce(y)
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, want)
    gpucoll.barrier()
    return "ok"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_waiter_runs_the_ops_queued_up_to_its_work(world_size: int) -> None:
    assert run_spmd(a_waiter_runs_the_queued_op, world_size, timeout=90, pg_timeout=8) == ["ok"] * world_size


def a_futures_wait_runs_the_queued_op() -> str:
    """torch's ``work.get_future().then(cb)``: ``fut.wait()`` waits as ``Work.wait()`` does
    (here: it runs the queued op), the callback runs when the op completes, and the
    chained future holds its value."""
    import threading

    import gpucoll
    from gpucoll._collectives import _pg
    from gpucoll.futures import Future

    backend = _pg(None)._cpu
    r, w = gpucoll.get_rank(), gpucoll.get_world_size()
    x = np.full(1 << 20, r + 1, np.float32)
    gpucoll.barrier()
    if r == 0:
        backend._start_worker = lambda: None
        try:
            work = gpucoll.all_reduce(x, async_op=True)
            assert work is not None
            fut = work.get_future()
            assert isinstance(fut, Future) and fut is work.get_future()
            ran_on: list[str] = []

            def first_sum(f: Future) -> float:
                ran_on.append(threading.current_thread().name)
                return float(f.value()[0][0])

            chained = fut.then(first_sum)
            assert not fut.done() and not chained.done() and ran_on == []
            out = fut.wait()
            assert out[0] is x and fut.value()[0] is x
            assert chained.done() and chained.value() == w * (w + 1) / 2
            assert ran_on == [threading.current_thread().name]
        finally:
            del backend._start_worker
    else:
        time.sleep(0.5)
        gpucoll.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(1 << 20, w * (w + 1) / 2, np.float32))
    gpucoll.barrier()
    return "ok"


def test_a_futures_wait_runs_the_queued_op_and_its_callbacks() -> None:
    assert run_spmd(a_futures_wait_runs_the_queued_op, 3, timeout=90, pg_timeout=8) == ["ok"] * 3

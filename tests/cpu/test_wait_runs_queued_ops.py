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

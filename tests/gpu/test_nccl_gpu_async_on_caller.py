"""A small async all_reduce on the caller's stream (GPUCOLL_NCCL_CALLER_STREAM_MAX), and
a repeated one through the group's DeviceRun, at world 2 on one GPU: the values every
rank reduced, read by a kernel on the stream the op ran on and by one on another stream
that ``wait()`` made wait; the same with the limit at 0 (the communication stream).
tests/nccl/test_nccl_async_on_caller.py and test_nccl_device_runs.py are these checks
on the fake GPU."""

from __future__ import annotations

from typing import Any

import pytest

from _gpu_two_ranks import TWO_RANKS_ENV, why_not_two_ranks_on_one_gpu

from gpucoll._env import NCCL_CALLER_STREAM_MAX_ENV
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

_WHY_NOT_TWO = why_not_two_ranks_on_one_gpu()


def _body() -> dict[str, Any]:
    import cupy

    import gpucoll

    gpucoll.init_process_group("nccl", device_id=0, timeout=60)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {}
    x = cupy.zeros(256, dtype=cupy.float32)
    other = cupy.cuda.Stream(non_blocking=True)
    for i in range(6):  # the first plans the op; the rest go through the array's DeviceRun
        x.fill(r + 1.0 + i)
        work = gpucoll.all_reduce(x, async_op=True)
        if i % 2:
            with other:  # another stream: wait() makes it wait for the op
                work.wait()
                y = x * 1
            other.synchronize()
        else:
            work.wait()
            y = x * 1
        want = float(sum(k + 1.0 + i for k in range(n)))
        got = cupy.asnumpy(y)
        out[f"round {i}"] = ([float(got.min()), float(got.max())], [want, want])
        work.synchronize()
        out[f"round {i} completed"] = (work.is_completed(), True)
    x.fill(r + 1.0)
    gpucoll.all_reduce(x)  # synchronous, through the run
    out["sync"] = (float(cupy.asnumpy(x)[0]), float(sum(k + 1.0 for k in range(n))))
    cupy.cuda.get_current_stream().synchronize()
    gpucoll.destroy_process_group()
    return out


@pytest.mark.skipif(_WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO))
@pytest.mark.parametrize("limit", ["65536", None], ids=["caller-stream", "communication-stream"])
def test_small_async_all_reduces_are_ordered_where_they_ran_and_where_wait_was_called(limit: str | None) -> None:
    env = {**TWO_RANKS_ENV, **({NCCL_CALLER_STREAM_MAX_ENV: limit} if limit is not None else {})}
    results = run_spmd(_body, world_size=2, init=False, backend="nccl", env=env, start_method="spawn", timeout=300)
    for rank, cells in enumerate(results):
        for name, (got, want) in cells.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"

"""The communicator from several roots (ncclCommInitRankScalable, a RawComm driven
through the ctypes shim) on a real GPU: every rank a root (GPUCOLL_NCCL_RANKS_PER_ROOT=1,
threshold 1), then each kind of op the plan steps issue, checked against NumPy.
World size 1, and 2 on the one GPU where NCCL >= 2.30 allows it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll._env import NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", NCCL_SCALABLE_INIT_ENV: "1",
       NCCL_RANKS_PER_ROOT_ENV: "1"}


def _two_ok() -> str | None:
    try:
        from gpucoll._backends.nccl.backend import nccl_version

        version = nccl_version()
    except Exception as exc:
        return f"NCCL not loadable: {exc}"
    return None if version >= (2, 30, 0) else "two ranks on one GPU need NCCL >= 2.30"


_WHY_NOT_TWO = _two_ok()


def _body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll._world import default_group

    gpucoll.init_process_group("nccl", device_id=0, timeout=120)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {"comm": type(default_group()._nccl._comm).__name__}
    x = cupy.arange(6, dtype=cupy.float32) + r
    gpucoll.all_reduce(x)
    out["all_reduce"] = (cupy.asnumpy(x).tolist(), (np.arange(6) * n + sum(range(n))).tolist())
    y = cupy.full(4, r + 1, dtype=cupy.int32)
    gpucoll.broadcast(y, src=n - 1)
    out["broadcast"] = (cupy.asnumpy(y).tolist(), [n] * 4)
    outs = [cupy.empty(3, dtype=cupy.float64) for _ in range(n)]
    gpucoll.all_gather(outs, cupy.full(3, float(r), dtype=cupy.float64))
    out["all_gather"] = ([cupy.asnumpy(o).tolist() for o in outs], [[float(i)] * 3 for i in range(n)])
    z = cupy.full(2, r + 1.0, dtype=cupy.float32)
    gpucoll.reduce(z, dst=0)
    if r == 0:
        out["reduce"] = (cupy.asnumpy(z).tolist(), [float(sum(range(1, n + 1)))] * 2)
    if n > 1:
        got = cupy.zeros(5, dtype=cupy.float32)
        works = [gpucoll.isend(cupy.full(5, r + 10.0, dtype=cupy.float32), (r + 1) % n),
                 gpucoll.irecv(got, (r - 1) % n)]
        for w in works:
            w.wait()
        out["send_recv"] = (cupy.asnumpy(got).tolist(), [(r - 1) % n + 10.0] * 5)
    cupy.cuda.get_current_stream().synchronize()
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=pytest.mark.skipif(
    _WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO)))])
def test_a_scalable_communicator_runs_every_kind_of_op(size: int) -> None:
    results = run_spmd(_body, world_size=size, init=False, backend="nccl", env=ENV, start_method="spawn",
                       timeout=600)
    for rank, cells in enumerate(results):
        assert cells.pop("comm") == "RawComm", f"rank {rank} did not take the scalable path"
        for name, (got, want) in cells.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"

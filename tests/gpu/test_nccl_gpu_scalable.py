"""The communicator from several roots (ncclCommInitRankScalable, a RawComm driven
through the ctypes shim) on a real GPU: every rank a root (GPUCOLL_NCCL_RANKS_PER_ROOT=1,
threshold 1), then each kind of op the plan steps issue, checked against NumPy.
World size 1, and 2 on the one GPU where NCCL >= 2.30 allows it."""

from __future__ import annotations

from typing import Any

import pytest

from _gpu_two_ranks import why_not_two_ranks_on_one_gpu

from _shared_bodies import check_scalable_ops, scalable_ops_body

from gpucoll._env import NCCL_RANKS_PER_ROOT_ENV, NCCL_SCALABLE_INIT_ENV
from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0", NCCL_SCALABLE_INIT_ENV: "1",
       NCCL_RANKS_PER_ROOT_ENV: "1"}


_WHY_NOT_TWO = why_not_two_ranks_on_one_gpu()


def _body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll._world import default_group

    gpucoll.init_process_group("nccl", device_id=0, timeout=120)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out = scalable_ops_body(r, n, cupy.asarray, lambda a: cupy.asnumpy(a).tolist())
    out["comm"] = type(default_group()._nccl._comm).__name__
    cupy.cuda.get_current_stream().synchronize()
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", [1, pytest.param(2, marks=pytest.mark.skipif(
    _WHY_NOT_TWO is not None, reason=str(_WHY_NOT_TWO)))])
def test_a_scalable_communicator_runs_every_kind_of_op(size: int) -> None:
    results = run_spmd(_body, world_size=size, init=False, backend="nccl", env=ENV, start_method="spawn",
                       timeout=600)
    # The same body and checks run on the fake GPU in CI
    # (tests/nccl/test_nccl_scalable_init.py::test_the_gpu_suites_scalable_body_on_the_fake_gpu).
    check_scalable_ops(results)

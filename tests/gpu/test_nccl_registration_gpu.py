"""Buffer registration and the NCCL memory pool on a real GPU (``pytest -m gpu``): world 1,
and world 2 on the one GPU where the loaded NCCL is 2.30 or newer. The same rules as the
fake GPU's (tests/nccl/test_nccl_registration.py), met by NCCL itself."""

from __future__ import annotations

from typing import Any

import pytest

from _gpu_two_ranks import TWO_RANKS_ENV, why_not_two_ranks_on_one_gpu

from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu

ENV = TWO_RANKS_ENV
_WHY = why_not_two_ranks_on_one_gpu()
SIZES = [1, pytest.param(2, marks=pytest.mark.skipif(_WHY is not None, reason=str(_WHY)))]


def _body() -> dict[str, Any]:
    import cupy

    import gpucoll
    from gpucoll._backends.nccl.backend import nccl_version

    gpucoll.init_process_group("nccl", device_id=0, timeout=120.0)
    pg = gpucoll.group.WORLD
    n = gpucoll.get_world_size()
    out: dict[str, Any] = {"version": nccl_version()}
    pool = gpucoll.nccl_mem_pool()
    with cupy.cuda.using_allocator(pool.malloc):
        x = cupy.ones(1 << 20, cupy.float32)
    out["segments"] = len(pool.segments())
    h = pg.register_buffer(x)
    gpucoll.all_reduce(x)
    out["local_sum"] = float(x[-1].get())
    pg.deregister_buffer(h)
    if out["version"] >= (2, 27, 0):
        w = pg.register_buffer(x, symmetric=True)
        x.fill(1)
        gpucoll.all_reduce(x)
        out["window_sum"] = float(x[-1].get())
        pg.deregister_buffer(w)
        plain = cupy.ones(1 << 20, cupy.float32)  # cudaMalloc: not a window
        try:
            pg.register_buffer(plain, symmetric=True)
            out["plain"] = "registered"
        except gpucoll.RegistrationError as exc:
            out["plain"] = str(exc)
    pg.register_mem_pool(pool)
    with cupy.cuda.using_allocator(pool.malloc):
        y = cupy.ones(4 << 20, cupy.float32)
    gpucoll.all_reduce(y)
    out["pool_sum"] = float(y[0].get())
    pg.deregister_mem_pool(pool)
    del x, y
    pool.free_all_blocks()
    out["n"] = n
    gpucoll.destroy_process_group()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_registration_and_pool(size: int) -> None:
    for out in run_spmd(_body, world_size=size, init=False, backend="nccl", env=ENV, start_method="spawn",
                        timeout=600.0):
        assert out["segments"] >= 1
        assert out["local_sum"] == out["pool_sum"] == float(size)
        if out["version"] >= (2, 27, 0):
            assert out["window_sum"] == float(size)
            assert "not from ncclMemAlloc" in out["plain"], out["plain"]

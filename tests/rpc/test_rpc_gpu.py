"""Device arrays over RPC with a device map (GPU only): a CuPy array arrives on the mapped
device as a CuPy array with the same values, and the reply comes back on the caller's
device through the inverse map."""

from __future__ import annotations

import os
from typing import Any

import pytest

from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu


def where(x: Any) -> tuple[str, int, list[float]]:
    return type(x).__module__.split(".")[0], int(x.device.id), x.get().tolist()


def double(x: Any) -> Any:
    return x * 2


def gpu_checks() -> dict[str, Any]:
    import cupy

    import gpucoll.rpc as rpc

    rank = int(os.environ["RANK"])
    opts = rpc.TensorPipeRpcBackendOptions()
    opts.set_device_map(f"worker{1 - rank}", {0: 0})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    out = {}
    with cupy.cuda.Device(0):
        x = cupy.arange(4, dtype=cupy.float32)
        out["there"] = rpc.rpc_sync(f"worker{1 - rank}", where, args=(x,))
        back = rpc.rpc_sync(f"worker{1 - rank}", double, args=(x,))
        out["back"] = (type(back).__module__.split(".")[0], int(back.device.id), back.get().tolist())
    rpc.shutdown()
    return out


def test_cupy_arrays_follow_the_device_map() -> None:
    for out in run_spmd(gpu_checks, 2, init=False, timeout=120):
        assert out["there"] == ("cupy", 0, [0.0, 1.0, 2.0, 3.0])
        assert out["back"] == ("cupy", 0, [0.0, 2.0, 4.0, 6.0])

"""shrink_group on NCCL groups, on the fake GPU (tests/_nccl_fake.py): with
ncclCommShrink where the loaded NCCL has it (>= 2.27), a fresh communicator through
the store otherwise; rank 3 plays the dead rank by never calling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._backends.nccl.lib import Features

from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds

WITH_SHRINK = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True, comm_shrink=True)
WITHOUT_SHRINK = Features(version=(2, 26, 0), all_to_all=False, gather=False, scatter=False, comm_shrink=False)


def _body(exclude: list[int] | None):
    def body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
        x = FakeDeviceArray(rt, np.full(4, rank + 1, np.float32))
        gpucoll.all_reduce(x)
        out: dict[str, Any] = {"before": float(x.get()[0])}
        if rank == 3:
            return out  # "dies": never takes part again
        old_comm = w._world().default._nccl._comm
        pg = gpucoll.shrink_group(exclude, timeout=1.0)
        try:
            y = FakeDeviceArray(rt, np.full(4, rank + 1, np.float32))
            gpucoll.all_reduce(y)
            h = np.array([rank + 1.0])
            gpucoll.all_reduce(h)  # host arrays: the new group's CPU backend
            out.update(after=float(y.get()[0]), host=float(h[0]), rank=pg.rank(), size=pg.size(),
                       shrunk_by_nccl=b"/shrink" in pg._nccl._comm.world.uid,
                       old_shrink_calls=list(old_comm.shrink_calls), default=w._world().default is pg)
            sub = gpucoll.new_group([0, 1])  # a group split from the shrunk one
            if sub is not gpucoll.GroupMember.NON_GROUP_MEMBER:
                z = FakeDeviceArray(rt, np.full(2, rank + 1, np.float32))
                gpucoll.all_reduce(z, group=sub)
                out["sub"] = float(z.get()[0])
            return out
        finally:
            for g in w._world().groups:
                g._destroy()
            pg._destroy()
    return body


@pytest.mark.parametrize("features, exclude", [(WITH_SHRINK, [3]), (WITH_SHRINK, None), (WITHOUT_SHRINK, [3]),
                                               (WITHOUT_SHRINK, None)],
                         ids=["ncclCommShrink-known", "ncclCommShrink-agreed", "fresh-comm-known",
                              "fresh-comm-agreed"])
def test_an_nccl_group_shrinks_without_the_rank_that_stopped(monkeypatch: pytest.MonkeyPatch, features: Features,
                                                              exclude: list[int] | None) -> None:
    results = run_fake_gpu_worlds(4, _body(exclude), monkeypatch, features=features)
    assert all(r["before"] == 10.0 for r in results)
    for rank in range(3):
        got = results[rank]
        assert (got["after"], got["host"], got["rank"], got["size"]) == (6.0, 6.0, rank, 3)
        assert got["default"]
        assert got["shrunk_by_nccl"] is features.comm_shrink
        assert got["old_shrink_calls"] == ([((3,), 1)] if features.comm_shrink else [])  # NCCL_SHRINK_ABORT
    assert results[0]["sub"] == results[1]["sub"] == 3.0 and "sub" not in results[2]


def test_the_shim_binds_ncclCommShrink_as_the_wheels_nccl_h_declares_it() -> None:
    import ctypes
    import re
    from pathlib import Path

    spec_root = pytest.importorskip("nvidia.nccl", reason="the nvidia-nccl-cu12 wheel brings nccl.h and libnccl")
    base = Path(list(spec_root.__path__)[0])
    header, libs = base / "include" / "nccl.h", sorted((base / "lib").glob("libnccl.so*"))
    if not header.exists() or not libs:
        pytest.skip("the NCCL wheel has no nccl.h or libnccl here")
    from gpucoll._backends.nccl.lib import NcclShim

    proto = re.search(r"ncclResult_t\s+ncclCommShrink\(([^)]*)\)", header.read_text())
    assert proto is not None
    c_types = {"ncclComm_t": ctypes.c_void_p, "int*": ctypes.POINTER(ctypes.c_int), "int": ctypes.c_int,
               "ncclComm_t*": ctypes.POINTER(ctypes.c_void_p), "ncclConfig_t*": ctypes.c_void_p}
    declared = [c_types[" ".join(p.split()[:-1]).replace(" *", "*")] for p in proto.group(1).split(",")]
    shim = NcclShim(str(libs[0]))
    assert shim.comm_shrink_fn is not None
    assert list(shim.comm_shrink_fn.argtypes) == declared and shim.comm_shrink_fn.restype is ctypes.c_int

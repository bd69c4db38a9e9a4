"""Rank threads that each hold a default group (backend "nccl") on the fake GPU of
tests/_nccl_fake.py, so that the world API (new_group, split_group, DeviceMesh) runs
as in a job without a GPU."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any, Callable

import numpy as np
import pytest

from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll.store import HashStore, PrefixStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _nccl_fake import FakeFabric, FakeRuntime, device_array, read_on_stream  # noqa: E402

from gpucoll._buffer import DTYPES  # noqa: E402


class FakeDeviceArray:
    """A device array in fake memory, published through __cuda_array_interface__."""

    class _Device:
        id = 0

    def __init__(self, rt: FakeRuntime, host: np.ndarray) -> None:
        self.rt = rt
        self.buf = device_array(rt, host, DTYPES[host.dtype.name])
        self.dtype = host.dtype
        self.device = self._Device()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.buf.shape, "typestr": self.dtype.str, "data": (self.buf.ptr, False),
                "version": 3, "strides": None, "stream": None}

    def get(self) -> np.ndarray:
        """The contents as the caller's stream sees them."""
        return read_on_stream(self.rt, self.buf, self.dtype).get(timeout=10)


def run_fake_gpu_worlds(size: int, body: Callable[[Any, FakeRuntime, int], Any], monkeypatch: pytest.MonkeyPatch,
                        *, timeout: float = 10.0, **runtime_kw: Any) -> list[Any]:
    """Run ``body(world_module, runtime, rank)`` on ``size`` threads named ``rank<N>``, each
    with its own default group; fail with every rank's traceback, or if one hangs."""
    from gpucoll._group import registry as group_mod
    from gpucoll import _world as world_mod
    from gpucoll._group import ProcessGroup

    fabric = FakeFabric(hang_limit=30.0)
    store = HashStore(timeout=30.0)
    runtimes: dict[int, FakeRuntime] = {}
    local = threading.local()
    made: list[dict[str, Any]] = []

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None, **kw: Any) -> NCCLBackend:
        made.append({"group": group_name, **kw})
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[int(threading.current_thread().name[4:])], **kw)
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)
    monkeypatch.setattr(world_mod, "_world", lambda: local.world)
    monkeypatch.setattr(world_mod, "default_group", lambda: local.world.default)

    results: list[Any] = [None] * size
    errors: list[str | None] = [None] * size

    def main(rank: int) -> None:
        try:
            runtimes[rank] = FakeRuntime(fabric, **runtime_kw)
            pg = ProcessGroup(PrefixStore("pg/default", store), rank, size, group_name="default",
                              global_ranks=range(size), timeout=timeout, backend="nccl", device_id=0)
            local.world = world_mod._World(store, False, pg, "nccl", timeout, 0)
            try:
                results[rank] = body(world_mod, runtimes[rank], rank)
            finally:
                for g in [*local.world.groups, pg]:
                    g._destroy()
        except BaseException:
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=main, args=(r,), name=f"rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    fabric.close()
    assert not any(t.is_alive() for t in threads), "a rank hung"
    failed = [f"--- rank {r} ---\n{e}" for r, e in enumerate(errors) if e]
    assert not failed, "\n".join(failed)
    return results


def split_made(pg: Any) -> bool:
    """True when the group's communicator came from ncclCommSplit (the fake names split worlds so)."""
    return b"/split" in pg._nccl._comm.world.uid

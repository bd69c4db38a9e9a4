"""The fake-GPU harness of the NCCL tests: rank threads sharing one fake GPU
(tests/_nccl_fake.py) that each run a raw NCCLBackend (run_world), a ProcessGroup
(run_groups) or a whole default group with the world API (run_fake_gpu_worlds), so that
new_group, split_group and DeviceMesh run as in a job without a GPU."""

from __future__ import annotations

import threading
import traceback
from typing import Any, Callable

import numpy as np
import pytest

from gpucoll._buffer import DTYPES, Buffer
from gpucoll._backends.nccl.backend import NCCLBackend, nccl_unavailable_reason
from gpucoll._backends.nccl.lib import Features
from gpucoll.store import HashStore, PrefixStore

from _nccl_fake import FakeFabric, FakeRuntime, device_array, read_on_stream


def has_gpu() -> bool:
    """Whether a usable GPU is here (tests that need its absence skip then)."""
    return nccl_unavailable_reason() is None


DEFAULT_FEATURES = Features(version=(2, 32, 3), all_to_all=True, gather=True, scatter=True, register=True,
                            window=True)
OLD_FEATURES = Features(version=(2, 19, 3), avg=True, premul_sum=False, fp8=False, comm_split=True)


def run_rank_threads(size: int, main: Callable[[int], Any], fabric: FakeFabric) -> list[Any]:
    """Run ``main(rank)`` on ``size`` threads named ``rank<N>``; fail with every rank's
    traceback if any raised, or if one is still running after 120 s (a hang)."""
    results: list[Any] = [None] * size
    errors: list[str | None] = [None] * size

    def wrapped(rank: int) -> None:
        try:
            results[rank] = main(rank)
        except BaseException:
            errors[rank] = traceback.format_exc()

    threads = [threading.Thread(target=wrapped, args=(r,), name=f"rank{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    fabric.close()
    assert not any(t.is_alive() for t in threads), "a rank hung"
    failed = [f"--- rank {r} ---\n{e}" for r, e in enumerate(errors) if e]
    assert not failed, "\n".join(failed)
    return results


def run_world(size: int, body: Callable[[NCCLBackend, FakeRuntime, int], Any], *,
              features: Features = DEFAULT_FEATURES, cc: tuple[int, int] = (9, 0), timeout: float = 10.0,
              eager: bool = True, hang: float = 20.0, op_delay: float = 0.0,
              shutdown: bool = True, devices: int = 1, device_of: Callable[[int], int] = lambda r: 0,
              use_device: bool = False, strict_contexts: bool = False) -> list[Any]:
    """Run ``body(backend, runtime, rank)`` on ``size`` rank threads sharing one fake GPU
    machine of ``devices`` GPUs; rank r's communicator is on ``device_of(r)``.

    ``use_device``: each rank thread makes its device current first (as a script's
    ``cupy.cuda.Device(d).use()``); otherwise its current device stays CUDA's 0.
    ``strict_contexts``: a CUDA context on a device no rank uses is an error.
    """
    gpus = {device_of(r) for r in range(size)}
    fabric = FakeFabric(hang_limit=hang, gpus=gpus if strict_contexts else None)
    store = HashStore(timeout=timeout)

    def main(rank: int) -> Any:
        if use_device:
            fabric.use_device(device_of(rank))
        rt = FakeRuntime(fabric, features=features, cc=cc, op_delay=op_delay, devices=devices)
        be = NCCLBackend(PrefixStore("pg/g", store), rank, size, timeout=timeout, group_name="g",
                         device_id=device_of(rank) if eager else None, _runtime=rt)
        try:
            return body(be, rt, rank)
        finally:
            if shutdown:
                be.shutdown()

    results = run_rank_threads(size, main, fabric)
    assert not fabric.errors, fabric.errors
    return results


def dev(rt: FakeRuntime, values: np.ndarray, name: str | None = None, device: int | None = None) -> Buffer:
    return device_array(rt, values, DTYPES[name or values.dtype.name], device=device)


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


def run_groups(size: int, body: Callable[[Any, FakeRuntime, int], Any], monkeypatch: pytest.MonkeyPatch,
               *, timeout: float = 10.0) -> list[Any]:
    """Run ``body(process_group, runtime, rank)`` on rank threads; the group's NCCL backend
    runs on the fake GPU."""
    from gpucoll._group import registry as group_mod
    from gpucoll._group import ProcessGroup

    fabric = FakeFabric(hang_limit=30.0)
    store = HashStore(timeout=30.0)
    runtimes: dict[int, FakeRuntime] = {}

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[rank])
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)

    def main(rank: int) -> Any:
        runtimes[rank] = FakeRuntime(fabric)
        pg = ProcessGroup(PrefixStore("pg/g", store), rank, size, group_name="g",
                          global_ranks=range(size), timeout=timeout, backend="nccl", device_id=0)
        try:
            return body(pg, runtimes[rank], rank)
        finally:
            pg._destroy()

    return run_rank_threads(size, main, fabric)


def run_fake_gpu_worlds(size: int, body: Callable[[Any, FakeRuntime, int], Any], monkeypatch: pytest.MonkeyPatch,
                        *, features: Features = DEFAULT_FEATURES, eager: bool = True, timeout: float = 10.0,
                        fabric_kw: dict[str, Any] | None = None, **runtime_kw: Any) -> list[Any]:
    """Run ``body(world_module, runtime, rank)`` on rank threads, each with its own default
    group (backend "nccl", on the fake GPU), so that new_group and split_group run as in
    a job. The world slot is made per thread for the test. ``fabric_kw``: FakeFabric's
    keywords (``eager_bytes=0``: every send waits for its receive, NCCL's contract)."""
    from gpucoll._group import registry as group_mod
    from gpucoll import _world as world_mod
    from gpucoll._group import ProcessGroup

    fabric = FakeFabric(**{"hang_limit": 30.0, **(fabric_kw or {})})
    store = HashStore(timeout=30.0)
    runtimes: dict[int, FakeRuntime] = {}
    local = threading.local()

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None, **kw: Any) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[int(threading.current_thread().name[4:])], **kw)
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)
    monkeypatch.setattr(world_mod, "_world", lambda: local.world)
    monkeypatch.setattr(world_mod, "default_group", lambda: local.world.default)

    def main(rank: int) -> Any:
        runtimes[rank] = FakeRuntime(fabric, features=features, **runtime_kw)
        device = 0 if eager else None
        pg = ProcessGroup(PrefixStore("pg/default", store), rank, size, group_name="default",
                          global_ranks=range(size), timeout=timeout, backend="nccl", device_id=device,
                          group_desc="default_pg")  # as init_process_group names it
        local.world = world_mod._World(store, False, pg, "nccl", timeout, device)
        try:
            return body(world_mod, runtimes[rank], rank)
        finally:
            for g in [*local.world.groups, pg]:
                g._destroy()

    return run_rank_threads(size, main, fabric)


def split_made(pg: Any) -> bool:
    """True when the group's communicator came from ncclCommSplit (the fake names split worlds so)."""
    return b"/split" in pg._nccl._comm.world.uid

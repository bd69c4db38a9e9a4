"""Buffer registration and the NCCL memory pool on the fake GPU, which knows NCCL's rules
(tests/_nccl_fake.py: ncclCommRegister takes any device memory, ncclCommWindowRegister is
collective and needs ncclMemAlloc memory, 4096-aligned, the same size on every rank;
ncclMemFree of registered memory is a misuse): ProcessGroup.register_buffer /
deregister_buffer, symmetric windows, register_mem_pool / deregister_mem_pool, and the
named errors every rank raises for a misuse."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll._backends.nccl.lib import Features
from gpucoll._backends.nccl.mempool import NcclMemPool
from gpucoll.errors import RegistrationError

from _fake_gpu_world import run_fake_gpu_worlds
from _nccl_fake import FakeError, FakeRuntime

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class _Arr:
    """A float32 device array over fake memory at ``ptr`` (a pool segment or a plain block)."""

    def __init__(self, rt: FakeRuntime, ptr: int, count: int) -> None:
        self.rt, self.ptr, self.count = rt, ptr, count
        self.nd = rt.fabric.mem.view(ptr, count * 4).view(np.float32)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.count,), "typestr": "<f4", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": self.rt.current_stream()}

    def sub(self, start: int, count: int) -> _Arr:
        return _Arr(self.rt, self.ptr + 4 * start, count)

    def read(self) -> np.ndarray:
        import queue

        done: queue.Queue[int] = queue.Queue()
        self.rt._stream(self.rt.current_stream()).enqueue(lambda: done.put(1))
        done.get(timeout=20)
        return self.nd.copy()


def _plain(rt: FakeRuntime, count: int) -> _Arr:
    block = rt.fabric.mem.alloc(count * 4)
    arr = _Arr(rt, block.ptr, count)
    arr.block = block  # type: ignore[attr-defined]  # keeps it alive
    return arr


def _error(fn: Any) -> str:
    with pytest.raises(RegistrationError) as info:
        fn()
    return str(info.value)


def test_register_windows_and_pools_follow_nccl_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(world: Any, rt: FakeRuntime, rank: int) -> dict[str, Any]:
        pg = world.default_group()
        comm = pg._nccl._comm
        pool = NcclMemPool(_runtime=rt)
        seg = pool.allocate(1 << 16)
        arr = _Arr(rt, seg, 1 << 14)
        out: dict[str, Any] = {}

        # local registration: any device memory; deregistration frees the handle
        h = pg.register_buffer(arr)
        assert h.active and not h.symmetric and h.nbytes == 1 << 16 and h.device == "cuda:0"
        assert len(comm.registered) == 1
        pg.deregister_buffer(h)
        assert not comm.registered and not h.active
        out["twice"] = _error(lambda: pg.deregister_buffer(h))
        plain = _plain(rt, 1024)
        hp = pg.register_buffer(plain)  # ncclCommRegister takes cudaMalloc memory too
        pg.deregister_buffer(hp)

        # a symmetric window on pool memory; a collective on it sums correctly
        hw = pg.register_buffer(arr, symmetric=True)
        assert hw.symmetric and len(comm.windows) == 1
        arr.nd[:] = rank + 1
        pg.all_reduce(arr)
        out["sum"] = float(arr.read()[-1])
        pg.deregister_buffer(hw)
        assert not comm.windows

        # misuse: every rank gets the same named error, nobody hangs in NCCL
        mixed = arr if rank == 0 else _plain(rt, 1 << 14)
        out["not_pool"] = _error(lambda: pg.register_buffer(mixed, symmetric=True))
        out["sizes"] = _error(lambda: pg.register_buffer(arr.sub(0, 1024 * (rank + 1)), symmetric=True))
        out["aligned"] = _error(lambda: pg.register_buffer(arr.sub(1, 1024), symmetric=True))
        assert not comm.windows

        # host memory: the CPU backend's no-op handle
        hh = pg.register_buffer(np.zeros(8, np.float32), symmetric=True)
        assert hh.device == "cpu" and hh.active
        pg.deregister_buffer(hh)

        # a pool: present and future segments registered, each deregistered before ncclMemFree
        pg.register_mem_pool(pool)
        assert sorted(p for p, _ in comm.registered.values()) == [seg]
        out["again"] = _error(lambda: pg.register_mem_pool(pool))
        seg2 = pool.allocate(3 << 20)
        assert sorted(p for p, _ in comm.registered.values()) == sorted([seg, seg2])
        pool.free(seg2)  # no "freed while registered" error: the group let go first
        assert [p for p, _ in comm.registered.values()] == [seg]
        pg.deregister_mem_pool(pool)
        assert not comm.registered
        pool.allocate(1 << 10)
        assert not comm.registered  # no longer watched
        out["not_registered"] = _error(lambda: pg.deregister_mem_pool(pool))
        with pytest.raises(TypeError, match="gpucoll.nccl_mem_pool"):
            pg.register_mem_pool(object())
        for ptr, _, _ in pool.segments():
            pool.free(ptr)
        return out

    res = run_fake_gpu_worlds(2, body, monkeypatch)
    for r in res:
        assert r["sum"] == 3.0
        assert "deregistered already" in r["twice"]
        assert "rank(s) [1] passed memory that is not from ncclMemAlloc" in r["not_pool"]
        assert "sizes differ between ranks" in r["sizes"] and "rank 0 4096 B, rank 1 8192 B" in r["sizes"]
        assert "4096-byte aligned" in r["aligned"] and "rank(s) [0, 1]" in r["aligned"]
        assert "registered with group" in r["again"] and "not registered" in r["not_registered"]
    # the same conditions named on every rank (each names its own buffer first)
    for key in ("not_pool", "sizes", "aligned"):
        assert res[0][key].split("): ", 1)[1] == res[1][key].split("): ", 1)[1]


def test_the_fake_refuses_what_nccl_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake's own rules, met by calling NCCL's entry points directly (past gpucoll's checks)."""
    def body(world: Any, rt: FakeRuntime, rank: int) -> list[str]:
        comm = world.default_group()._nccl._comm
        seen = []
        plain = _plain(rt, 1024)
        with pytest.raises(FakeError, match="not cuMem memory"):
            comm.window_register(plain.ptr, 4096, 1)
        seg = rt.mem_alloc(4096)
        with pytest.raises(FakeError, match="suitably aligned"):
            comm.window_register(seg + 8, 1024, 1)
        with pytest.raises(FakeError, match="Could not find handle"):
            comm.deregister(12345)
        h = comm.register(seg, 4096)
        with pytest.raises(FakeError, match="while registered") as info:
            rt.mem_free(seg)
        seen.append(str(info.value))
        rt.fabric.errors.remove(str(info.value))
        comm.deregister(h)
        rt.mem_free(seg)
        with pytest.raises(FakeError, match="not from ncclMemAlloc"):
            rt.mem_free(plain.ptr)
        return seen

    assert all(len(r) == 1 for r in run_fake_gpu_worlds(2, body, monkeypatch))


def test_old_nccl_refuses_windows_by_version(monkeypatch: pytest.MonkeyPatch) -> None:
    old = Features(version=(2, 26, 2), all_to_all=False, gather=False, scatter=False, register=True, window=False)

    def body(world: Any, rt: FakeRuntime, rank: int) -> str:
        pg = world.default_group()
        arr = _Arr(rt, NcclMemPool(_runtime=rt).allocate(4096), 1024)
        h = pg.register_buffer(arr)  # local registration is there since 2.19
        pg.deregister_buffer(h)
        return _error(lambda: pg.register_buffer(arr, symmetric=True))

    for msg in run_fake_gpu_worlds(2, body, monkeypatch, features=old):
        assert "needs ncclCommWindowRegister (NCCL >= 2.27); this is NCCL 2.26.2" in msg


def test_the_public_pool_needs_nccl_here() -> None:
    from gpucoll._backends.nccl.lib import unavailable_reason

    if unavailable_reason() is None:
        pytest.skip("NCCL is usable here")
    pool = gpucoll.nccl_mem_pool()
    assert isinstance(pool, gpucoll.NcclMemPool) and pool.segments() == [] and pool.total_bytes() == 0
    with pytest.raises(gpucoll.BackendUnavailableError, match="NCCL memory pool needs CUDA and NCCL"):
        pool.allocate(1024)
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        pool.allocate(0)


def test_the_cupy_face_allocates_and_frees_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """pool.malloc is a cupy.cuda.MemoryPool over a PythonFunctionAllocator whose malloc is
    (nbytes, device) -> ncclMemAlloc and whose free is (ptr, device) -> ncclMemFree (CuPy's
    signatures); a stand-in CuPy drives it as CuPy's pool would, on the fake GPU."""
    import sys

    from _nccl_fake import FakeFabric

    class _Alloc:
        def __init__(self, malloc: Any, free: Any) -> None:
            self.malloc_func, self.free_func = malloc, free

        def malloc(self, nbytes: int) -> int:
            return int(self.malloc_func(nbytes, 0))

    class _Pool:
        def __init__(self, allocator: Any) -> None:
            self.allocator, self.held = allocator, []

        def malloc(self, nbytes: int) -> int:
            self.held.append(self.allocator(nbytes))
            return self.held[-1]

        def used_bytes(self) -> int:
            return 0

        def free_all_blocks(self) -> None:
            alloc = self.allocator.__self__
            for ptr in self.held:
                alloc.free_func(ptr, 0)
            self.held.clear()

    class _Cuda:
        PythonFunctionAllocator = _Alloc
        MemoryPool = _Pool

    class _Cupy:
        cuda = _Cuda

    monkeypatch.setitem(sys.modules, "cupy", _Cupy())
    fabric = FakeFabric()
    rt = FakeRuntime(fabric)
    pool = NcclMemPool(_runtime=rt)
    ptr = pool.malloc(5000)
    assert ptr in fabric.nccl_mem and pool.segments() == [(ptr, 5000, 0)]
    pool.free_all_blocks()
    assert ptr not in fabric.nccl_mem and pool.segments() == [] and not fabric.errors

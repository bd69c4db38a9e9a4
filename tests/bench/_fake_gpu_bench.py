"""gpucoll-bench on the fake GPU (tests/_nccl_fake.py): the ranks of a local job as rank
threads of one process, each with its own default group on its own fake device, running
the benchmark's own session (``run_in_group``) with buffers in fake device memory.

The command line goes through the CLI's parser and job sizing (``local_job_size``), so
``-g 8`` is checked against the fake machine's device count as against a real one.
"""

from __future__ import annotations

import contextlib
import io
import queue
import sys
import threading
from typing import Any, Sequence

import numpy as np
import pytest

from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll.bench.check import np_dtype
from gpucoll.store import HashStore, PrefixStore

from _fake_gpu_world import DEFAULT_FEATURES, run_rank_threads
from _nccl_fake import FakeFabric, FakeRuntime


class FakeKitArray:
    """A 1-D array in fake device memory on one device; slices are views."""

    def __init__(self, kit: FakeKit, block: Any, nd: np.ndarray) -> None:
        self.kit, self.block, self.nd = kit, block, nd

    class _Device:
        def __init__(self, index: int) -> None:
            self.id = index

    @property
    def device(self) -> Any:
        return self._Device(self.kit.device)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.kit.device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        ptr = self.block.ptr + (self.nd.ctypes.data - self.block.data.ctypes.data)
        return {"shape": self.nd.shape, "typestr": self.nd.dtype.str, "data": (ptr, False), "version": 3,
                "strides": None, "stream": self.kit.rt.current_stream()}

    @property
    def dtype(self) -> np.dtype:
        return self.nd.dtype

    def __len__(self) -> int:
        return len(self.nd)

    def __getitem__(self, key: slice) -> FakeKitArray:
        return FakeKitArray(self.kit, self.block, self.nd[key])


class FakeKit:
    """The benchmark's ArrayKit on one fake device. Host access first drains the rank's
    current stream, as a CuPy copy queued there would wait for the collectives before it."""

    def __init__(self, rt: FakeRuntime, device: int) -> None:
        self.rt, self.device = rt, device
        self.pool: Any = None

    def _sync(self) -> None:
        done: queue.Queue[int] = queue.Queue()
        self.rt._stream(self.rt.current_stream()).enqueue(lambda: done.put(1))
        done.get(timeout=60)

    def zeros(self, count: int, dtype: str) -> FakeKitArray:
        npd = np_dtype(dtype)
        nbytes = count * npd.itemsize
        block = self.rt.fabric.mem.alloc(nbytes)
        return FakeKitArray(self, block, block.data[:nbytes].view(npd))

    def pooled_zeros(self, count: int, dtype: str) -> FakeKitArray:
        """Zeros from NCCL's allocator (the fake's ncclMemAlloc, through gpucoll's pool)."""
        from gpucoll._backends.nccl.mempool import NcclMemPool

        if self.pool is None:
            self.pool = NcclMemPool(_runtime=self.rt)
        npd = np_dtype(dtype)
        nbytes = count * npd.itemsize
        ptr = self.pool.allocate(max(nbytes, 1))
        block = self.rt.fabric.nccl_mem[ptr]
        return FakeKitArray(self, block, block.data[:nbytes].view(npd))

    def write(self, view: FakeKitArray, host: np.ndarray) -> None:
        self._sync()
        view.nd[...] = host

    def zero(self, view: FakeKitArray) -> None:
        self._sync()
        view.nd.view(np.uint8)[...] = 0

    def to_host(self, view: FakeKitArray) -> np.ndarray:
        self._sync()
        return view.nd.copy()

    def corrupt(self, view: FakeKitArray, itemsize: int) -> None:
        self._sync()
        view.nd.view(np.uint8)[itemsize - 1] ^= 0x40

    def synchronize(self) -> None:
        self._sync()

    def device_name(self) -> str:
        return f"cuda:{self.device} (Fake GPU)"

    def device_identity(self) -> tuple[int, str, str]:
        return self.device, "0000:%02x:00" % (0x19 + 0x10 * self.device), "Fake GPU"


class _CopyOnlyCupy:
    """The CuPy calls gpucoll's device copy makes (``array.copy_buffer``: the out-of-place
    all_reduce inside a coalescing block copies, then reduces in place), on the calling
    rank's fake runtime: the copy is queued on its current stream, as cudaMemcpyAsync."""

    def __init__(self, runtimes: dict[int, FakeRuntime]) -> None:
        outer = self

        class _Stream:
            def __init__(self, ptr: int) -> None:
                self.ptr = ptr

        class _Runtime:
            memcpyDefault = 4

            @staticmethod
            def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
                outer._rt().memcpy(dst, src, nbytes, stream)

        class _Cuda:
            runtime = _Runtime

            @staticmethod
            def get_current_stream() -> _Stream:
                return _Stream(outer._rt().current_stream())

        self.cuda = _Cuda
        self._runtimes = runtimes

    def _rt(self) -> FakeRuntime:
        return self._runtimes[int(threading.current_thread().name[4:])]


def run_bench(argv: Sequence[str], monkeypatch: pytest.MonkeyPatch, *, devices: int = 8,
              timeout: float = 60.0) -> tuple[list[int], str]:
    """Run ``gpucoll-bench *argv`` with the nccl backend on a fake machine of ``devices``
    GPUs: the job's ranks (``local_job_size``) as threads, rank r on device r. Returns every
    rank's exit status and what rank 0 printed."""
    from gpucoll import _world as world_mod
    from gpucoll._group import ProcessGroup
    from gpucoll._group import registry as group_mod
    from gpucoll.bench import ops as ops_mod
    from gpucoll.bench.cli import build_parser, config_from_args, local_job_size
    from gpucoll.bench.runner import check_config
    from gpucoll.bench.session import run_in_group

    args = build_parser().parse_args(list(argv))
    cfg = config_from_args(args, "nccl")
    n = local_job_size(args, "nccl", devices)
    check_config(cfg, n)

    fabric = FakeFabric(hang_limit=timeout)
    store = HashStore(timeout=timeout)
    runtimes: dict[int, FakeRuntime] = {}
    local = threading.local()

    def make_nccl(store: Any, rank: int, size: int, *, timeout: float, group_name: str,
                  device_id: int | None, **kw: Any) -> NCCLBackend:
        return NCCLBackend(store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id,
                           _runtime=runtimes[int(threading.current_thread().name[4:])], **kw)
    monkeypatch.setitem(group_mod.BACKENDS, "nccl", make_nccl)
    monkeypatch.setattr(world_mod, "_world", lambda: local.world)
    monkeypatch.setattr(world_mod, "default_group", lambda: local.world.default)
    monkeypatch.setattr(ops_mod, "default_group", lambda: local.world.default)
    monkeypatch.setitem(sys.modules, "cupy", _CopyOnlyCupy(runtimes))
    out = io.StringIO()
    lock = threading.Lock()

    class _Rank0Out(io.TextIOBase):
        """Rank 0's stdout is the job's; the other ranks print nothing (as run_local's)."""

        def write(self, text: str) -> int:
            if threading.current_thread().name == "rank0":
                with lock:
                    out.write(text)
            return len(text)

    def main(rank: int) -> int:
        fabric.use_device(rank)
        rt = runtimes[rank] = FakeRuntime(fabric, features=DEFAULT_FEATURES, devices=devices)
        pg = ProcessGroup(PrefixStore("pg/default", store), rank, n, group_name="default",
                          global_ranks=range(n), timeout=timeout, backend="nccl", device_id=rank,
                          group_desc="default_pg")
        local.world = world_mod._World(store, False, pg, "nccl", timeout, rank)
        try:
            return run_in_group(cfg, list(argv), FakeKit(rt, rank))
        finally:
            for g in [*local.world.groups, pg]:
                g._destroy()

    with contextlib.redirect_stdout(_Rank0Out()):
        codes = run_rank_threads(n, main, fabric)
    assert not fabric.errors, fabric.errors
    return codes, out.getvalue()

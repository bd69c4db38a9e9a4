"""Benchmark buffers: NumPy arrays for the CPU backend, CuPy device arrays for NCCL.

A kit allocates the two buffers of a run (input and output, sliced per size like
nccl-tests' ``sendbuff``/``recvbuff``), writes check inputs into them, reads
outputs back to the host, and waits for the device.
"""

from __future__ import annotations

import os
import platform
from typing import Any, Callable, Protocol

import numpy as np

from .check import np_dtype

__all__ = ["ArrayKit", "HostKit", "DeviceKit", "make_kit", "cpu_name"]

_NOT_IN_CUPY = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})


class ArrayKit(Protocol):
    """What the benchmark loop needs from the memory the collectives run on."""

    def zeros(self, count: int, dtype: str) -> Any: ...
    def pooled_zeros(self, count: int, dtype: str) -> Any:
        """Zeros in memory that can be registered with NCCL (``-R``): NCCL's allocator on a GPU."""
        ...
    def write(self, view: Any, host: np.ndarray[Any, Any]) -> None: ...
    def zero(self, view: Any) -> None: ...
    def to_host(self, view: Any) -> np.ndarray[Any, Any]: ...
    def corrupt(self, view: Any, itemsize: int) -> None: ...
    def synchronize(self) -> None: ...
    def device_name(self) -> str: ...
    def device_identity(self) -> tuple[int, str, str]:
        """(CUDA device index, PCI address ``dddd:bb:dd``, GPU name) for nccl-tests' rank
        line; ``(-1, "", "")`` for host memory."""
        ...


def cpu_name() -> str:
    """The CPU model (Linux ``/proc/cpuinfo``; else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class HostKit:
    """NumPy buffers (bfloat16 and float8 through ml_dtypes)."""

    def zeros(self, count: int, dtype: str) -> np.ndarray[Any, Any]:
        return np.zeros(count, dtype=np_dtype(dtype))

    def pooled_zeros(self, count: int, dtype: str) -> np.ndarray[Any, Any]:
        return self.zeros(count, dtype)  # host memory: registration is the CPU backend's no-op

    def write(self, view: Any, host: np.ndarray[Any, Any]) -> None:
        view[...] = host

    def zero(self, view: Any) -> None:
        view.view(np.uint8)[...] = 0

    def to_host(self, view: Any) -> np.ndarray[Any, Any]:
        return np.asarray(view)

    def corrupt(self, view: Any, itemsize: int) -> None:
        from .check import corrupt

        corrupt(view.view(np.uint8), itemsize)

    def synchronize(self) -> None:
        return None

    def device_name(self) -> str:
        return f"cpu ({cpu_name()}, {os.cpu_count()} cores)"

    def device_identity(self) -> tuple[int, str, str]:
        return -1, "", ""


class DeviceKit:
    """CuPy buffers on this rank's GPU (``LOCAL_RANK`` modulo the visible devices).

    CuPy has no bfloat16 or float8 dtype; their buffers are CuPy bytes wrapped in
    :class:`_ExoticDeviceArray`, which gpucoll's array layer reads as the right dtype.
    """

    def __init__(self, local_rank: int) -> None:
        import cupy

        self._cp = cupy
        ndev = cupy.cuda.runtime.getDeviceCount()
        self.device = local_rank % ndev
        cupy.cuda.Device(self.device).use()
        self._graph_stream: Any = None
        self._pool: Any = None  # gpucoll.nccl_mem_pool(), made for -R

    def pooled_zeros(self, count: int, dtype: str) -> Any:
        """Zeros from NCCL's allocator (``ncclMemAlloc``, through gpucoll.nccl_mem_pool), as
        nccl-tests allocates its buffers for ``-R``."""
        if self._pool is None:
            from .. import nccl_mem_pool

            self._pool = nccl_mem_pool()
        with self._cp.cuda.using_allocator(self._pool.malloc):
            return self.zeros(count, dtype)

    def zeros(self, count: int, dtype: str) -> Any:
        npd = np_dtype(dtype)
        if dtype in _NOT_IN_CUPY:
            return _ExoticDeviceArray(self._cp.zeros(count * npd.itemsize, dtype=np.uint8), dtype, npd)
        return self._cp.zeros(count, dtype=npd)

    def write(self, view: Any, host: np.ndarray[Any, Any]) -> None:
        if isinstance(view, _ExoticDeviceArray):
            view.raw.set(np.ascontiguousarray(host).view(np.uint8))
        else:
            view.set(np.ascontiguousarray(host))

    def zero(self, view: Any) -> None:
        raw = view.raw if isinstance(view, _ExoticDeviceArray) else view.view(np.uint8)
        raw.fill(0)

    def to_host(self, view: Any) -> np.ndarray[Any, Any]:
        if isinstance(view, _ExoticDeviceArray):
            return np.asarray(self._cp.asnumpy(view.raw)).view(view.np_dtype)
        return np.asarray(self._cp.asnumpy(view))

    def corrupt(self, view: Any, itemsize: int) -> None:
        raw = view.raw if isinstance(view, _ExoticDeviceArray) else view.view(np.uint8)
        raw[itemsize - 1:itemsize] ^= 0x40

    def synchronize(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()
        if self._graph_stream is not None:
            self._graph_stream.synchronize()

    def capture(self, issue: Callable[[], object]) -> Any:
        """``issue()`` captured into a CUDA graph on a stream of the kit's own, in global
        mode (nccl-tests' ``-G`` with one thread per process), as an instantiated graph."""
        cp = self._cp
        if self._graph_stream is None:
            self._graph_stream = cp.cuda.Stream(non_blocking=True)
        stream = self._graph_stream
        with stream:
            stream.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
            try:
                issue()
            finally:
                graph = stream.end_capture()
        return graph

    def launch(self, graph: Any, times: int) -> None:
        """Launch ``graph`` ``times`` times on the stream it was captured on (no wait)."""
        for _ in range(times):
            graph.launch(stream=self._graph_stream)

    def device_name(self) -> str:
        return f"cuda:{self.device} ({self.device_identity()[2]})"

    def device_identity(self) -> tuple[int, str, str]:
        """(device index, PCI address ``dddd:bb:dd``, name): nccl-tests' rank line."""
        props = self._cp.cuda.runtime.getDeviceProperties(self.device)
        name = props["name"]
        pci = "%04x:%02x:%02x" % (props.get("pciDomainID", 0), props.get("pciBusID", 0), props.get("pciDeviceID", 0))
        return self.device, pci, name.decode() if isinstance(name, bytes) else str(name)


class _ExoticDeviceArray:
    """A 1-D device array of a dtype CuPy lacks (bfloat16, float8), over CuPy uint8 memory.

    Exposes ``__cuda_array_interface__`` with the dtype's NumPy (ml_dtypes) typestr, which
    is opaque (``<V2``, ``|V1``), and ``dtype``, which names the type; it slices like an
    array, which is all the benchmark needs.
    """

    def __init__(self, raw: Any, dtype: str, np_dtype: np.dtype[Any]) -> None:
        self.raw = raw
        self.dtype_name = dtype
        self.np_dtype = np_dtype
        self.itemsize = np_dtype.itemsize

    def __len__(self) -> int:
        return int(self.raw.size) // self.itemsize

    def __getitem__(self, key: slice) -> _ExoticDeviceArray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"only contiguous slices are supported; got step {step}")
        isz = self.itemsize
        return _ExoticDeviceArray(self.raw[start * isz:max(start, stop) * isz], self.dtype_name, self.np_dtype)

    @property
    def dtype(self) -> np.dtype[Any]:
        # gpucoll's array layer reads the type of an opaque typestr ('<V2') from here.
        return self.np_dtype

    @property
    def device(self) -> Any:
        return self.raw.device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self.raw.__cuda_array_interface__)
        cai["shape"] = (len(self),)
        cai["typestr"] = self.np_dtype.str
        cai.pop("descr", None)
        cai.pop("strides", None)
        return cai


def make_kit(backend: str, local_rank: int) -> ArrayKit:
    """The kit for ``backend`` ("cpu" or "nccl")."""
    if backend == "nccl":
        return DeviceKit(local_rank)
    return HostKit()

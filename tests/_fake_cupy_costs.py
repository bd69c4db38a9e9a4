"""CuPy arrays on the realistic fake GPU: a real ``cupy.ndarray`` over fake device memory,
whose stream look-up costs what CuPy's does on an H200.

What the layers above the NCCL backend pay on a GPU for a CuPy array is CuPy's own
Cython (attribute reads) plus the calls into CUDA those reads make. CuPy 14's
``cupy/_core/core.pyx``, ``cupy/cuda/stream.pyx``, ``cupy/cuda/memory.pyx`` and
``cupy/cuda/device.pyx`` say which:

* ``dtype``, ``size``, ``_c_contiguous``, ``data`` (a ``MemoryPointer``), ``data.ptr``,
  ``data.device_id``: readonly C fields, no CUDA call;
* ``shape``: a new tuple from the C++ vector each time;
* ``device``: ``data.device``, a new ``cupy.cuda.Device(id)`` each time (no CUDA call: the
  id is given);
* ``cupy.cuda.get_current_stream(device_id=-1)``: the thread's ``_ThreadLocal``, and
  ``cudaGetDevice`` when no device is given (0.13 µs on the H200 in all);
* ``__cuda_array_interface__``: ``get_str_and_descr``, a dict, the shape tuple, and
  ``get_current_stream_ptr`` (``cudaGetDevice`` again): 1.00 µs on the H200;
* ``__dlpack_device__``: ``cuPointerGetAttributes`` through the driver.

So the array here is CuPy's own class, built over ``UnownedMemory`` at a fake address
(CuPy makes one without a GPU): every attribute read runs CuPy's real code at its real
cost on this machine. Only what needs a driver cannot run here: the current-stream
look-up is stood in for by :meth:`CupyOnFake.get_current_stream`, which costs the H200's
0.13 µs (counted as "cupy"/"current_stream" in the runtime's :class:`CallCosts`) and
answers the fake runtime's current stream as a ``cupy.cuda.Stream``-like object (a
Python object with ``ptr`` and ``device_id``, as CuPy's ``_BaseStream``).
``__cuda_array_interface__`` and ``__dlpack_device__`` ask the driver and fail here:
gpucoll reads neither for a contiguous CuPy array of a known type (the array layer's
CuPy fast path, ``gpucoll._buffer.from_cupy``), which is the path measured on the GPU
(``bench/array_layer_bench.py``: 1.05 µs).
"""

from __future__ import annotations

import itertools
from typing import Any

from gpucoll import _buffer as buffer_mod
from gpucoll import array as array_mod

__all__ = ["cupy_or_none", "CupyOnFake", "FakeCupyStream"]


def cupy_or_none() -> Any:
    """CuPy, or None where it is not installed (the tests that need it skip)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


class FakeCupyStream:
    """What ``cupy.cuda.get_current_stream()`` returns: a Python object with ``ptr`` and
    ``device_id`` (CuPy's ``_BaseStream`` is a Python class with these attributes). As
    CuPy's ``Stream.null``, the legacy default stream says ptr 0 and device -1."""

    def __init__(self, ptr: int, device_id: int) -> None:
        self.ptr = ptr
        self.device_id = device_id


class CupyOnFake:
    """CuPy arrays and CuPy's current-stream look-up over a fake runtime (``rt``: a
    :class:`~_nccl_fake.TimedRuntime`, whose ``costs`` are charged, or any runtime with
    ``current_stream()``). :meth:`install` points gpucoll's CuPy fast path at them;
    :meth:`uninstall` puts it back."""

    def __init__(self, rt: Any) -> None:
        self.cupy = cupy_or_none()
        if self.cupy is None:
            raise RuntimeError("CuPy is not installed")
        self.rt = rt
        self._streams: dict[int, FakeCupyStream] = {}
        self._addresses = itertools.count(0x4000_0000, 1 << 20)
        self._saved: tuple[Any, Any, Any] | None = None
        costs = getattr(rt, "costs", None)
        self._costs = costs
        self._seconds = costs.cost("current_stream") if costs is not None else 0.0
        self._charge = costs.meter("cupy", "current_stream", self._seconds) if costs is not None else None

    def get_current_stream(self, device_id: int = -1) -> FakeCupyStream:
        """``cupy.cuda.get_current_stream``: the runtime's current stream, at CuPy's cost
        (the fake's own look-up inside that time, as the runtime's calls do theirs)."""
        charge = self._charge
        if charge is not None:  # the timed fake (TimedRuntime): one current stream, a handle
            stream = self._streams.get(self.rt._current)
            if stream is not None:
                charge()
                return stream
        rt = self.rt
        current = rt._current
        if isinstance(current, dict):  # the semantic fake (FakeRuntime): a current stream per device
            device = rt.fabric.current_device() if device_id < 0 else device_id
            ptr, default = rt.current_stream_of(device), rt.default_stream.ptr
        else:
            ptr, default, device = current, rt._default, 0
        stream = self._streams.get(ptr)
        if stream is None:
            # The runtime's default stream is CuPy's legacy one, whose Stream.null says
            # ptr 0 and device -1.
            stream = self._streams[ptr] = FakeCupyStream(0, -1) if ptr == default else FakeCupyStream(ptr, device)
        if charge is not None:
            charge()
        return stream

    def array(self, n: int = 256, dtype: str = "float32", ptr: int | None = None) -> Any:
        """A ``cupy.ndarray`` of ``n`` elements over fake device memory on device 0."""
        cupy = self.cupy
        itemsize = cupy.dtype(dtype).itemsize
        mem = cupy.cuda.UnownedMemory(next(self._addresses) if ptr is None else ptr, n * itemsize, None, 0)
        return cupy.ndarray((n,), dtype, cupy.cuda.MemoryPointer(mem, 0))

    def install(self) -> None:
        """Send CuPy arrays through gpucoll's CuPy fast path with this stream look-up."""
        self._saved = (array_mod._cupy_ndarray, buffer_mod._cupy_stream, buffer_mod._cupy_default_stream)
        array_mod._set_cupy_fast_path()
        if array_mod._cupy_ndarray is not self.cupy.ndarray:
            self.uninstall()
            raise RuntimeError("gpucoll's CuPy fast path is off for this CuPy (CAI version 2, or ROCm)")
        buffer_mod._cupy_stream = self.get_current_stream

    def uninstall(self) -> None:
        """Put gpucoll's CuPy fast path back as it was before :meth:`install`."""
        if self._saved is not None:
            array_mod._cupy_ndarray, buffer_mod._cupy_stream, buffer_mod._cupy_default_stream = self._saved
            self._saved = None

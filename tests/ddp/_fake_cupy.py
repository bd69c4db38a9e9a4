"""A CuPy stand-in on the fake GPU (tests/_nccl_fake.py), enough for the Reducer and the
compress hooks: arrays in fake device memory that publish ``__cuda_array_interface__``
(so gpucoll sends them through the NCCL backend) and ``__array_namespace__`` (so the
Reducer makes its buckets with it).

Arithmetic runs on the host after the rank's current stream has drained, as a CuPy kernel
queued on that stream would see the memory: a result that a collective has not yet
written (a missing ``Work.wait()``) is read stale, and the test comparing with NumPy fails.

``FakeCupy.kernels`` counts what would be a kernel launch on a GPU (arithmetic, a copy
into an array, a division), by name: on an H200 each costs 7-9 us of host time, so a
per-gradient launch is what makes a Reducer slow there.
"""

from __future__ import annotations

import queue
from typing import Any

import numpy as np

from _nccl_fake import FakeRuntime


class FakeCupy:
    """The namespace: what the Reducer and the hooks call (``empty``, ``zeros``, ``asarray``,
    ``divide``, ``concatenate``, ``stack``, ``matmul``, ``sqrt``, ``sum``, ``linalg.qr``)."""

    float16, float32, float64, uint16, uint32 = np.float16, np.float32, np.float64, np.uint16, np.uint32

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt
        self.linalg = _Linalg(self)
        self.kernels: dict[str, int] = {}

    def launch(self, name: str) -> None:
        self.kernels[name] = self.kernels.get(name, 0) + 1

    def sync(self) -> None:
        done: queue.Queue[int] = queue.Queue()
        self.rt._stream(self.rt.current_stream()).enqueue(lambda: done.put(1))
        done.get(timeout=20)

    def empty(self, shape: Any, dtype: Any = np.float32) -> FakeCupyArray:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        block = self.rt.fabric.mem.alloc(nbytes)
        return FakeCupyArray(self, block, block.data[:nbytes].view(dtype).reshape(shape))

    def zeros(self, shape: Any, dtype: Any = np.float32) -> FakeCupyArray:
        out = self.empty(shape, dtype)
        out.nd[...] = 0
        return out

    def wrap(self, host: np.ndarray) -> FakeCupyArray:
        """A new device array holding ``host``'s values."""
        out = self.empty(host.shape, host.dtype)
        out.nd[...] = host
        return out

    def asarray(self, x: Any) -> FakeCupyArray:
        if isinstance(x, FakeCupyArray):
            return x
        return self.wrap(np.asarray(x))

    def divide(self, a: FakeCupyArray, b: Any, out: FakeCupyArray) -> FakeCupyArray:
        self.launch("divide")
        self.sync()
        np.divide(a.nd, b, out=out.nd)
        return out

    def concatenate(self, arrays: list[FakeCupyArray], out: FakeCupyArray | None = None) -> FakeCupyArray:
        self.launch("concatenate")  # CuPy: one kernel for many arrays (len > 8) or a copy each
        self.sync()
        if out is not None:
            np.concatenate([a.nd for a in arrays], out=out.nd)
            return out
        return self.wrap(np.concatenate([a.nd for a in arrays]))

    def stack(self, arrays: list[FakeCupyArray]) -> FakeCupyArray:
        self.sync()
        return self.wrap(np.stack([a.nd for a in arrays]))

    def matmul(self, a: FakeCupyArray, b: FakeCupyArray, out: FakeCupyArray) -> FakeCupyArray:
        self.sync()
        out.nd[...] = np.matmul(a.nd, b.nd)
        return out

    def sqrt(self, a: FakeCupyArray) -> FakeCupyArray:
        self.sync()
        return self.wrap(np.sqrt(a.nd))

    def sum(self, a: FakeCupyArray, axis: Any = None, keepdims: bool = False) -> FakeCupyArray:
        self.sync()
        return self.wrap(np.asarray(np.sum(a.nd, axis=axis, keepdims=keepdims)))


class _Linalg:
    def __init__(self, xp: FakeCupy) -> None:
        self.xp = xp

    def qr(self, a: FakeCupyArray) -> tuple[FakeCupyArray, FakeCupyArray]:
        self.xp.sync()
        q, r = np.linalg.qr(a.nd)
        return self.xp.wrap(q), self.xp.wrap(r)


class FakeCupyArray:
    """An array in fake device memory; ``nd`` is the NumPy view of that memory."""

    def __init__(self, xp: FakeCupy, block: Any, nd: np.ndarray) -> None:
        self.xp, self.block, self.nd = xp, block, nd

    # -- what gpucoll and the Reducer read --
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not self.nd.flags.c_contiguous:
            raise ValueError("not contiguous")
        ptr = self.block.ptr + (self.nd.ctypes.data - self.block.data.ctypes.data)
        return {"shape": self.nd.shape, "typestr": self.nd.dtype.str, "data": (ptr, False), "version": 3,
                "strides": None, "stream": self.xp.rt.current_stream()}

    def __array_namespace__(self) -> FakeCupy:
        return self.xp

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    @property
    def device(self) -> str:
        return "cuda:0"

    shape = property(lambda self: self.nd.shape)
    dtype = property(lambda self: self.nd.dtype)
    size = property(lambda self: self.nd.size)
    ndim = property(lambda self: self.nd.ndim)
    nbytes = property(lambda self: self.nd.nbytes)

    def get(self) -> np.ndarray:
        self.xp.sync()
        return self.nd.copy()

    # -- views share the memory; everything else is a new device array --
    def _out(self, result: Any) -> Any:
        if isinstance(result, np.ndarray) and np.shares_memory(result, self.block.data):
            return FakeCupyArray(self.xp, self.block, result)
        return self.xp.wrap(np.asarray(result))

    def _run(self, name: str, *args: Any) -> Any:
        self.xp.sync()
        args = tuple(a.nd if isinstance(a, FakeCupyArray) else a for a in args)
        return self._out(getattr(self.nd, name)(*args))

    def __getitem__(self, key: Any) -> Any:
        return self._run("__getitem__", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.xp.launch("copy")
        self.xp.sync()
        key = key.nd if isinstance(key, FakeCupyArray) else key
        self.nd[key] = value.nd if isinstance(value, FakeCupyArray) else value

    def reshape(self, *shape: Any) -> Any:
        return self._run("reshape", *shape)

    def view(self, dtype: Any) -> Any:
        return self._run("view", dtype)

    def astype(self, dtype: Any) -> Any:
        return self._run("astype", dtype)

    def copy(self) -> Any:
        return self._run("copy")

    def transpose(self, *axes: Any) -> Any:
        return self._run("transpose", *axes)

    def _inplace(self, name: str, other: Any) -> FakeCupyArray:
        self.xp.launch(name)
        self.xp.sync()
        getattr(self.nd, name)(other.nd if isinstance(other, FakeCupyArray) else other)
        return self

    def __itruediv__(self, other: Any) -> FakeCupyArray:
        return self._inplace("__itruediv__", other)

    def __iadd__(self, other: Any) -> FakeCupyArray:
        return self._inplace("__iadd__", other)

    def __isub__(self, other: Any) -> FakeCupyArray:
        return self._inplace("__isub__", other)


for _name in ("__add__", "__sub__", "__mul__", "__truediv__", "__rshift__", "__lshift__", "__and__",
              "__ne__", "__eq__", "__radd__", "__rmul__"):
    setattr(FakeCupyArray, _name, lambda self, other, _n=_name: (self.xp.launch(_n), self._run(_n, other))[1])

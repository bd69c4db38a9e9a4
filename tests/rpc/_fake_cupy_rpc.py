"""A fake ``cupy`` module for the RPC device path on a machine without a GPU.

Device memory is NumPy arrays tagged with a device id; streams run their work at once
but every operation is logged, in order, with the stream and device it was on, so a
test can check what gpucoll.rpc did: where the pinned host memory came from, which
stream the copies were enqueued on, that an event was recorded after a copy and that
the receiving thread's current stream waited on it before the user function ran.

Install it in a worker with :func:`install` before the first RPC call.
"""

from __future__ import annotations

import itertools
import sys
import threading
import types
from typing import Any

import numpy as np

LOG: list[tuple[Any, ...]] = []
_ids = itertools.count(1)
_local = threading.local()


def log(*entry: Any) -> None:
    LOG.append(entry)


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = int(device)

    def __enter__(self) -> Device:
        stack = _local.__dict__.setdefault("devices", [])
        stack.append(self.id)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.devices.pop()


def _current_device() -> int:
    stack = _local.__dict__.get("devices")
    return stack[-1] if stack else 0


class Stream:
    def __init__(self, non_blocking: bool = False, null: bool = False) -> None:
        self.id = 0 if null else next(_ids)
        self.device_id = _current_device()
        self.non_blocking = non_blocking
        log("new_stream", self.id, self.device_id)

    def wait_event(self, event: Event) -> None:
        assert event.recorded_on is not None, "waiting on an event never recorded"
        log("wait_event", self.id, event.id)

    def __enter__(self) -> Stream:
        _local.__dict__.setdefault("streams", []).append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.streams.pop()


_null: dict[int, Stream] = {}


def get_current_stream() -> Stream:
    streams = _local.__dict__.get("streams")
    if streams:
        return streams[-1]
    dev = _current_device()
    if dev not in _null:
        with Device(dev):
            _null[dev] = Stream(null=True)
    return _null[dev]


class Event:
    def __init__(self) -> None:
        self.id = next(_ids)
        self.recorded_on: int | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        self.recorded_on = stream.id
        log("record", stream.id, self.id)

    def synchronize(self) -> None:
        log("synchronize", self.id)


PINNED: list[bytearray] = []  # every pinned allocation (kept, so ids stay unique)


def alloc_pinned_memory(nbytes: int) -> bytearray:
    """Stands for ``PinnedMemoryPointer`` (host memory with the buffer protocol)."""
    mem = bytearray(nbytes)
    PINNED.append(mem)
    log("alloc_pinned", nbytes)
    return mem


def _is_pinned(a: np.ndarray) -> bool:
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return any(base is m for m in PINNED)


class ndarray:  # noqa: N801 -- CuPy's name
    def __init__(self, a: np.ndarray, device: int) -> None:
        self.a = a
        self._device = device

    @property
    def device(self) -> Device:
        return Device(self._device)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.a.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.a.dtype

    @property
    def size(self) -> int:
        return int(self.a.size)

    @property
    def nbytes(self) -> int:
        return int(self.a.nbytes)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self._device)  # kDLCUDA

    def get(self, stream: Stream | None = None, out: np.ndarray | None = None) -> np.ndarray:
        stream = stream or get_current_stream()
        log("d2h", stream.id, self._device, out is not None and _is_pinned(out))
        if out is None:
            return self.a.copy()
        out[...] = self.a
        return out

    def set(self, host: np.ndarray, stream: Stream | None = None) -> None:
        stream = stream or get_current_stream()
        log("h2d", stream.id, self._device)
        self.a[...] = host

    def __mul__(self, k: Any) -> ndarray:
        log("kernel", get_current_stream().id, self._device)
        return ndarray(self.a * k, self._device)

    def tolist(self) -> Any:
        return self.a.tolist()


ndarray.__module__ = "cupy"


def empty(shape: Any, dtype: Any) -> ndarray:
    return ndarray(np.empty(shape, dtype), _current_device())


def asarray(a: Any) -> ndarray:
    if isinstance(a, ndarray):
        return a
    return ndarray(np.array(a), _current_device())


def install() -> types.ModuleType:
    """Make ``import cupy`` answer this fake (in this process)."""
    mod = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    for name in ("Device", "Stream", "Event", "get_current_stream", "alloc_pinned_memory"):
        setattr(cuda, name, globals()[name])
    mod.cuda = cuda  # type: ignore[attr-defined]
    mod.ndarray = ndarray  # type: ignore[attr-defined]
    mod.empty = empty  # type: ignore[attr-defined]
    mod.asarray = asarray  # type: ignore[attr-defined]
    mod.LOG = LOG  # type: ignore[attr-defined]
    sys.modules["cupy"] = mod
    sys.modules["cupy.cuda"] = cuda
    return mod

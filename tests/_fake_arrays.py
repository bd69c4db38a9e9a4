"""Stand-ins for device arrays: host memory published through
``__cuda_array_interface__``, enough to test the array layer and device dispatch
without a GPU."""

from __future__ import annotations

from typing import Any

import numpy as np


class FakeCudaArray:
    """Publishes ``__cuda_array_interface__`` for a NumPy array's (host) memory."""

    def __init__(self, a: np.ndarray, *, version: int = 3, stream: int | None = None, readonly: bool = False,
                 strides: bool = False, typestr: str | None = None, dtype: Any = None,
                 device: int | None = None) -> None:
        self.a = a
        self.version = version
        self.stream = stream
        self.readonly = readonly
        self.strides = strides
        self.typestr = typestr
        self.dtype = dtype if dtype is not None else a.dtype
        if device is not None:
            self._device = device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "shape": self.a.shape,
            "typestr": self.typestr or self.a.dtype.str,
            "data": (self.a.ctypes.data, self.readonly),
            "version": self.version,
            "strides": self.a.strides if self.strides else None,
        }
        if self.version >= 3:
            d["stream"] = self.stream
        return d

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, getattr(self, "_device", 0))


def skip_without_jax() -> None:
    """Skip unless JAX is installed, without importing it here: a test process that has used
    JAX warns at every later ``os.fork()``, so JAX is only ever imported inside ranks."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax[cpu] is a test dependency")

"""NumPy stand-ins for the torch functions that torch's RPC tests call, under torch's
names and results (float32 by default, as torch's factories), so a ported body reads as
the torch test it ports: ``th.add(th.ones(2, 2), 1)``. Module-level functions: they
travel by reference in RPCs, on torch's agent as on gpucoll's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Tensor = np.ndarray


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(size[0])
    return tuple(size)


def ones(*size: Any, dtype: Any = np.float32) -> np.ndarray:
    return np.ones(_shape(size), dtype=dtype)


def zeros(*size: Any, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros(_shape(size), dtype=dtype)


def zeros_like(x: np.ndarray) -> np.ndarray:
    return np.zeros_like(x)


def tensor(data: Any) -> np.ndarray:
    """torch.tensor: an int64 array for ints, float32 for floats."""
    arr = np.array(data)
    return arr.astype(np.float32) if arr.dtype == np.float64 else arr


def rand(*size: Any) -> np.ndarray:
    return np.random.default_rng().random(_shape(size), dtype=np.float32)


def add(a: Any, b: Any, alpha: Any = 1) -> Any:
    return np.add(a, b) if alpha == 1 else np.add(a, np.multiply(b, alpha))


def mul(a: Any, b: Any) -> Any:
    return np.multiply(a, b)


def nonzero(x: np.ndarray) -> np.ndarray:
    """torch.nonzero: the indices of the non-zero elements, one row each."""
    return np.argwhere(x)


def equal(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def numel(x: np.ndarray) -> int:
    return int(np.asarray(x).size)


def is_contiguous(x: np.ndarray) -> bool:
    return bool(np.asarray(x).flags.c_contiguous)

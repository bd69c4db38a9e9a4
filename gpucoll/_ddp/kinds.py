"""Flat buffers of the caller's array kind, and the casts the compress hooks need.

A bucket's buffer is made by the array namespace of its parameters: NumPy for NumPy
(and JAX on the CPU), CuPy for CuPy (and JAX on a GPU), or any array that names its
namespace through ``__array_namespace__``. Gradients are views into it. JAX arrays
are immutable, so their gradients are copied in and the results handed back as new
JAX arrays.

bfloat16: NumPy has it through ``ml_dtypes``; CuPy has no bfloat16, so on devices the
compressed buffer is the upper half of each float32 (rounded to nearest even), kept in
a uint16 array and described to the collective as bfloat16.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import array as _array
from .._buffer import DTYPES

__all__ = ["namespace", "is_jax", "to_caller", "compress", "Carried", "collective_arg", "decompress_into", "np_dtype"]


def is_jax(a: Any) -> bool:
    return type(a).__module__.split(".", 1)[0] in ("jax", "jaxlib")


def namespace(a: Any) -> Any:
    """The array module that makes buffers for arrays like ``a`` (numpy, cupy, ...)."""
    if isinstance(a, np.ndarray):
        return np
    if is_jax(a) or type(a).__module__.split(".", 1)[0] == "cupy":
        if not _array.is_device_array(a):
            return np
        import cupy

        return cupy
    get = getattr(a, "__array_namespace__", None)
    if get is not None:
        return get()
    raise TypeError(f"gradients must be NumPy, CuPy or JAX arrays (or have __array_namespace__); "
                    f"got {type(a).__name__}")


def np_dtype(name: str) -> np.dtype[Any]:
    """A NumPy dtype by name, bfloat16 and the float8 types through ml_dtypes."""
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found
    return np.dtype(name)


def to_caller(result: Any, like: Any) -> Any:
    """``result`` (a view into a bucket) as an array of ``like``'s kind: a new JAX array
    for JAX (a copy: the bucket is written again next iteration), else ``result``."""
    if not is_jax(like):
        return result
    import jax.numpy as jnp

    if isinstance(result, np.ndarray):
        return jnp.array(result, copy=True)
    return jnp.array(jnp.from_dlpack(result), copy=True)


def compress(buffer: Any, dtype: str, divisor: int) -> Any:
    """``buffer`` cast to ``dtype`` ("float16" or "bfloat16") and divided by ``divisor``
    (torch's order: cast, then divide), as something ``gpucoll.all_reduce`` takes."""
    xp = namespace(buffer)
    if xp is np or dtype != "bfloat16":
        out = buffer.astype(np_dtype(dtype) if xp is np else dtype)
        out /= divisor
        return out
    # CuPy: no bfloat16. Divide in float32, then round to the upper 16 bits.
    scaled = (buffer / divisor).astype(xp.float32)
    bits = scaled.view(xp.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(xp.uint16)
    nan = scaled != scaled
    rounded[nan] = 0x7FC0
    buf = _array.as_buffer(rounded, name="bucket", writable=True)
    return Carried(rounded, dataclasses.replace(buf, dtype=DTYPES["bfloat16"]))


class Carried:
    """A device array of a dtype its framework lacks: the array (its bits) and the
    Buffer that describes it to a collective."""

    def __init__(self, bits: Any, buffer: Any) -> None:
        self.bits = bits
        self.buffer = buffer


def collective_arg(compressed: Any) -> Any:
    """What to pass to ``gpucoll.all_reduce`` for a result of :func:`compress`."""
    return compressed.buffer if isinstance(compressed, Carried) else compressed


def decompress_into(buffer: Any, compressed: Any) -> Any:
    """Write ``compressed`` (reduced) back into ``buffer``, cast to its dtype; return buffer."""
    if isinstance(compressed, Carried):
        xp = namespace(buffer)
        wide = (compressed.bits.astype(xp.uint32) << 16).view(xp.float32)
        buffer[...] = wide
        return buffer
    if isinstance(compressed, list):
        compressed = compressed[0]
    buffer[...] = compressed
    return buffer


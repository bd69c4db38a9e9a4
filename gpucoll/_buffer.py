"""The array layer's currency: a Buffer describes memory that a backend reads or writes.

Contract shared by every backend (see docs/arrays.md):
- ``ptr`` is the address of the first element; the memory is C-contiguous and
  ``nbytes == prod(shape) * dtype.itemsize``.
- ``owner`` keeps the memory alive; a Work holds its Buffers until the op completes.
- ``stream`` is the producer's CUDA stream as the array published it (CAI ``stream``
  or the DLPack handshake), None for host memory or "unknown/legacy default";
  ``stream_owner`` keeps that stream alive (CuPy's Stream object) where gpucoll can
  hold it: a Work makes only streams it holds (and the current one) wait, never a
  bare handle that may be destroyed meanwhile.
- ``foreign_stream``: the producer's later work runs on a stream gpucoll can neither
  name nor keep alive (another framework's own stream behind DLPack, or a CAI stream
  it cannot hold): a device op on such memory is ordered by blocking the host in
  ``wait()`` until the op completed.
- ``dtype`` is a :class:`DType`, which can name types NumPy lacks (bfloat16, float8)
  so that device arrays of those types still work from raw pointers.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

__all__ = ["DType", "Device", "Buffer", "DTYPES", "dtype_by_name", "dtype_of_typestr", "host_address"]


@dataclass(frozen=True)
class DType:
    """An element type by its canonical name.

    Attributes:
        name: canonical name: bool, int8..int64, uint8..uint64, float16, bfloat16,
            float32, float64, complex64, complex128, float8_e4m3fn, float8_e5m2.
        itemsize: bytes per element.
        kind: 'b' bool, 'i' signed int, 'u' unsigned int, 'f' float, 'c' complex.
    """

    name: str
    itemsize: int
    kind: Literal["b", "i", "u", "f", "c"]

    def numpy(self) -> np.dtype[Any]:
        """The NumPy dtype for this type; bfloat16/float8 need ``ml_dtypes`` installed.

        Raises:
            TypeError: the type has no NumPy dtype here (ml_dtypes not installed).
        """
        try:
            return np.dtype(self.name)
        except TypeError:
            pass
        try:
            import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with NumPy)
        except ImportError as exc:
            raise TypeError(
                f"dtype {self.name} needs the ml_dtypes package on the host, where NumPy has no {self.name}: "
                'pip install ml_dtypes (or "gpucoll[lowp]"; the cuda12/cuda13/bench extras bring it)'
            ) from exc
        dt: np.dtype[Any] = np.dtype(getattr(ml_dtypes, self.name))
        return dt


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bool", 1, "b"),
        DType("int8", 1, "i"), DType("int16", 2, "i"), DType("int32", 4, "i"), DType("int64", 8, "i"),
        DType("uint8", 1, "u"), DType("uint16", 2, "u"), DType("uint32", 4, "u"), DType("uint64", 8, "u"),
        DType("float16", 2, "f"), DType("bfloat16", 2, "f"),
        DType("float32", 4, "f"), DType("float64", 8, "f"),
        DType("complex64", 8, "c"), DType("complex128", 16, "c"),
        DType("float8_e4m3fn", 1, "f"), DType("float8_e5m2", 1, "f"),
    )
}


def dtype_by_name(name: str) -> DType:
    """Look up a :class:`DType` by canonical name (``np.dtype(x).name`` works for NumPy types)."""
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class Device:
    """Where memory lives: ``Device("cpu")`` or ``Device("cuda", index)``."""

    type: Literal["cpu", "cuda"]
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.type == "cpu" else f"cuda:{self.index}"


@dataclass(eq=False, slots=True)
class Buffer:
    """Contiguous memory handed to a backend; see the module docstring for the contract.

    Treat it as immutable (derive a new one with ``dataclasses.replace``). It is not
    a frozen dataclass only because one is made per op and a frozen one costs five
    times as much to construct (0.9 against 0.18 µs).
    """

    ptr: int
    nbytes: int
    dtype: DType
    shape: tuple[int, ...]
    device: Device
    readonly: bool = False
    stream: int | None = None
    owner: Any = field(default=None, repr=False)
    stream_owner: Any = field(default=None, repr=False)
    foreign_stream: bool = False

    @property
    def numel(self) -> int:
        """Number of elements."""
        return self.nbytes // self.dtype.itemsize if self.dtype.itemsize else 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


# ----- a host array's address -----
# ``a.ctypes.data`` (or ``__array_interface__``) builds a helper object per call: 0.7 µs,
# most of what describing a small host array costs. NumPy's array object starts with
# the object header and then its ``char *data`` field (the layout NumPy's C API
# documents as PyArrayObject_fields), so the address is one read at a fixed offset.
# The read is trusted only where a probe at import finds it right for every kind of
# view; elsewhere (another layout, not CPython) ``ctypes.data`` is used.
_DATA_AT = object.__basicsize__
_read_ptr = ctypes.c_void_p.from_address


def _data_field_is_the_address() -> bool:
    if sys.implementation.name != "cpython":
        return False  # id() is not an address there
    base = np.arange(24, dtype=np.int64)
    probes = (base, base[5:], base[::3], base.reshape(4, 6)[2], base.view(np.uint8)[3:], np.zeros(0),
              np.zeros(3, np.float32)[1:], np.frombuffer(bytearray(16), np.uint8))
    try:
        return all((_read_ptr(id(a) + _DATA_AT).value or 0) == a.ctypes.data for a in probes)
    except Exception:  # noqa: BLE001  (any surprise: keep the documented way)
        return False


_FAST_ADDRESS = _data_field_is_the_address()


def host_address(a: np.ndarray[Any, Any]) -> int:
    """The address of ``a``'s first element (``a.ctypes.data``, about ten times cheaper)."""
    if _FAST_ADDRESS:
        return _read_ptr(id(a) + _DATA_AT).value or 0
    return int(a.ctypes.data)


_TYPESTRS: dict[str, DType] = {}  # typestr -> DType, for every typestr that names its type alone


def dtype_of_typestr(typestr: Any, array: Any, name: str) -> DType:
    """The DType a CUDA array interface's ``typestr`` names (opaque ones, bfloat16 and
    float8, by the array's own ``dtype`` attribute); TypeError where it names none."""
    found = _TYPESTRS.get(typestr)
    if found is not None:
        return found
    typestr = str(typestr)
    order, kind, size = typestr[:1], typestr[1:2], typestr[2:]
    try:
        itemsize = int(size)
    except ValueError:
        raise TypeError(f"{name} has an unparsable typestr {typestr!r}") from None
    if itemsize > 1 and (order == ">" or (order == "=" and sys.byteorder == "big")):
        raise TypeError(f"{name} has non-native byte order (typestr {typestr!r})")
    if kind == "V" or (kind == "f" and itemsize == 1):
        # bfloat16/float8 have no typestr of their own (ml_dtypes gives '<V2', '|V1', and
        # '<f1' for float8_e5m2); the array's own dtype attribute says which type it is.
        dname = str(getattr(getattr(array, "dtype", None), "name", getattr(array, "dtype", "")))
        dname = dname.rsplit(".", 1)[-1]
        if dname in DTYPES and DTYPES[dname].itemsize == itemsize:
            return DTYPES[dname]
        raise TypeError(f"{name} has opaque typestr {typestr!r} and no recognisable dtype attribute "
                        f"(got {dname!r}); bfloat16/float8 arrays must expose .dtype")
    names = {"b": "bool", "i": f"int{8 * itemsize}", "u": f"uint{8 * itemsize}",
             "f": f"float{8 * itemsize}", "c": f"complex{8 * itemsize}"}
    try:
        found = dtype_by_name(names[kind])
    except (KeyError, TypeError):
        raise TypeError(f"{name} has unsupported typestr {typestr!r}") from None
    _TYPESTRS[typestr] = found
    return found



# ----- DLPack's structures, read with ctypes (the array layer reads capsules with them) -----

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DLPACK_FLAG_READ_ONLY = 1
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]

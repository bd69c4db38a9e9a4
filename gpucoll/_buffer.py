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

__all__ = ["DType", "Device", "Buffer", "DTYPES", "dtype_by_name", "dtype_of_typestr", "dtype_of_numpy", "cuda_device",
           "host_address", "cupy_fast_path", "from_cupy", "host_ndarray", "split_buffer", "copy_buffer"]


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



# ----- NumPy dtypes and CUDA devices, as the array layer names them -----

# np.dtype -> DType, filled on first sight of each dtype (a pure cache: same answer every time).
_NP_DTYPES: dict[np.dtype[Any], DType] = {}
_CUDA: dict[int, Device] = {}  # index -> Device("cuda", index)


def dtype_of_numpy(dt: np.dtype[Any], name: str) -> DType:
    """The DType of NumPy dtype ``dt``; TypeError (naming argument ``name``) where gpucoll has none."""
    found = _NP_DTYPES.get(dt)
    if found is not None:
        return found
    if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
        raise TypeError(f"{name} has non-native byte order ({dt.str}); use x.astype(x.dtype.newbyteorder('='))")
    if dt.name not in DTYPES:
        raise TypeError(f"{name} has unsupported dtype {dt} ; supported: {', '.join(DTYPES)}")
    found = DTYPES[dt.name]
    _NP_DTYPES[dt] = found
    return found


def cuda_device(index: int) -> Device:
    """``Device("cuda", index)``, one object per index."""
    return _CUDA.get(index) or _CUDA.setdefault(index, Device("cuda", index))


# ----- CuPy's arrays, read from their attributes -----
# CuPy's ``__cuda_array_interface__`` builds a dict per call (1.0 µs on an H200), and
# reading it back costs as much again; the same facts are attributes of the array
# (50 ns each). :func:`from_cupy` reads them and makes the Buffer that the array layer's
# CAI path makes of CuPy's CAI (version 3, as cupy/_core/core.pyx writes it): the
# pointer (0 for an empty array), shape and dtype, strides None for a C-contiguous
# array, never read-only, the device of the memory, and as stream CuPy's current
# stream, with the default stream spelled 1 (legacy) or 2 (per-thread). Nothing is
# cached per array: an array's shape can change in place (``x.shape = ...``) and a freed
# array's id and memory are reused, so every call reads the array anew.

_cupy_stream: Any = None   # cupy.cuda.get_current_stream, once set up
_cupy_default_stream = 1   # what CuPy's CAI says for stream 0: 1, or 2 (per-thread default)


def cupy_fast_path() -> type | None:
    """Set the CuPy fast path up (the array layer calls it on the first CuPy array it
    sees): ``cupy.ndarray``, or None where CuPy's CAI is not version 3 on CUDA (under
    ROCm or with version 2 the general path decides)."""
    global _cupy_stream, _cupy_default_stream
    try:
        cupy = sys.modules["cupy"]
        from cupy_backends.cuda import stream as cupy_streams

        if cupy.cuda.runtime.is_hip or int(cupy._util.CUDA_ARRAY_INTERFACE_EXPORT_VERSION) != 3:
            return None
        _cupy_default_stream = int(cupy_streams.get_default_stream_ptr())
        _cupy_stream = cupy.cuda.get_current_stream
        ndarray: type = cupy.ndarray
    except Exception:  # noqa: BLE001  (another CuPy than the one this was written against)
        return None
    return ndarray


def from_cupy(a: Any) -> Buffer | None:
    """The Buffer of a ``cupy.ndarray`` (see above); None, having checked nothing, where
    the general path must decide (not C-contiguous, a dtype gpucoll lacks, CuPy's
    stream look-up failing): it words the error, or falls back to DLPack, as before."""
    if not a._c_contiguous:
        return None
    dt = a.dtype
    dtype = _NP_DTYPES.get(dt)
    if dtype is None:
        try:
            dtype = dtype_of_numpy(dt, "tensor")
        except TypeError:
            return None
    try:
        current = _cupy_stream()
    except Exception:  # noqa: BLE001  (the general path raises it, or falls back to DLPack)
        return None
    mem = a.data
    index = mem.device_id
    device = _CUDA.get(index) or cuda_device(index)
    size = a.size
    ptr = mem.ptr if size else 0
    stream = current.ptr or _cupy_default_stream
    if stream == 1:
        return Buffer(ptr, size * dtype.itemsize, dtype, a.shape, device, False, None, a)
    held = current if current.ptr == stream else None
    return Buffer(ptr, size * dtype.itemsize, dtype, a.shape, device, False, stream, a, held, held is None)

# ----- host views, chunks and copies of Buffers (array layer and backends alike) -----

def _view_of_memory(ptr: int, nbytes: int, dtype: DType, shape: tuple[int, ...], readonly: bool,
                    keep: Any) -> np.ndarray:
    np_dtype = dtype.numpy()
    if nbytes == 0:
        return np.empty(shape, np_dtype)
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    raw._gpucoll_keep = keep  # type: ignore[attr-defined]  # the view's base holds the producer's memory
    view: np.ndarray = np.frombuffer(raw, dtype=np_dtype).reshape(shape)  # type: ignore[call-overload]
    if readonly:
        view.flags.writeable = False
    return view


def host_ndarray(buf: Buffer) -> np.ndarray:
    """A NumPy array viewing a host Buffer's memory (its ``owner`` for buffers made here).

    Raises:
        ValueError: ``buf`` is device memory.
    """
    if buf.is_cuda:
        raise ValueError(f"host_ndarray needs host memory; the buffer is on {buf.device}")
    owner = buf.owner
    if isinstance(owner, np.ndarray) and owner.nbytes == buf.nbytes and (
            buf.nbytes == 0 or host_address(owner) == buf.ptr):
        return owner
    return _view_of_memory(buf.ptr, buf.nbytes, buf.dtype, buf.shape, buf.readonly, keep=owner)


def split_buffer(buf: Buffer, parts: int) -> list[Buffer]:
    """``buf`` as ``parts`` consecutive, equal, flat chunks (views, no copy).

    Raises:
        ValueError: ``buf``'s element count is not divisible by ``parts``.
    """
    if buf.numel % parts:
        raise ValueError(f"cannot split {buf.numel} elements into {parts} equal chunks")
    count = buf.numel // parts
    if not buf.is_cuda:
        flat = host_ndarray(buf).reshape(-1)
        chunks = [flat[i * count:(i + 1) * count] for i in range(parts)]
        return [Buffer(host_address(c), c.nbytes, buf.dtype, c.shape, buf.device, not c.flags.writeable, None, c)
                for c in chunks]
    step = count * buf.dtype.itemsize
    return [Buffer(buf.ptr + i * step, step, buf.dtype, (count,), buf.device, buf.readonly, buf.stream, buf.owner,
                   buf.stream_owner, buf.foreign_stream) for i in range(parts)]


def copy_buffer(dst: Buffer, src: Buffer) -> None:
    """Copy ``src``'s bytes into ``dst`` (same nbytes, same kind of memory).

    Device copies run on CuPy's current stream, after the source's producer stream.
    """
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy_buffer: sizes differ ({dst.nbytes} vs {src.nbytes} bytes)")
    if not dst.is_cuda and not src.is_cuda:
        np.copyto(_bytes_of(dst), _bytes_of(src))
        return
    import cupy  # device memory only: host copies never import CuPy

    stream = cupy.cuda.get_current_stream()
    if src.stream is not None and src.stream != stream.ptr:
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.ExternalStream(src.stream))
        stream.wait_event(event)
    cupy.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, src.nbytes, cupy.cuda.runtime.memcpyDefault, stream.ptr)


def _bytes_of(buf: Buffer) -> np.ndarray:
    return host_ndarray(buf).reshape(-1).view(np.uint8)


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

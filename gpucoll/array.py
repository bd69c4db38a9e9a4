"""The array layer: any array in -> a :class:`~gpucoll._buffer.Buffer`, and results back out.

Accepted, in this order (the first protocol an object speaks wins):

1. ``numpy.ndarray`` (and subclasses): the fast path, no protocol round trip.
2. ``__cuda_array_interface__`` (v2/v3; CuPy, Numba, PyTorch CUDA, JAX GPU): device
   memory, with the producer's stream. If the attribute raises (PyTorch and JAX
   refuse it for bfloat16), DLPack is tried next. A ``cupy.ndarray`` gives the same
   Buffer read from its attributes, without the dict (``_buffer.from_cupy``).
3. ``__dlpack__`` + ``__dlpack_device__`` (JAX, PyTorch, CuPy, NumPy): CPU memory
   (kDLCPU, kDLCUDAHost) or CUDA memory (kDLCUDA, kDLCUDAManaged). The capsule is
   read with ctypes, so bfloat16 and float8 work where NumPy's own ``from_dlpack``
   refuses them.
4. The buffer protocol (``bytearray``, ``array.array``, ``memoryview``, ...).

Nothing is copied. Memory must be C-contiguous: a non-contiguous array raises
ValueError (the functional API, :mod:`gpucoll.functional`, copies instead). An
in-place op (``writable=True``) rejects read-only memory, JAX arrays included.

For host memory the Buffer's ``owner`` is always a NumPy array viewing exactly
the buffer's memory (shape and dtype as the Buffer's), which backends may use
directly; :func:`host_ndarray` returns it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import sys
from typing import Any, Protocol, TypeAlias, Union, runtime_checkable

import numpy as np

from ._buffer import _CUDA, _NP_DTYPES, _TYPESTRS, DTYPES, Buffer, Device, DType, cuda_device, cupy_fast_path
from ._buffer import dtype_of_numpy, dtype_of_typestr, from_cupy, host_address
from ._buffer import _view_of_memory, copy_buffer as copy_buffer, host_ndarray as host_ndarray, split_buffer as split_buffer
from ._buffer import (_DLPACK_FLAG_READ_ONLY, _DLManagedTensor, _DLManagedTensorVersioned, _capsule_get_name,
                      _capsule_get_pointer)

__all__ = [
    "ArrayLike", "SupportsBuffer", "SupportsCudaArrayInterface", "SupportsDLPack", "NotContiguousError", "xp_view",
    "as_buffer", "host_ndarray", "split_buffer", "is_device_array", "new_output", "copy_buffer", "to_caller_type",
]


@runtime_checkable
class SupportsCudaArrayInterface(Protocol):
    """Device arrays that publish ``__cuda_array_interface__`` (CuPy, Numba, ...)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


@runtime_checkable
class SupportsDLPack(Protocol):
    """Arrays that export DLPack capsules (JAX, PyTorch, CuPy, NumPy, ...)."""

    def __dlpack__(self, *, stream: Any = None) -> Any: ...

    def __dlpack_device__(self) -> tuple[int, int]: ...


if sys.version_info >= (3, 12):
    from collections.abc import Buffer as SupportsBuffer
else:
    @runtime_checkable
    class SupportsBuffer(Protocol):
        """Objects that export the buffer protocol (``bytearray``, ``memoryview``, ...)."""

        def __buffer__(self, flags: int, /) -> memoryview: ...


ArrayLike: TypeAlias = Union["np.ndarray[Any, Any]", SupportsBuffer, SupportsDLPack, SupportsCudaArrayInterface]
"""What collectives accept, as mpi4py's ``typing.Buffer`` spells it: a NumPy array, an
object of the buffer protocol, a DLPack exporter (JAX, PyTorch, CuPy, ...) or a device
array with ``__cuda_array_interface__`` (CuPy, Numba, ...). NumPy is named on its own
because before Python 3.12 its stubs declare no ``__buffer__``; untyped arrays (CuPy)
are ``Any`` to a type checker and pass too."""


class NotContiguousError(ValueError):
    """The array is not C-contiguous (collectives work on one flat block of memory)."""


_CPU = Device("cpu")
_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13

# DLPack's DLDataTypeCode (dlpack.h 1.1) with bit widths -> our canonical names.
_DL_DTYPES: dict[tuple[int, int], str] = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16",
    (5, 64): "complex64", (5, 128): "complex128",
    (6, 8): "bool",
    (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2",
}

def as_buffer(array: Any, *, name: str = "tensor", writable: bool = False) -> Buffer:
    """Describe ``array``'s memory as a :class:`Buffer`, without copying.

    Args:
        array: a NumPy array, an object with ``__cuda_array_interface__``, DLPack, or
            the buffer protocol (or a Buffer, returned as it is).
        name: the argument's name, used in error messages.
        writable: the op writes into this memory (in-place collectives).

    Returns:
        A Buffer whose ``owner`` keeps the memory alive (for host memory: a NumPy view).

    Raises:
        TypeError: not an array, or an unsupported dtype.
        ValueError: not C-contiguous, or read-only where ``writable`` is required.

    Example:
        >>> buf = as_buffer(np.zeros(4, np.float32), writable=True)
        >>> buf.nbytes, buf.dtype.name, str(buf.device)
        (16, 'float32', 'cpu')
    """
    if isinstance(array, np.ndarray):
        return _from_ndarray(array, name, writable, _CPU)
    cls = type(array)
    if cls is _cupy_ndarray:  # read from its attributes, as its CAI would say (_buffer.from_cupy)
        buf = from_cupy(array)
        if buf is not None:
            return buf
    if cls is Buffer:
        if writable and array.readonly:
            raise ValueError(f"{name} is a read-only Buffer and this op writes into it")
        return array  # type: ignore[no-any-return]
    has_dlpack = _CAI_TYPES.get(cls)
    if has_dlpack is None and hasattr(cls, "__cuda_array_interface__"):
        has_dlpack = hasattr(cls, "__dlpack__") and hasattr(cls, "__dlpack_device__")
        if len(_CAI_TYPES) < 64:
            _CAI_TYPES[cls] = has_dlpack
        if cls.__name__ == "ndarray" and cls.__module__ == "cupy" and _cupy_ndarray is None:
            _set_cupy_fast_path()
            buf = from_cupy(array) if cls is _cupy_ndarray else None
            if buf is not None:
                return buf
    if has_dlpack is not None:
        try:
            cai = array.__cuda_array_interface__
        except Exception:
            # PyTorch/JAX raise here for bfloat16; their DLPack export still works.
            if not hasattr(cls, "__dlpack__"):
                raise
        else:
            # CAI before version 3 carries no stream: the producer's pending work is
            # not ordered. A producer that also speaks DLPack (torch, JAX) gets the
            # DLPack stream handshake instead, which orders it on our stream.
            if (isinstance(cai, dict) and int(cai.get("version", 2)) >= 3) or not has_dlpack:
                return _from_cai(array, cai, name, writable)
    if hasattr(cls, "__dlpack__") and hasattr(cls, "__dlpack_device__"):
        return _from_dlpack(array, name, writable)
    try:
        view = memoryview(array)
    except TypeError:
        if cls.__module__.split(".", 1)[0] == "jax" and "Tracer" in cls.__name__:
            raise TypeError(
                f"{name} is a JAX tracer ({cls.__name__}): the call is inside jax.jit, vmap or grad, "
                "where arrays have no memory yet. Call gpucoll collectives on concrete arrays, "
                "between jitted functions (docs/arrays.md)") from None
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, JAX, PyTorch, Numba, or anything with "
            f"__cuda_array_interface__, __dlpack__ or the buffer protocol); got {cls.__name__}"
        ) from None
    if not view.c_contiguous:
        raise NotContiguousError(f"{name} must be C-contiguous; got a non-contiguous {cls.__name__}")
    return _from_ndarray(np.asarray(view), name, writable, _CPU)


_cupy_ndarray: type | None = None  # cupy.ndarray once its fast path is set up (_buffer.cupy_fast_path)


def _set_cupy_fast_path() -> None:
    global _cupy_ndarray
    _cupy_ndarray = cupy_fast_path()


def _from_ndarray(a: np.ndarray, name: str, writable: bool, device: Device) -> Buffer:
    flags = a.flags
    if not flags.c_contiguous:
        raise NotContiguousError(
            f"{name} must be C-contiguous; got an array with shape {a.shape} and strides {a.strides}. "
            "Pass np.ascontiguousarray(x), or use gpucoll.functional, which copies")
    if writable and not flags.writeable:
        raise ValueError(
            f"{name} is read-only and this op writes into it; pass a writable copy, "
            "or use gpucoll.functional, which returns a new array")
    dtype = _NP_DTYPES.get(a.dtype) or dtype_of_numpy(a.dtype, name)
    return Buffer(host_address(a), a.nbytes, dtype, a.shape, device, not flags.writeable, None, a)


# ----- __cuda_array_interface__ -----

# Types with a CAI (the value: whether the type also speaks DLPack, whose handshake is
# preferred to a CAI before version 3), and the layouts seen:
# (type, typestr, shape, strides) -> (dtype, shape as ints, nbytes), checked once.
_CAI_TYPES: dict[type, bool] = {}
_LAYOUTS: dict[tuple[Any, ...], tuple[DType, tuple[int, ...], int]] = {}


def _from_cai(array: Any, cai: dict[str, Any], name: str, writable: bool) -> Buffer:
    try:
        ptr, readonly = cai["data"]
        raw_shape = cai["shape"]
        typestr = cai["typestr"]
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"{name}.__cuda_array_interface__ is malformed ({exc!r}): {cai!r}") from exc
    if cai.get("mask") is not None:
        raise ValueError(f"{name} is a masked device array; masks are not supported")
    strides = cai.get("strides")
    key: tuple[Any, ...] | None = (type(array), typestr, raw_shape, strides)
    try:
        layout = _LAYOUTS.get(key)  # type: ignore[arg-type]
    except TypeError:  # a list for shape or strides: not a key
        layout, key = None, None
    if layout is None:
        layout = _cai_layout(array, typestr, raw_shape, strides, name, cai)
        if key is not None and typestr in _TYPESTRS:  # not an opaque one, which the array's dtype names
            if len(_LAYOUTS) >= 1024:
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    dtype, shape, nbytes = layout
    if writable and readonly:
        raise ValueError(f"{name} is read-only device memory and this op writes into it; "
                         "use gpucoll.functional, which returns a new array")
    stream = cai.get("stream") if int(cai.get("version", 2)) >= 3 else None
    ptr = int(ptr or 0)
    index = _cuda_device_index(array, ptr)
    device = _CUDA.get(index) or cuda_device(index)
    stream = None if stream is None or stream == 1 or stream == 0 else _normalise_stream(stream)
    if stream is None:
        return Buffer(ptr, nbytes, dtype, shape, device, bool(readonly), None, array)
    held = _hold_stream(array, stream)
    return Buffer(ptr, nbytes, dtype, shape, device, bool(readonly), stream, array, held, held is None)


def _cai_layout(array: Any, typestr: Any, raw_shape: Any, strides: Any, name: str,
                cai: dict[str, Any]) -> tuple[DType, tuple[int, ...], int]:
    """A CAI's element type, shape and size, checked (C-contiguous, a known type)."""
    try:
        shape = tuple(map(int, raw_shape))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}.__cuda_array_interface__ is malformed ({exc!r}): {cai!r}") from exc
    dtype = dtype_of_typestr(typestr, array, name)
    if strides is not None:
        _check_c_strides(strides, shape, dtype.itemsize, name)
    return dtype, shape, math.prod(shape) * dtype.itemsize


def _hold_stream(array: Any, stream: int) -> Any:
    """What keeps the CAI ``stream`` alive: CuPy publishes its current stream, whose
    object is at hand. None elsewhere (the producer's handle, maybe gone by wait())."""
    cupy = sys.modules.get("cupy") if type(array).__module__.startswith("cupy") else None
    if cupy is None:
        return None
    try:
        current = cupy.cuda.get_current_stream()
    except Exception:
        return None
    return current if int(current.ptr) == stream else None


def _check_c_strides(strides: Any, shape: tuple[int, ...], itemsize: int, name: str) -> None:
    if strides is None:
        return
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(tuple(strides))):
        if dim != 1 and int(stride) != expected:
            raise NotContiguousError(f"{name} must be C-contiguous; got shape {shape} with strides {tuple(strides)}. "
                             "Make a contiguous copy, or use gpucoll.functional, which copies")
        expected *= dim


def _normalise_stream(stream: Any) -> int | None:
    # CAI v3 / DLPack: None = no sync needed, 1 = legacy default (the Buffer contract
    # spells both None), 2 = per-thread default, else a cudaStream_t.
    if stream is None or int(stream) in (0, 1):
        return None
    return int(stream)


_DEVICE_ATTR: dict[type, str] = {}  # types whose arrays' .device.<attr> gave the index


def _cuda_device_index(array: Any, ptr: int) -> int:
    cls = type(array)
    attr = _DEVICE_ATTR.get(cls)
    if attr is not None:
        index = getattr(getattr(array, "device", None), attr, None)
        if type(index) is int:
            return index
    if cls.__module__.startswith("cupy"):
        # CuPy's __dlpack_device__ asks the driver for the pointer's attributes
        # (managed or not) on every call; its Device object already knows.
        index = getattr(getattr(array, "device", None), "id", None)
        if isinstance(index, int):
            if len(_DEVICE_ATTR) < 64:
                _DEVICE_ATTR[cls] = "id"
            return index
    dev = getattr(cls, "__dlpack_device__", None)
    if dev is not None:
        try:
            kind, index = array.__dlpack_device__()
            if int(kind) in (_KDL_CUDA, _KDL_CUDA_MANAGED):
                return int(index)
        except Exception:
            pass
    device = getattr(array, "device", None)
    for attr in ("id", "index"):  # CuPy Device.id, torch.device.index
        index = getattr(device, attr, None)
        if isinstance(index, int):
            if dev is None and len(_DEVICE_ATTR) < 64:
                _DEVICE_ATTR[cls] = attr  # no DLPack device to prefer: the attribute it is
            return index
    cupy = sys.modules.get("cupy")
    if cupy is not None and ptr:
        try:
            return int(cupy.cuda.runtime.pointerGetAttributes(ptr).device)
        except Exception:
            pass
    return 0


# ----- DLPack, read with ctypes (the structures are in _buffer.py) -----

def consumer_stream() -> int:
    """The stream gpucoll names in the DLPack handshake: CuPy's current stream of the
    calling thread (the stream a device op then orders after), as DLPack spells it:
    1 for the legacy default stream; 1 as well before CuPy is loaded or usable."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return 1
    try:
        ptr = int(cupy.cuda.get_current_stream().ptr)
    except Exception:
        return 1
    return ptr if ptr else 1


def _export_capsule(array: Any, stream: int | None) -> Any:
    try:
        return array.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        pass  # a producer older than DLPack 1.0 has no max_version
    try:
        return array.__dlpack__(stream=stream)
    except TypeError:
        return array.__dlpack__()


def _from_dlpack(array: Any, name: str, writable: bool) -> Buffer:
    kind, index = (int(v) for v in array.__dlpack_device__())
    if kind not in (_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED):
        raise TypeError(f"{name} lives on DLPack device type {kind}; only CPU and CUDA memory are supported")
    # The DLPack handshake: a CUDA producer makes the data ready on the stream we
    # name, the caller's current stream, after which the op is ordered (a Buffer
    # with stream None). Host memory takes no stream.
    capsule = _export_capsule(array, consumer_stream() if kind in (_KDL_CUDA, _KDL_CUDA_MANAGED) else None)
    cname = _capsule_get_name(capsule)
    if cname == b"dltensor_versioned":
        managed_v = _DLManagedTensorVersioned.from_address(_capsule_get_pointer(capsule, cname))
        tensor, readonly = managed_v.dl_tensor, bool(managed_v.flags & _DLPACK_FLAG_READ_ONLY)
    elif cname == b"dltensor":
        tensor = _DLManagedTensor.from_address(_capsule_get_pointer(capsule, cname)).dl_tensor
        readonly = False
    else:
        raise TypeError(f"{name}.__dlpack__() returned a capsule named {cname!r}, not a DLPack tensor")
    # Legacy capsules carry no read-only flag; JAX arrays are immutable all the same.
    readonly = readonly or type(array).__module__.split(".", 1)[0] in ("jax", "jaxlib")
    dt = tensor.dtype
    if dt.lanes != 1 or (dt.code, dt.bits) not in _DL_DTYPES:
        raise TypeError(f"{name} has DLPack dtype code={dt.code} bits={dt.bits} lanes={dt.lanes}, "
                        f"which gpucoll does not support; supported: {', '.join(DTYPES)}")
    dtype = DTYPES[_DL_DTYPES[(dt.code, dt.bits)]]
    shape = tuple(int(tensor.shape[i]) for i in range(tensor.ndim))
    if tensor.strides:
        strides = tuple(int(tensor.strides[i]) * dtype.itemsize for i in range(tensor.ndim))
        _check_c_strides(strides, shape, dtype.itemsize, name)
    if writable and readonly:
        raise ValueError(f"{name} ({type(array).__name__}) is immutable or read-only and this op writes "
                         "into it; use gpucoll.functional (all_reduce, broadcast, all_gather, "
                         "reduce_scatter, gather, scatter, all_to_all, recv, ...), which returns a new array")
    numel = math.prod(shape)
    ptr = int(tensor.data or 0) + int(tensor.byte_offset)
    nbytes = numel * dtype.itemsize
    if kind in (_KDL_CPU, _KDL_CUDA_HOST):
        view = _view_of_memory(ptr, nbytes, dtype, shape, readonly, keep=capsule)
        return Buffer(ptr, nbytes, dtype, shape, _CPU, readonly, None, view)
    # The capsule is the owner: its producer-installed destructor frees the tensor
    # once the capsule is collected, because we never rename it to "used_dltensor".
    # The handshake orders the producer's pending work before the op, but not its later
    # work after it: that runs on the producer's own current stream (torch's, JAX's),
    # which DLPack does not name. Unless the memory is immutable (JAX), wait() then
    # blocks the host (foreign_stream).
    return Buffer(ptr, nbytes, dtype, shape, Device("cuda", index), readonly, None, (array, capsule),
                  None, not readonly)


def is_device_array(array: Any) -> bool:
    """True if ``array`` lives in CUDA memory (by the protocols it speaks)."""
    if isinstance(array, np.ndarray):
        return False
    cls = type(array)
    # JAX's CPU arrays have a __cuda_array_interface__ property that raises: ask
    # __dlpack_device__ first, and count CAI only when it actually answers.
    if hasattr(cls, "__dlpack_device__"):
        try:
            return int(array.__dlpack_device__()[0]) in (_KDL_CUDA, _KDL_CUDA_MANAGED)
        except Exception:
            pass
    if hasattr(cls, "__cuda_array_interface__"):
        try:
            array.__cuda_array_interface__
        except Exception:
            return False
        return True
    return False


# ----- results back in the caller's own type (functional API) -----

# Dtypes CuPy cannot allocate; device outputs of these types are allocated as
# unsigned integers of the same width and reinterpreted by the caller's framework.
_NOT_IN_CUPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _framework(array: Any) -> str:
    module = type(array).__module__.split(".", 1)[0]
    return "jax" if module == "jaxlib" else module


def new_output(like: Any, shape: tuple[int, ...], dtype: DType) -> tuple[Any, Buffer]:
    """A new, writable array for an op's result in memory of the same kind as ``like``.

    Host inputs get a NumPy array; device inputs get a CuPy array on the same device
    (CuPy is imported here, and only for device inputs).

    Returns:
        ``(array, buffer)``: pass ``array`` to :func:`to_caller_type` once the op is done.
    """
    if not is_device_array(like):
        out = np.empty(shape, dtype.numpy())
        return out, _from_ndarray(out, "output", True, _CPU)
    carrier = f"uint{8 * dtype.itemsize}" if dtype.name in _NOT_IN_CUPY else dtype.name
    out = _device_empty(like, shape, carrier)
    buf = as_buffer(out, name="output", writable=True)
    return out, (dataclasses.replace(buf, dtype=dtype) if carrier != dtype.name else buf)


def _device_empty(like: Any, shape: tuple[int, ...], carrier: str) -> Any:
    """A CuPy array for a device input's result; CUDA's own errors become a gpucoll error
    that says what is missing (httpx-style conversion at the boundary)."""
    from ._env.devices import no_gpu_reason
    from .errors import BackendUnavailableError

    what = f"the input is a device array ({type(like).__name__}), and its result is allocated with CuPy"
    reason = no_gpu_reason()
    if reason is not None:
        raise BackendUnavailableError(f"{what}, but {reason}. Pass host arrays (NumPy) instead")
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(f"{what}, which is not installed: pip install 'gpucoll[cuda12]' "
                                      "(or [cuda13])") from exc
    try:
        with cupy.cuda.Device(_cuda_device_index(like, 0)):
            return cupy.empty(shape, carrier)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise BackendUnavailableError(f"{what}, but CUDA cannot allocate it: {exc}") from exc


def xp_view(buf: Buffer) -> Any:
    """A NumPy (host) or CuPy (device) array viewing ``buf``; dtypes CuPy lacks appear as
    unsigned integers of the same width."""
    if not buf.is_cuda:
        return host_ndarray(buf)
    import cupy

    carrier = f"uint{8 * buf.dtype.itemsize}" if buf.dtype.name in _NOT_IN_CUPY else buf.dtype.name
    memory = cupy.cuda.UnownedMemory(buf.ptr, buf.nbytes, buf.owner, buf.device.index)
    return cupy.ndarray(buf.shape, carrier, cupy.cuda.MemoryPointer(memory, 0))


def to_caller_type(result: Any, like: Any, dtype: DType) -> Any:
    """Return ``result`` (from :func:`new_output`) as an array of ``like``'s framework.

    NumPy stays NumPy; JAX gets ``jax.numpy.from_dlpack``; PyTorch ``torch.from_dlpack``;
    CuPy stays CuPy; anything else (``bytearray``, ``memoryview``) gets NumPy.
    Zero-copy through DLPack wherever the receiving framework allows it.
    """
    framework = _framework(like)
    carried = isinstance(result, np.ndarray) is False and dtype.name in _NOT_IN_CUPY
    if framework == "jax":
        import jax
        import jax.numpy as jnp

        if isinstance(result, np.ndarray) and dtype.name in _NOT_IN_CUPY:
            return jnp.asarray(result)  # NumPy cannot export these dtypes through DLPack
        out = jnp.from_dlpack(result)
        return jax.lax.bitcast_convert_type(out, getattr(jnp, dtype.name)) if carried else out
    if framework == "torch":
        torch = sys.modules["torch"]
        if isinstance(result, np.ndarray) and dtype.name in _NOT_IN_CUPY:
            # NumPy cannot export these dtypes through DLPack: hand over the bits as integers.
            bits = torch.from_dlpack(result.view(f"uint{8 * dtype.itemsize}"))
            return bits.view(like.dtype)
        out = torch.from_dlpack(result)
        return out.view(like.dtype) if carried else out
    return result

"""The XLA FFI handler of every gpucoll op: a Python callback registered through ctypes.

XLA calls the handler with the buffers it owns; the handler wraps them as NumPy views (no
copy) and runs the group's op on them, writing straight into XLA's output buffers. The
ordering token (last operand, last result; dtype TOKEN, no data) is skipped.

No compiler is needed: the handler is a ``ctypes.CFUNCTYPE`` callback following
``XLA_FFI_Handler`` (FFI API 0.3), handed to ``jax.ffi.register_ffi_target`` in a
PyCapsule.
"""

from __future__ import annotations

import ctypes as C
import math
from typing import Any, Callable, cast

import numpy as np

from .._group import ProcessGroup
from .._reduce_op import ReduceOp
from . import ffi_api as A

OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)
Arrays = list["np.ndarray[Any, Any]"]

# Groups are named in the compiled program by an integer handle: XLA attributes are
# static values, and a ProcessGroup is not one. A group gets its handle when it is first
# traced into a program and keeps it for the life of the process.
_GROUPS: dict[int, ProcessGroup] = {}


def group_handle(pg: ProcessGroup) -> int:
    handle = id(pg)
    _GROUPS.setdefault(handle, pg)
    return handle


_DTYPES: dict[int, np.dtype[Any]] = {}


def _np_dtype(code: int) -> np.dtype[Any]:
    dtype = _DTYPES.get(code)
    if dtype is None:
        name = A.DTYPES.get(code)
        if name is None:
            raise TypeError(f"XLA data type code {code} is not supported by gpucoll collectives")
        if name == "bfloat16":
            import ml_dtypes  # a dependency of jax itself

            dtype = cast("np.dtype[Any]", np.dtype(ml_dtypes.bfloat16))
        else:
            dtype = np.dtype(name)
        _DTYPES[code] = dtype
    return dtype


_BufferP = C.POINTER(A.Buffer)


def _views(ptrs: Any, count: int) -> Arrays:
    """NumPy views (no copy) of the XLA_FFI_Buffers at ``ptrs``, the token left out."""
    out = []
    for i in range(count):
        buf = C.cast(ptrs[i], _BufferP).contents
        if buf.dtype == A.DTYPE_TOKEN:
            continue
        shape = tuple(buf.dims[k] for k in range(buf.rank))
        dtype = _np_dtype(buf.dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            out.append(np.empty(shape, dtype))
            continue
        raw = (C.c_char * nbytes).from_address(buf.data)
        out.append(np.frombuffer(raw, dtype).reshape(shape))
    return out


def _attrs(attrs: A.Attrs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(attrs.size):
        span = attrs.names[i].contents
        name = C.string_at(span.ptr, span.len).decode()
        if attrs.types[i] == A.ATTR_SCALAR:
            scalar = C.cast(attrs.attrs[i], C.POINTER(A.Scalar)).contents
            out[name] = int(C.cast(scalar.value, C.POINTER(C.c_int64)).contents.value)
        elif attrs.types[i] == A.ATTR_ARRAY:
            arr = C.cast(attrs.attrs[i], C.POINTER(A.Array)).contents
            out[name] = [int(v) for v in C.cast(arr.data, C.POINTER(C.c_int64))[:arr.size]] if arr.size else []
        else:
            raise TypeError(f"attribute {name!r}: expected an integer scalar or array")
    return out


def _same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Whether XLA aliased the output to the input (one buffer)."""
    return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _all_reduce(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    if _same(outs[0], ins[0]):
        pg.all_reduce(outs[0], OPS[a["op"]])
    else:
        pg._all_reduce_into(outs[0], ins[0], OPS[a["op"]])


def _broadcast(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    if pg.rank() == a["root"] and not _same(outs[0], ins[0]):
        np.copyto(outs[0], ins[0])
    pg.broadcast(outs[0], a["root"])


def _reduce(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    if not _same(outs[0], ins[0]):
        np.copyto(outs[0], ins[0])
    pg.reduce(outs[0], a["root"], OPS[a["op"]])


def _all_gather(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.all_gather_single(outs[0], ins[0])


def _reduce_scatter(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.reduce_scatter_single(outs[0], ins[0], OPS[a["op"]])


def _all_to_all_single(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.all_to_all_single(outs[0], ins[0], a.get("out_splits") or None, a.get("in_splits") or None)


def _gather(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.gather(ins[0], list(outs[0]) if outs else None, a["root"])


def _scatter(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.scatter(outs[0], list(ins[0]) if pg.rank() == a["root"] else None, a["root"])


def _send(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.send(ins[0], a["peer"], a["tag"], async_op=False)


def _recv(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.recv(outs[0], None if a["peer"] < 0 else a["peer"], a["tag"], async_op=False)


def _barrier(pg: ProcessGroup, ins: Arrays, outs: Arrays, a: dict[str, Any]) -> None:
    pg.barrier()
    if outs and not _same(outs[0], ins[0]):
        np.copyto(outs[0], ins[0])


Runner = Callable[[ProcessGroup, Arrays, Arrays, dict[str, Any]], None]
RUNNERS: dict[str, Runner] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "all_to_all_single": _all_to_all_single, "gather": _gather,
    "scatter": _scatter, "send": _send, "recv": _recv, "barrier": _barrier,
}


def _error(frame: A.CallFrame, message: str) -> int:
    args = A.ErrorCreateArgs(struct_size=A.struct_size(A.ErrorCreateArgs), message=message.encode(),
                             errc=A.ERROR_INTERNAL)
    return int(frame.api.contents.error_create(C.byref(args)) or 0)


def _make_handler(kind: str) -> Any:
    run = RUNNERS[kind]

    def handler(frame_ptr: Any) -> int | None:
        frame = frame_ptr.contents
        ext = frame.extension_start
        if ext and ext.contents.type == A.EXTENSION_METADATA:
            # XLA asks which FFI API version the handler speaks (at registration).
            md = C.cast(ext, C.POINTER(A.MetadataExtension)).contents.metadata.contents
            md.api_version.major_version = A.API_MAJOR
            md.api_version.minor_version = A.API_MINOR
            md.traits = 0
            return None
        if frame.stage != A.STAGE_EXECUTE:
            return None
        try:
            args, rets = frame.args, frame.rets
            a = _attrs(frame.attrs)
            run(_GROUPS[a["group"]], _views(args.args, args.size), _views(rets.rets, rets.size), a)
            return None
        except BaseException as exc:  # an exception must not cross into XLA: it becomes XLA's error
            return _error(frame, f"gpucoll.functional.{kind} inside jax.jit failed: {type(exc).__name__}: {exc}")

    return A.Handler(handler)


_HANDLERS: dict[str, Any] = {}  # kept alive: XLA holds raw pointers to these callbacks


def target(kind: str) -> str:
    """The FFI target name of ``kind``, registered with XLA on first use."""
    name = f"gpucoll_{kind}"
    if kind not in _HANDLERS:
        import jax

        A.check_sizes()
        _HANDLERS[kind] = _make_handler(kind)
        capsule = jax.ffi.pycapsule(_HANDLERS[kind])  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return name

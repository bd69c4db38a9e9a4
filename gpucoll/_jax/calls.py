"""gpucoll ops as XLA FFI custom calls, with a Python handler registered through ctypes.

Each traced call becomes ``jax.ffi.ffi_call("gpucoll_<op>", ..., has_side_effect=True)``
with the group, reduce op, root and tag as static integer attributes. XLA calls
:func:`_handler` with the buffers it owns; the handler wraps them as NumPy views (no
copy) and runs the group's CPU backend op on them, writing straight into XLA's output.

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
from .._reduce_op import PremulSum, ReduceOp, as_reduce_op
from .. import array as _array
from . import ffi_api as A

_OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)


def _np_dtype(code: int) -> np.dtype[Any]:
    name = A.DTYPES.get(code)
    if name is None:
        raise TypeError(f"XLA data type code {code} is not supported by gpucoll collectives")
    if name == "bfloat16":
        import ml_dtypes  # a dependency of jax itself

        return cast("np.dtype[Any]", np.dtype(ml_dtypes.bfloat16))
    return np.dtype(name)


def _view(ptr: int) -> np.ndarray[Any, Any]:
    """A NumPy view (no copy) of the XLA_FFI_Buffer at ``ptr``."""
    buf = C.cast(ptr, C.POINTER(A.Buffer)).contents
    shape = tuple(int(buf.dims[i]) for i in range(buf.rank))
    dtype = _np_dtype(buf.dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    raw = (C.c_char * nbytes).from_address(buf.data)
    return cast("np.ndarray[Any, Any]", np.frombuffer(memoryview(raw), dtype).reshape(shape))


def _attrs(attrs: A.Attrs) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in range(attrs.size):
        span = attrs.names[i].contents
        name = C.string_at(span.ptr, span.len).decode()
        if attrs.types[i] != A.ATTR_SCALAR:
            raise TypeError(f"attribute {name!r}: expected an integer scalar")
        scalar = C.cast(attrs.attrs[i], C.POINTER(A.Scalar)).contents
        out[name] = int(C.cast(scalar.value, C.POINTER(C.c_int64)).contents.value)
    return out


# Groups are named in the compiled program by an integer handle: XLA attributes are
# static values, and a ProcessGroup is not one. A group gets its handle when it is first
# traced into a program and keeps it for the life of the process.
_GROUPS: dict[int, ProcessGroup] = {}


def group_handle(pg: ProcessGroup) -> int:
    handle = id(pg)
    _GROUPS.setdefault(handle, pg)
    return handle


def _run_all_reduce(ins: list[np.ndarray[Any, Any]], outs: list[np.ndarray[Any, Any]], attrs: dict[str, int]) -> None:
    pg = _GROUPS[attrs["group"]]
    src = _array.as_buffer(ins[0], name="x")
    dst = _array.as_buffer(outs[0], name="out", writable=True)
    pg._all_reduce_into(dst, src, _OPS[attrs["op"]])


def _run_all_gather(ins: list[np.ndarray[Any, Any]], outs: list[np.ndarray[Any, Any]], attrs: dict[str, int]) -> None:
    pg = _GROUPS[attrs["group"]]
    pg.all_gather_single(_array.as_buffer(outs[0], name="out", writable=True), _array.as_buffer(ins[0], name="x"))


_RUNNERS: dict[str, Callable[[list[np.ndarray[Any, Any]], list[np.ndarray[Any, Any]], dict[str, int]], None]] = {
    "all_reduce": _run_all_reduce, "all_gather": _run_all_gather,
}


def _error(frame: A.CallFrame, message: str) -> int:
    args = A.ErrorCreateArgs(struct_size=A.struct_size(A.ErrorCreateArgs), message=message.encode(),
                             errc=A.ERROR_INTERNAL)
    return int(frame.api.contents.error_create(C.byref(args)) or 0)


def _make_handler(kind: str) -> Any:
    run = _RUNNERS[kind]

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
            ins = [_view(frame.args.args[i]) for i in range(frame.args.size)]
            outs = [_view(frame.rets.rets[i]) for i in range(frame.rets.size)]
            run(ins, outs, _attrs(frame.attrs))
            return None
        except BaseException as exc:  # an exception must not cross into XLA: it becomes XLA's error
            return _error(frame, f"gpucoll.functional.{kind} inside jax.jit failed: {type(exc).__name__}: {exc}")

    return A.Handler(handler)


_HANDLERS: dict[str, Any] = {}  # kept alive: XLA holds raw pointers to these callbacks


def _target(kind: str) -> str:
    name = f"gpucoll_{kind}"
    if kind not in _HANDLERS:
        import jax

        A.check_sizes()
        _HANDLERS[kind] = _make_handler(kind)
        capsule = jax.ffi.pycapsule(_HANDLERS[kind])  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return name


def _all_reduce_call(x: Any, op_index: int, handle: int) -> Any:
    import jax

    # vmap: a reduction is elementwise across ranks, so the batched call reduces the
    # whole batched array (every rank batches alike, as every rank traces the same code).
    call = jax.ffi.ffi_call(_target("all_reduce"), jax.ShapeDtypeStruct(x.shape, x.dtype),  # type: ignore[no-untyped-call]
                            has_side_effect=True, vmap_method="broadcast_all")
    return call(x, group=np.int64(handle), op=np.int64(op_index))


_SUM_WITH_GRAD: list[Any] = []  # the custom_vjp function, built on first use (imports jax)


def _sum_with_grad() -> Any:
    """all_reduce(SUM) with its gradient rule: the cotangent of a sum all_reduce is the
    sum all_reduce of the cotangent (mpi4jax's rule for allreduce(SUM))."""
    if not _SUM_WITH_GRAD:
        import jax

        total = _OPS.index(ReduceOp.SUM)

        def f(x: Any, handle: int) -> Any:
            return _all_reduce_call(x, total, handle)

        def fwd(x: Any, handle: int) -> tuple[Any, None]:
            return _all_reduce_call(x, total, handle), None

        def bwd(handle: int, _: None, cotangent: Any) -> tuple[Any]:
            return (_all_reduce_call(cotangent, total, handle),)

        g = jax.custom_vjp(f, nondiff_argnums=(1,))
        g.defvjp(fwd, bwd)
        _SUM_WITH_GRAD.append(g)
    return _SUM_WITH_GRAD[0]


def all_reduce(x: Any, op: Any, pg: ProcessGroup) -> Any:
    rop = as_reduce_op(op)
    # A PremulSum is an instance of ReduceOp too (as in torch): refuse it by its own type.
    if isinstance(rop, PremulSum) or not isinstance(rop, ReduceOp) or rop is ReduceOp.PREMUL_SUM:
        raise TypeError(f"gpucoll.functional.all_reduce inside jax.jit: op={op!r} is not supported; "
                        "use a plain ReduceOp and scale outside the collective")
    if rop is ReduceOp.SUM:
        return _sum_with_grad()(x, group_handle(pg))
    return _all_reduce_call(x, _OPS.index(rop), group_handle(pg))


def _call(kind: str, x: Any, shape: tuple[int, ...], dtype: Any, **attrs: int) -> Any:
    import jax

    call = jax.ffi.ffi_call(_target(kind), jax.ShapeDtypeStruct(shape, dtype),  # type: ignore[no-untyped-call]
                            has_side_effect=True)
    return call(x, **{k: np.int64(v) for k, v in attrs.items()})


def all_gather(x: Any, pg: ProcessGroup, axis: int) -> Any:
    """Every rank's ``x`` stacked in rank order, then joined along ``axis`` as outside jit."""
    import jax.numpy as jnp

    n = pg.size()
    stacked = _call("all_gather", x, (n, *x.shape), x.dtype, group=group_handle(pg))
    if not x.shape:
        return stacked
    ndim = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis!r} is out of range for an array of {ndim} dimension(s)")
    return jnp.concatenate([stacked[i] for i in range(n)], axis=axis % ndim)

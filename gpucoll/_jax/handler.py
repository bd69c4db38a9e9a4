"""The XLA FFI handler of every gpucoll op: a Python callback registered through ctypes.

XLA calls the handler with the buffers it owns; the handler wraps them as NumPy views (no
copy) and runs the group's op on them, writing straight into XLA's output buffers. The
ordering token (last operand, last result; dtype TOKEN, no data) is skipped. A call's
static part (op, group, attributes, shapes) is a :class:`Plan` made at lowering, named in
the program by one integer attribute.

No compiler is needed: the handler is a ``ctypes.CFUNCTYPE`` callback following
``XLA_FFI_Handler`` (FFI API 0.3), handed to ``jax.ffi.register_ffi_target`` in a
PyCapsule.
"""

from __future__ import annotations

import ctypes as C
import dataclasses
import math
import os
import threading
from typing import Any, Callable

import numpy as np

from .. import array as _array
from .._buffer import DTYPES, Buffer, Device
from .._group import ProcessGroup
from .._reduce_op import ReduceOp
from ..errors import DistBackendError
from . import ffi_api as A
from . import native

OPS: tuple[ReduceOp, ...] = tuple(ReduceOp)

# Groups are named at trace time by an integer handle (a primitive's parameters must be
# hashable static values, and a ProcessGroup is not one). A group gets its handle when it
# is first traced into a program and keeps it for the life of the process.
_GROUPS: dict[int, ProcessGroup] = {}


def group_handle(pg: ProcessGroup) -> int:
    handle = id(pg)
    _GROUPS.setdefault(handle, pg)
    return handle


class Plan:
    """One call site's static part, made when it is lowered: the op, its group, its
    attributes and its operands' shapes and dtypes. The compiled program names it by
    one integer attribute, so a call reads one int64 to find it all; the NumPy views of
    XLA's buffers are made once per buffer address and kept (XLA reuses its buffers)."""

    __slots__ = ("index", "kind", "pg", "attrs", "ins", "outs", "views")

    def __init__(self, index: int, kind: str, attrs: dict[str, Any], ins: list[tuple[tuple[int, ...], np.dtype[Any]]],
                 outs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
        self.index = index
        self.kind = kind
        self.pg = _GROUPS[attrs["group"]]
        self.attrs = attrs
        self.ins, self.outs = ins, outs
        self.views: dict[tuple[int, int], Buffer] = {}

    def buffer(self, slot: int, shape: tuple[int, ...], dtype: np.dtype[Any], ptr: int) -> Buffer:
        """A Buffer over XLA's memory at ``ptr`` (a NumPy view of it is its owner)."""
        key = (slot, ptr)
        buf = self.views.get(key)
        if buf is None:
            if len(self.views) > 4096:  # a program that keeps moving its buffers
                self.views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            view = (np.frombuffer(memoryview((C.c_char * nbytes).from_address(ptr)), dtype).reshape(shape) if nbytes
                    else np.empty(shape, dtype))
            buf = _array.as_buffer(view, name=f"{self.kind} operand", writable=True)
            self.views[key] = buf
        return buf


_PLANS: list[Plan] = []
_PLAN_IDS: dict[Any, int] = {}
_PLAN_LOCK = threading.Lock()
# Plans are this process's: the attribute carries a random per-process tag beside the
# plan's index, so a program compiled elsewhere (a persistent compilation cache) is
# refused by name instead of running another process's plan numbers.
_INDEX_BITS = 24
_TAG = int.from_bytes(os.urandom(4), "little") | 1
native.configure(_TAG, _INDEX_BITS)


def plan_id(kind: str, attrs: tuple[tuple[str, Any], ...], ins: list[tuple[tuple[int, ...], Any]],
            outs: list[tuple[tuple[int, ...], Any]]) -> int:
    """The integer naming this call site's Plan (one per distinct op, attributes, shapes)."""
    key = (kind, attrs, tuple((s, str(d)) for s, d in ins), tuple((s, str(d)) for s, d in outs))
    with _PLAN_LOCK:  # programs may be lowered on several threads
        found = _PLAN_IDS.get(key)
        if found is None:
            values = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs}
            _PLANS.append(Plan(len(_PLANS), kind, values, [(s, np.dtype(d)) for s, d in ins], [(s, np.dtype(d)) for s, d in outs]))
            found = _PLAN_IDS[key] = len(_PLANS) - 1
    if found >> _INDEX_BITS:
        raise RuntimeError(f"more than {1 << _INDEX_BITS} distinct gpucoll call sites in one process")
    return (_TAG << _INDEX_BITS) | found


Bufs = list[Buffer]


def _arr(buf: Buffer) -> Any:
    """The op's operand as the group takes it: a host buffer's NumPy view (a host array
    of a kind run before takes the group's NumPy runner: no Buffer, no look-up), a
    device buffer itself."""
    return buf if buf.is_cuda else buf.owner


def _copy(dst: Buffer, src: Buffer) -> None:
    """``dst = src`` where XLA gave an op an output apart from its input."""
    if dst.is_cuda:
        # XLA aliases the in-place ops' output to their input on GPUs (it copies the
        # input first where it is still needed), so this does not happen there.
        raise DistBackendError(f"XLA gave an in-place op an output buffer ({dst.ptr:#x}) that is not its input "
                               f"({src.ptr:#x})")
    np.copyto(dst.owner, src.owner)  # (a host Buffer's owner is its NumPy view)


def _rows(buf: Buffer) -> list[Any]:
    """The rows (leading axis) of a stacked operand: NumPy views, or device Buffers."""
    if not buf.is_cuda:
        return list(buf.owner)
    n = buf.shape[0]
    step = buf.nbytes // n if n else 0
    return [dataclasses.replace(buf, ptr=buf.ptr + i * step, nbytes=step, shape=buf.shape[1:]) for i in range(n)]


def _all_reduce(p: Plan, ins: Bufs, outs: Bufs) -> None:
    if outs[0].ptr == ins[0].ptr:  # XLA aliased the output to the input
        p.pg.all_reduce(_arr(outs[0]), OPS[p.attrs["op"]])
    else:
        p.pg._all_reduce_into(outs[0], ins[0], OPS[p.attrs["op"]])


def _broadcast(p: Plan, ins: Bufs, outs: Bufs) -> None:
    if p.pg.rank() == p.attrs["root"] and outs[0].ptr != ins[0].ptr:
        _copy(outs[0], ins[0])
    p.pg.broadcast(outs[0], p.attrs["root"])


def _reduce(p: Plan, ins: Bufs, outs: Bufs) -> None:
    if outs[0].ptr != ins[0].ptr:
        _copy(outs[0], ins[0])
    p.pg.reduce(outs[0], p.attrs["root"], OPS[p.attrs["op"]])


def _all_gather(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.all_gather_single(outs[0], ins[0])


def _reduce_scatter(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.reduce_scatter_single(outs[0], ins[0], OPS[p.attrs["op"]])


def _all_to_all_single(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.all_to_all_single(outs[0], ins[0], p.attrs.get("out_splits"), p.attrs.get("in_splits"))


def _gather(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.gather(ins[0], _rows(outs[0]) if outs else None, p.attrs["root"])


def _scatter(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.scatter(outs[0], _rows(ins[0]) if p.pg.rank() == p.attrs["root"] else None, p.attrs["root"])


def _send(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.send(ins[0], p.attrs["peer"], p.attrs["tag"], async_op=False)


def _recv(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.recv(outs[0], None if p.attrs["peer"] < 0 else p.attrs["peer"], p.attrs["tag"], async_op=False)


def _barrier(p: Plan, ins: Bufs, outs: Bufs) -> None:
    p.pg.barrier()
    if outs and outs[0].ptr != ins[0].ptr:
        _copy(outs[0], ins[0])


Runner = Callable[[Plan, Bufs, Bufs], None]
RUNNERS: dict[str, Runner] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter, "all_to_all_single": _all_to_all_single, "gather": _gather,
    "scatter": _scatter, "send": _send, "recv": _recv, "barrier": _barrier,
}

# Byte offsets in XLA's structs (c_api.h), read with from_address: cheaper than ctypes casts.
_DATA = A.Buffer.data.offset            # XLA_FFI_Buffer.data
_VALUE = A.Scalar.value.offset          # XLA_FFI_Scalar.value
_ptr = C.c_void_p.from_address
_i64 = C.c_int64.from_address


def _plan_of(attrs: A.Attrs) -> Plan:
    if attrs.size != 1 or attrs.types[0] != A.ATTR_SCALAR:
        raise TypeError("expected one integer attribute (the call's plan)")
    value = _i64(_ptr(attrs.attrs[0] + _VALUE).value or 0).value
    if value >> _INDEX_BITS != _TAG:
        raise RuntimeError("this program was compiled by another process (its gpucoll calls name that "
                           "process's groups): compile it in this one (no persistent compilation cache)")
    return _PLANS[value & ((1 << _INDEX_BITS) - 1)]


def _buffers(p: Plan, ptrs: Any, shapes: list[tuple[tuple[int, ...], np.dtype[Any]]], base: int) -> Bufs:
    return [p.buffer(base + i, shape, dtype, _ptr(ptrs[i] + _DATA).value or 0)
            for i, (shape, dtype) in enumerate(shapes)]  # the token (last) is left out


def _error(frame: A.CallFrame, message: str) -> int:
    args = A.ErrorCreateArgs(struct_size=A.struct_size(A.ErrorCreateArgs), message=message.encode(),
                             errc=A.ERROR_INTERNAL)
    return int(frame.api.contents.error_create(C.byref(args)) or 0)


def _answered_metadata(frame: A.CallFrame) -> bool:
    """XLA asks which FFI API version the handler speaks (at registration): answered."""
    ext = frame.extension_start
    if not (ext and ext.contents.type == A.EXTENSION_METADATA):
        return False
    md = C.cast(ext, C.POINTER(A.MetadataExtension)).contents.metadata.contents
    md.api_version.major_version = A.API_MAJOR
    md.api_version.minor_version = A.API_MINOR
    md.traits = 0
    return True


def _handler(kind: str, body: Callable[[A.CallFrame, Plan], int | None]) -> Any:
    """An XLA_FFI_Handler: answers the metadata query, runs ``body`` at the execute
    stage, and turns any exception into XLA's error naming the op."""

    def handler(frame_ptr: Any) -> int | None:
        frame = frame_ptr.contents
        if _answered_metadata(frame) or frame.stage != A.STAGE_EXECUTE:
            return None
        try:
            return body(frame, _plan_of(frame.attrs))
        except BaseException as exc:  # an exception must not cross into XLA: it becomes XLA's error
            return _error(frame, f"gpucoll.functional.{kind} inside jax.jit failed: {type(exc).__name__}: {exc}")

    return A.Handler(handler)


def _make_handler(kind: str) -> Any:
    run = RUNNERS[kind]
    collective = kind not in native.P2P

    def body(frame: A.CallFrame, p: Plan) -> int | None:
        if collective:
            # the group's channel (set up at its first collective inside jit): an op the
            # compiled handler runs goes there; any other takes its step there (the
            # signature check), then runs here
            ch = native.channel_for(p.pg)
            if ch.ptr is not None:
                if native.register(p.index, p, ch):
                    return native.run(C.addressof(frame), p.index) or None
                native.round_(p.index)
        run(p, _buffers(p, frame.args.args, p.ins, 0), _buffers(p, frame.rets.rets, p.outs, len(p.ins)))
        return None

    return _handler(kind, body)


# ----- on GPUs: the group's NCCL op on XLA's stream -----
class XlaStream:
    """XLA's CUDA stream during one call, as a Work holds a producer's stream (``ptr``):
    the op waits for what XLA queued before it, and ``wait()`` makes this stream wait
    for the op, so XLA's later work (and its reuse of the buffers) follows it. No host
    synchronisation."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_DEVICE_ORDINAL_END = A.Api.device_ordinal_get.offset + C.sizeof(C.c_void_p)


def _stream_and_device(frame: A.CallFrame) -> tuple[int, int]:
    """The call's CUDA stream and device ordinal, from XLA's FFI API."""
    api = frame.api.contents
    if api.struct_size < _DEVICE_ORDINAL_END:
        raise DistBackendError(f"this XLA's FFI API ({api.struct_size} bytes) lacks XLA_FFI_DeviceOrdinal_Get")
    sargs = A.StreamGetArgs(struct_size=A.struct_size(A.StreamGetArgs), ctx=frame.ctx)
    dargs = A.DeviceOrdinalGetArgs(struct_size=A.struct_size(A.DeviceOrdinalGetArgs), ctx=frame.ctx)
    if api.stream_get(C.byref(sargs)) or api.device_ordinal_get(C.byref(dargs)):
        raise DistBackendError("XLA did not give the call its CUDA stream and device")
    return int(sargs.stream or 0), int(dargs.device_ordinal)


def _device_buffers(ptrs: Any, shapes: list[tuple[tuple[int, ...], np.dtype[Any]]], device: int, stream: int,
                    owner: XlaStream) -> Bufs:
    where = Device("cuda", device)
    return [Buffer(_ptr(ptrs[i] + _DATA).value or 0, math.prod(shape) * dtype.itemsize, DTYPES[dtype.name],
                   tuple(shape), where, False, stream, None, owner)
            for i, (shape, dtype) in enumerate(shapes)]  # the token (last) is left out


def make_gpu_handler(kind: str) -> Any:
    """The CUDA platform's handler of ``kind``: XLA's device buffers go straight to the
    group's NCCL backend, ordered on XLA's stream (see :class:`XlaStream`)."""
    run = RUNNERS[kind]

    def body(frame: A.CallFrame, p: Plan) -> None:
        stream, device = _stream_and_device(frame)
        owner = XlaStream(stream)
        run(p, _device_buffers(frame.args.args, p.ins, device, stream, owner),
            _device_buffers(frame.rets.rets, p.outs, device, stream, owner))

    return _handler(kind, body)


_HANDLERS: dict[tuple[str, str], Any] = {}  # kept alive: XLA holds raw pointers to these callbacks


def target(kind: str, platform: str = "cpu") -> str:
    """The FFI target name of ``kind``, registered with XLA for ``platform`` ("cpu" or
    "cuda") on first use. On the CPU: the compiled handler (native.c) for the kinds it
    runs, when it loads (it hands the calls it does not run to the Python handler), else
    the Python handler. On CUDA: :func:`make_gpu_handler`'s."""
    name = f"gpucoll_{kind}"
    if (kind, platform) not in _HANDLERS:
        import jax

        A.check_sizes()
        fn: Any
        if platform == "cuda":
            fn = _HANDLERS[kind, platform] = make_gpu_handler(kind)
        else:
            fn = _HANDLERS[kind, platform] = _make_handler(kind)
            lib = native.library() if kind in native.KINDS else None
            if lib is not None:
                lib.gcj_fallback(native.KINDS[kind], C.cast(fn, C.c_void_p))
                fn = getattr(lib, f"gcj_{kind}")
        capsule = jax.ffi.pycapsule(fn)  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA" if platform == "cuda" else "cpu")
    return name

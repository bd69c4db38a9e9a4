"""Collectives inside jax.jit on GPUs, as far as the fake GPU reaches: the CUDA
platform's FFI handler (gpucoll/_jax/handler.py, make_gpu_handler) called with an XLA
call frame made here, its buffers in fake device memory, its stream a fake stream.

What is checked: the op waits for what XLA queued on its stream before the call; XLA's
later work on that stream sees the result; the handler returns without blocking the
host (XLA's stream is held shut by a task while it runs); results equal NumPy's; a
failed op is XLA's error carrying the op's name. JAX itself is not needed (the
frame is built with the ctypes mirrors of c_api.h); tests/gpu runs jitted programs on
a real GPU.
"""

from __future__ import annotations

import ctypes as C
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._buffer import DTYPES, Buffer
from gpucoll._jax import ffi_api as A
from gpucoll._jax import handler
from gpucoll._reduce_op import ReduceOp

from _fake_gpu_world import run_groups
from _nccl_fake import FakeRuntime, FakeStream, device_array, read_on_stream

F32 = np.dtype("float32")


class Frame:
    """An XLA_FFI_CallFrame for one call: its API table answers the stream and device
    queries, records created errors; every struct is kept alive here."""

    def __init__(self, plan: int, ins: list[Buffer], outs: list[Buffer], stream: int, device: int = 0) -> None:
        self.errors: list[str] = []
        self._fns = (A.StreamGet(self._stream_get), A.DeviceOrdinalGet(self._device_get),
                     A.ErrorCreate(self._error_create))
        self.stream, self.device = stream, device
        self.api = A.Api(struct_size=C.sizeof(A.Api), error_create=self._fns[2], stream_get=self._fns[0],
                         device_ordinal_get=self._fns[1])
        self._keep: list[Any] = []
        value = C.c_int64(plan)
        scalar = A.Scalar(dtype=5, value=C.cast(C.pointer(value), C.c_void_p))
        attrs = A.Attrs(struct_size=A.struct_size(A.Attrs), size=1, types=(C.c_int * 1)(A.ATTR_SCALAR),
                        attrs=(C.c_void_p * 1)(C.addressof(scalar)))
        self._keep += [value, scalar, attrs.types, attrs.attrs]
        self.frame = A.CallFrame(struct_size=A.struct_size(A.CallFrame), api=C.pointer(self.api), ctx=None,
                                 stage=A.STAGE_EXECUTE, args=self._list(A.Args, ins), rets=self._list(A.Rets, outs),
                                 attrs=attrs)

    def _list(self, cls: Any, bufs: list[Buffer]) -> Any:
        structs = [A.Buffer(struct_size=A.struct_size(A.Buffer), dtype=11, data=b.ptr, rank=0) for b in bufs]
        structs.append(A.Buffer(struct_size=A.struct_size(A.Buffer), dtype=17, data=None, rank=0))  # the token
        types = (C.c_int * len(structs))(*([0] * len(structs)))
        ptrs = (C.c_void_p * len(structs))(*[C.addressof(s) for s in structs])
        self._keep += [structs, types, ptrs]
        return cls(struct_size=A.struct_size(cls), size=len(structs), types=types, **{cls._fields_[-1][0]: ptrs})

    def _stream_get(self, args: Any) -> None:
        args.contents.stream = self.stream
        return None

    def _device_get(self, args: Any) -> None:
        args.contents.device_ordinal = self.device
        return None

    def _error_create(self, args: Any) -> int:
        self.errors.append(args.contents.message.decode())
        return 1

    def call(self, fn: Any) -> Any:
        return fn(C.pointer(self.frame))


def plan(kind: str, pg: Any, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]], **attrs: int) -> int:
    values = tuple(sorted({"group": handler.group_handle(pg), **attrs}.items()))
    return handler.plan_id(kind, values, [(s, F32) for s in ins], [(s, F32) for s in outs])


def behind_a_gate(rt: FakeRuntime, xla: FakeStream, buf: Buffer, values: np.ndarray,
                  gate: threading.Event) -> None:
    """XLA's earlier work: once the gate opens, its stream writes ``values`` into ``buf``."""
    def fill() -> None:
        gate.wait(20)
        rt.fabric.mem.view(buf.ptr, buf.nbytes)[:] = values.reshape(-1).view(np.uint8)
    xla.enqueue(fill)


def _body(pg: Any, rt: FakeRuntime, rank: int) -> str:
    n = pg.size()
    xla = FakeStream(rt.fabric, "xla", 0)

    def zeros(count: int) -> Buffer:
        return device_array(rt, np.zeros(count, F32), DTYPES["float32"])

    def run(kind: str, ins: list[Buffer], outs: list[Buffer], values: np.ndarray, **attrs: int) -> Frame:
        """One call with XLA's stream held shut until the handler returned."""
        gate = threading.Event()
        behind_a_gate(rt, xla, ins[0], values, gate)
        frame = Frame(plan(kind, pg, [b.shape for b in ins], [b.shape for b in outs], **attrs), ins, outs, xla.ptr)
        t0 = time.monotonic()
        assert frame.call(handler.make_gpu_handler(kind)) is None, frame.errors
        assert time.monotonic() - t0 < 5.0  # it returned while XLA's stream was still shut: no host wait
        gate.set()
        # XLA keeps its buffers until its stream has passed the op: so does the test
        read_on_stream(rt, ins[0], F32, stream=xla.ptr).get(timeout=20)
        return frame

    def seen(buf: Buffer) -> np.ndarray:
        """``buf`` as XLA's next kernel on its stream reads it."""
        return read_on_stream(rt, buf, F32, stream=xla.ptr).get(timeout=20)

    data = [np.arange(6, dtype=F32) * (k + 1) + k for k in range(n)]
    # all_reduce in place (XLA aliases the output to the input)
    x = zeros(6)
    run("all_reduce", [x], [x], data[rank], op=handler.OPS.index(ReduceOp.SUM))
    np.testing.assert_array_equal(seen(x), sum(data))
    x = zeros(6)
    run("all_reduce", [x], [x], data[rank], op=handler.OPS.index(ReduceOp.MAX))
    np.testing.assert_array_equal(seen(x), np.maximum.reduce(data))
    # broadcast from the last rank
    x = zeros(6)
    run("broadcast", [x], [x], data[rank], root=n - 1)
    np.testing.assert_array_equal(seen(x), data[n - 1])
    # all_gather into its own output (n, 6)
    x, out = zeros(6), device_array(rt, np.zeros((n, 6), F32), DTYPES["float32"])
    run("all_gather", [x], [out], data[rank])
    np.testing.assert_array_equal(seen(out), np.stack(data))
    # gather to rank 0: its output's rows are the device buffers the group fills
    x = zeros(6)
    outs = [device_array(rt, np.zeros((n, 6), F32), DTYPES["float32"])] if rank == 0 else []
    run("gather", [x], outs, data[rank], root=0)
    if rank == 0:
        np.testing.assert_array_equal(seen(outs[0]), np.stack(data))
    # a ring of send and recv
    if n > 1:
        x, got = zeros(6), zeros(6)
        frames = []
        if rank % 2 == 0:
            frames.append(run("send", [x], [], data[rank], peer=(rank + 1) % n, tag=0))
        src = (rank - 1) % n
        gate = threading.Event()
        gate.set()
        frames.append(Frame(plan("recv", pg, [(6,)], [(6,)], peer=src, tag=0), [got], [got], xla.ptr))
        assert frames[-1].call(handler.make_gpu_handler("recv")) is None, frames[-1].errors
        if rank % 2 == 1:
            frames.append(run("send", [x], [], data[rank], peer=(rank + 1) % n, tag=0))
        np.testing.assert_array_equal(seen(got), data[src])
    # a failure is XLA's error, carrying the op's name (a buffer on another device)
    bad = Frame(plan("all_reduce", pg, [(6,)], [(6,)], op=0), [x], [x], xla.ptr, device=3)
    err = bad.call(handler.make_gpu_handler("all_reduce"))
    assert err == 1 and len(bad.errors) == 1, bad.errors
    assert bad.errors[0].startswith("gpucoll.functional.all_reduce inside jax.jit failed: "), bad.errors
    assert "cuda:0" in bad.errors[0], bad.errors
    return "ok"


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_gpu_handler_runs_the_nccl_op_on_xla_stream_without_a_host_wait(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_groups(size, _body, monkeypatch, timeout=20.0) == ["ok"] * size

"""The array layer's CuPy fast path (gpucoll/_buffer.py, ``from_cupy``): a ``cupy.ndarray``
is described from its attributes instead of its ``__cuda_array_interface__``, and the
Buffer must be the one the CAI path makes of what CuPy publishes (cupy/_core/core.pyx:
shape, ``dtype.str``, strides None when C-contiguous, data ``(ptr, False)`` with 0 for an
empty array, version 3, stream = CuPy's current stream with 0 spelled 1, or 2 under
per-thread default streams).

Without a GPU, real ``cupy.ndarray`` objects are made over memory CuPy does not own
(``UnownedMemory``): their attributes work, their CAI and DLPack calls do not (CuPy asks
the driver for the current stream). CuPy's current stream is therefore a stand-in here,
for both paths; the reference is ``_from_cai`` given the CAI dict built as CuPy builds it.
tests/gpu/test_nccl_gpu_review.py compares the two paths on a GPU with CuPy's own CAI.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np
import pytest

from gpucoll import _buffer as buffer_mod
from gpucoll import array as array_mod
from gpucoll._buffer import Buffer
from gpucoll.array import NotContiguousError, as_buffer

from _fake_arrays import FakeCudaArray

cupy = pytest.importorskip("cupy")


class _Stream:
    """Stands for a ``cupy.cuda.Stream``: its ``ptr`` is what CuPy's CAI would publish."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


@pytest.fixture
def current(monkeypatch: pytest.MonkeyPatch) -> list[_Stream]:
    """CuPy's current stream for both paths (``current[0]``; the legacy default stream at
    first), and the fast path set up as the first CuPy array would set it up."""
    streams = [_Stream(0)]
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda *a: streams[0])  # _hold_stream's look-up
    monkeypatch.setattr(array_mod, "_cupy_ndarray", None)
    monkeypatch.setattr(buffer_mod, "_cupy_stream", None)
    monkeypatch.setattr(buffer_mod, "_cupy_default_stream", 1)
    array_mod._set_cupy_fast_path()
    assert array_mod._cupy_ndarray is cupy.ndarray
    monkeypatch.setattr(buffer_mod, "_cupy_stream", lambda: streams[0])
    return streams


def _cupy_array(shape: tuple[int, ...], dtype: Any, ptr: int = 0x7F0000000000, device: int = 0) -> Any:
    """A real cupy.ndarray over memory no one allocated (never read or written here)."""
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, None, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _cupy_cai(a: Any) -> dict[str, Any]:
    """``a.__cuda_array_interface__`` as CuPy (v3, CUDA) writes it, with the stand-in stream."""
    stream = buffer_mod._cupy_stream().ptr or buffer_mod._cupy_default_stream
    return {"shape": a.shape, "typestr": a.dtype.str, "descr": a.dtype.descr, "stream": stream, "version": 3,
            "strides": None if a.flags.c_contiguous else a.strides,
            "data": (a.data.ptr if a.size > 0 else 0, False)}


def _fields(buf: Buffer) -> tuple[Any, ...]:
    return (buf.ptr, buf.nbytes, buf.dtype, buf.shape, buf.device, buf.readonly, buf.stream, id(buf.owner),
            id(buf.stream_owner), buf.foreign_stream)


def _reference(a: Any, writable: bool = True) -> Buffer:
    return array_mod._from_cai(a, _cupy_cai(a), "tensor", writable)


def _arrays() -> list[Any]:
    base = _cupy_array((16, 16), np.float32)
    arrays = [
        base,
        _cupy_array((256,), np.float32),
        _cupy_array((3, 5, 7), np.int64, device=1),
        _cupy_array((0,), np.float32),
        _cupy_array((1,), np.bool_),
        _cupy_array((8,), np.float16),
        _cupy_array((4, 2), np.complex64),
        _cupy_array((33,), np.uint8),
        base[3:5],                     # a contiguous view: another pointer into the same memory
        base.reshape(-1)[17:],         # a view at an odd element offset
        base.view(np.int32),           # the same memory as another dtype
        base.reshape(256, 1)[4:9],     # a column of one: C-contiguous
    ]
    try:
        import ml_dtypes
        arrays.append(_cupy_array((6,), ml_dtypes.bfloat16))  # opaque typestr "<V2" in the CAI path
    except ImportError:
        pass
    return arrays


@pytest.mark.parametrize("stream_ptr", [0, 0x9000])
def test_a_cupy_array_gives_the_buffer_of_its_cai(current: list[_Stream], stream_ptr: int) -> None:
    current[0] = _Stream(stream_ptr)
    for a in _arrays():
        got = as_buffer(a, writable=True)
        want = _reference(a)
        assert _fields(got) == _fields(want), (a.shape, a.dtype, a.strides)
        assert got.owner is a
        if stream_ptr:
            assert got.stream == stream_ptr and got.stream_owner is current[0] and not got.foreign_stream
        else:
            assert got.stream is None and got.stream_owner is None


def test_per_thread_default_stream_as_the_cai_says(current: list[_Stream],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM CuPy's CAI publishes 2 for the default
    # stream, whose handle gpucoll cannot hold: the general path marks it foreign.
    monkeypatch.setattr(buffer_mod, "_cupy_default_stream", 2)
    a = _cupy_array((64,), np.float32)
    got = as_buffer(a, writable=True)
    assert _fields(got) == _fields(_reference(a))
    assert got.stream == 2 and got.foreign_stream


def test_the_array_is_read_anew_on_every_call(current: list[_Stream]) -> None:
    """Nothing is cached per array: an in-place reshape, a new stream, a freed array whose
    id and memory a new array of another dtype and shape reuses, all show at once."""
    a = _cupy_array((256,), np.float32)
    first = as_buffer(a, writable=True)
    a.shape = (16, 16)
    assert as_buffer(a, writable=True).shape == (16, 16)
    current[0] = _Stream(0x9100)
    assert as_buffer(a, writable=True).stream == 0x9100
    current[0] = _Stream(0)
    seen: set[int] = set()
    reused = False
    for _ in range(50):  # CPython reuses a freed object's slot for the next of its size
        old_id = id(a)
        del a
        gc.collect()
        a = _cupy_array((4, 8), np.int16, ptr=first.ptr)
        got = as_buffer(a, writable=True)
        assert (got.ptr, got.shape, got.dtype.name, got.nbytes) == (first.ptr, (4, 8), "int16", 64)
        assert _fields(got) == _fields(_reference(a))
        reused = reused or id(a) == old_id
        seen.add(id(a))
    assert reused or len(seen) > 1


def test_non_contiguous_cupy_arrays_go_the_general_way(current: list[_Stream]) -> None:
    base = _cupy_array((16, 16), np.float32)
    for view in (base[:, :8], base[::2], base.T, base.reshape(16, 16)[:, :1]):
        assert buffer_mod.from_cupy(view) is None
        # The CAI path words the error (as before); its strides come from the array.
        with pytest.raises(NotContiguousError, match="C-contiguous"):
            _reference(view)


def test_a_failing_stream_lookup_goes_the_general_way(current: list[_Stream],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("no CUDA driver")
    monkeypatch.setattr(buffer_mod, "_cupy_stream", broken)
    assert buffer_mod.from_cupy(_cupy_array((4,), np.float32)) is None


def test_cupy_subclasses_and_other_kinds_take_their_own_paths(current: list[_Stream]) -> None:
    class Sub(cupy.ndarray):  # type: ignore[misc, name-defined]
        pass

    a = _cupy_array((8,), np.float32)
    sub = a.view(Sub)
    assert type(sub) is Sub and type(sub) is not array_mod._cupy_ndarray
    host = np.arange(8, dtype=np.float32)
    fake = FakeCudaArray(host, stream=0x5000)
    buf = as_buffer(fake, writable=True)
    assert (buf.ptr, buf.shape, buf.stream, buf.owner) == (host.ctypes.data, (8,), 0x5000, fake)
    assert as_buffer(host).owner is host


def test_the_fast_path_is_off_unless_cupy_publishes_cai_v3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(array_mod, "_cupy_ndarray", None)
    monkeypatch.setattr(buffer_mod, "_cupy_stream", None)
    monkeypatch.setattr(buffer_mod, "_cupy_default_stream", 1)
    monkeypatch.setattr(cupy._util, "CUDA_ARRAY_INTERFACE_EXPORT_VERSION", 2)
    array_mod._set_cupy_fast_path()
    assert array_mod._cupy_ndarray is None and buffer_mod.cupy_fast_path() is None
    monkeypatch.setattr(cupy._util, "CUDA_ARRAY_INTERFACE_EXPORT_VERSION", 3)
    monkeypatch.setattr(cupy.cuda.runtime, "is_hip", True)
    assert buffer_mod.cupy_fast_path() is None
    monkeypatch.setattr(cupy.cuda.runtime, "is_hip", False)
    assert buffer_mod.cupy_fast_path() is cupy.ndarray


@pytest.mark.parametrize("size", [2, 3])
def test_process_group_all_reduce_of_cupy_arrays_on_the_fake_gpu(current: list[_Stream], size: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy arrays over the fake GPU's memory, all-reduced by a ProcessGroup on its NCCL
    backend, on the default stream and on a stream of the caller's, repeatedly (the plan
    and the backend's hot path are taken from the second call on): every result as NumPy
    computes it, read in stream order."""
    import threading

    from _fake_gpu_world import run_groups
    from _nccl_fake import FakeStream, read_on_stream

    streams: dict[str, int] = {}
    monkeypatch.setattr(buffer_mod, "_cupy_stream",
                        lambda: _Stream(streams.get(threading.current_thread().name, 0)))

    def body(pg: Any, rt: Any, rank: int) -> list[str]:
        bad: list[str] = []
        blocks: list[Any] = []  # the fake memory, alive until the body ends
        mine = FakeStream(rt.fabric, "caller", 0)
        for step in range(6):
            if step == 3:  # the caller switches to a stream of its own
                rt.set_current_stream(mine.ptr)
                streams[threading.current_thread().name] = mine.ptr
            for shape, dtype in (((256,), np.float32), ((3, 4), np.int64)):
                host = np.full(shape, rank + 1 + step, dtype)
                block = rt.fabric.mem.alloc(host.nbytes)
                rt.fabric.mem.view(block.ptr, host.nbytes)[:] = host.reshape(-1).view(np.uint8)
                x = _cupy_array(shape, dtype, ptr=block.ptr)
                buf = as_buffer(x, writable=True)
                assert buf.stream == (mine.ptr if step >= 3 else None)
                pg.all_reduce(x)
                got = read_on_stream(rt, buf, dtype).get(timeout=10)
                want = np.full(shape, sum(r + 1 + step for r in range(size)), dtype)
                if not np.array_equal(got, want):
                    bad.append(f"step {step} {dtype.__name__}: got {got.reshape(-1)[:3]}, want {want.reshape(-1)[:3]}")
                blocks.append(block)
        return bad

    results = run_groups(size, body, monkeypatch)
    assert results == [[] for _ in range(size)]


@pytest.mark.parametrize("size", [1, 3])
def test_a_declined_quiet_op_keeps_its_number_and_entry(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """ProcessGroup.all_reduce's Work-less lane (Issuer.call_quiet): where the backend
    declines the quiet form (the array's producer stream is not the caller's), the op is
    issued the usual way under the number and flight-recorder entry it was given; quiet
    and declined ops alternate, every op takes exactly one sequence number, the recorder
    shows them in order and completed, and every result is NumPy's."""
    from _fake_gpu_world import FakeDeviceArray, run_groups
    from _nccl_fake import FakeStreamArray, read_on_stream

    def body(pg: Any, rt: Any, rank: int) -> list[str]:
        bad: list[str] = []
        keep: list[Any] = []
        for step in range(8):
            host = np.full(64, rank + step, np.float32)
            x: Any = FakeStreamArray(rt, host) if step % 2 else FakeDeviceArray(rt, host)
            keep.append(x)
            before = pg.get_sequence_number()
            assert pg.all_reduce(x) is None
            if pg.get_sequence_number() != before + 1:
                bad.append(f"step {step}: sequence {before} -> {pg.get_sequence_number()}")
            got = read_on_stream(rt, x.buf, np.float32).get(timeout=10)
            want = np.full(64, sum(r + step for r in range(size)), np.float32)
            if not np.array_equal(got, want):
                bad.append(f"step {step}: got {got[:3]}, want {want[:3]}")
        deadline = time.monotonic() + 10
        while True:  # the device finishes the last ops a little later; the backend completes them when polled
            entries = [e for e in pg._issuer.recorder._in_order() if e.op_type == "all_reduce"]
            if all(e.state == "completed" for e in entries) or time.monotonic() > deadline:
                break
            pg._nccl.poll_pending()
            time.sleep(0.01)
        seqs = [e.seq for e in entries]
        if seqs != list(range(seqs[0], seqs[0] + 8)) or len(seqs) != 8:
            bad.append(f"recorded seqs {seqs}")
        states = {e.state for e in entries}
        if states != {"completed"}:
            bad.append(f"recorder states {states}")
        return bad

    results = run_groups(size, body, monkeypatch)
    assert results == [[] for _ in range(size)]

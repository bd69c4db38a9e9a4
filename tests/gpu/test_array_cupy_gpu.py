"""The array layer's CuPy fast path on a real GPU: for CuPy arrays of every kind, on the
default stream and on a stream of the caller's, the Buffer read from the array's
attributes is the one the CAI path makes of CuPy's own ``__cuda_array_interface__``
(tests/api/test_array_fast_paths.py checks the same without a GPU, with CuPy's CAI
rebuilt). ``pytest -m gpu tests/gpu --require-gpu``.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpucoll.testing import run_spmd

pytestmark = pytest.mark.gpu


def _fields(buf: Any) -> tuple[Any, ...]:
    held = buf.stream_owner  # CuPy's Stream object (each path looks it up): compared by its handle
    return (buf.ptr, buf.nbytes, buf.dtype, buf.shape, buf.device, buf.readonly, buf.stream, id(buf.owner),
            None if held is None else int(held.ptr), buf.foreign_stream)


def fast_path_body() -> list[str]:
    import cupy

    from gpucoll import _buffer, array

    bad: list[str] = []
    base = cupy.arange(256, dtype=cupy.float32).reshape(16, 16)
    arrays = [base, cupy.zeros(0, cupy.float32), cupy.ones((3, 5), cupy.int64), base[3:5], base.reshape(-1)[17:],
              base.view(cupy.int32), cupy.zeros(7, cupy.float16), cupy.zeros(4, cupy.complex64)]
    array.as_buffer(base)  # sets the fast path up
    if array._cupy_ndarray is not cupy.ndarray:
        return ["the CuPy fast path was not set up"]
    side = cupy.cuda.Stream(non_blocking=True)
    for stream in (None, side):
        with (stream if stream is not None else cupy.cuda.Stream.null):
            for a in arrays:
                fast = _buffer.from_cupy(a)
                general = array._from_cai(a, a.__cuda_array_interface__, "tensor", True)
                if fast is None or _fields(fast) != _fields(general):
                    bad.append(f"{a.shape} {a.dtype} on {stream}: fast {fast}, CAI {general}")
    for view in (base[:, :8], base[::2], base.T):
        if _buffer.from_cupy(view) is not None:
            bad.append(f"non-contiguous {view.shape} {view.strides} taken by the fast path")
        try:
            array.as_buffer(view, writable=True)
            bad.append(f"non-contiguous {view.shape} {view.strides} accepted")
        except array.NotContiguousError:
            pass
    return bad


def test_the_cupy_fast_path_gives_the_buffer_of_cupys_cai() -> None:
    assert run_spmd(fast_path_body, 1, timeout=120.0, init=False) == [[]]

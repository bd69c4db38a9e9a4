"""What describing an array costs (``gpucoll.array.as_buffer``), per kind of array.

Times ``as_buffer(x, writable=True)`` for a NumPy array, an object that publishes
``__cuda_array_interface__`` from Python (as Numba's and this repository's fakes do),
and a ``cupy.ndarray`` through the CuPy fast path (read from the array's attributes).
With a GPU, the CuPy array is also timed with the fast path off (CuPy's own CAI dict,
then the general reading of it: the path every CuPy array took before), in the same
process, interleaved. Without a GPU the CuPy array is made over memory CuPy does not own
and CuPy's current-stream look-up (which asks the driver) is stood in for by a Python
function returning the legacy default stream; the "fast path off" row needs a GPU.

Then ``ProcessGroup.all_reduce`` of each device kind on the NCCL backend over the
no-op runtime of ``nccl_python_overhead_bench.py`` (gpucoll's Python, nothing else).

Usage::

    python bench/array_layer_bench.py [--calls 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from gpucoll import _buffer as buffer_mod  # noqa: E402
from gpucoll import array as array_mod  # noqa: E402


class _DefaultStream:
    ptr = 0  # CuPy's legacy default stream


class _Off:
    """Stands where ``cupy.ndarray`` is looked for: no array is of this type, so every
    CuPy array takes the general path."""


def _per_call_us(rows: dict[str, Callable[[], Any]], calls: int, repeat: int) -> dict[str, float]:
    """Median µs per call of each row, the rows interleaved in each of ``repeat`` rounds."""
    for f in rows.values():
        for _ in range(min(calls, 2000)):
            f()
    got: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeat):
        for name, f in rows.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            got[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per timed run")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds; the median is reported")
    args = ap.parse_args(argv)

    import cupy

    from nccl_python_overhead_bench import DeviceArray, NoopRuntime

    gpu = True
    try:
        x = cupy.zeros(256, cupy.float32)
        x.__cuda_array_interface__
    except Exception:  # noqa: BLE001  (no GPU here)
        gpu = False
        mem = cupy.cuda.UnownedMemory(0x200000, 1024, None, 0)
        x = cupy.ndarray((256,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    as_buffer = array_mod.as_buffer
    host = np.zeros(256, np.float32)
    cai = DeviceArray()
    array_mod._set_cupy_fast_path()
    assert array_mod._cupy_ndarray is cupy.ndarray, "CuPy's fast path is off here (CAI version 2, or ROCm)"
    if not gpu:
        buffer_mod._cupy_stream = lambda: _DefaultStream

    def cupy_off() -> Any:
        saved = array_mod._cupy_ndarray
        array_mod._cupy_ndarray = _Off
        try:
            return as_buffer(x, writable=True)
        finally:
            array_mod._cupy_ndarray = saved

    rows: dict[str, Callable[[], Any]] = {
        "as_buffer(numpy.ndarray)": lambda: as_buffer(host, writable=True),
        "as_buffer(CAI object, Python property)": lambda: as_buffer(cai, writable=True),
        "as_buffer(cupy.ndarray), fast path": lambda: as_buffer(x, writable=True),
    }
    if gpu:
        rows["as_buffer(cupy.ndarray), fast path off (CuPy's CAI)"] = cupy_off

    from gpucoll._backends.nccl.backend import NCCLBackend
    from gpucoll._group import ProcessGroup
    from gpucoll._group import registry as group_registry
    from gpucoll.store import HashStore, PrefixStore

    rt = NoopRuntime(20)
    saved = group_registry.BACKENDS["nccl"]
    group_registry.BACKENDS["nccl"] = lambda store, rank, size, *, timeout, group_name, device_id: NCCLBackend(
        store, rank, size, timeout=timeout, group_name=group_name, device_id=device_id, _runtime=rt)
    pg = ProcessGroup(PrefixStore("pg", HashStore()), 0, 1, group_name="g", global_ranks=[0], timeout=60.0,
                      backend="nccl", device_id=0)
    try:
        buf = as_buffer(x, writable=True)
        if not gpu:  # the no-op runtime's device ops: any CuPy array of this process will do
            rows["ProcessGroup.all_reduce(Buffer) (no array layer)"] = lambda: pg.all_reduce(buf)
            rows["ProcessGroup.all_reduce(CAI object)"] = lambda: pg.all_reduce(cai)
            rows["ProcessGroup.all_reduce(cupy.ndarray)"] = lambda: pg.all_reduce(x)
        result = _per_call_us(rows, args.calls, args.repeat)
        rt.finish_all()
        pg._destroy()
    finally:
        group_registry.BACKENDS["nccl"] = saved
    where = "on a GPU" if gpu else "no GPU (CuPy array over unowned memory, stream look-up stood in)"
    print(f"# gpucoll's array layer, µs per call, {where}; median of {args.repeat} interleaved rounds "
          f"x {args.calls} calls")
    print("| call | µs |")
    print("|---|---|")
    for name, us in result.items():
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One launch fills a CuPy bucket from its gradients (``kernels/gather.cu``).

A copy per gradient costs a kernel launch each (6-7 us of host time on an H200: 1 ms
for GPT-2's 148 gradients); CuPy's ``concatenate`` takes many arrays in one kernel only
when they are small (under 2 MiB on average), and uploads their addresses from pageable
memory each time. Here each bucket keeps a table of its parts' addresses and byte
offsets in pinned host memory and on the device; the addresses are uploaded only when
they changed since the last fill (CuPy's memory pool tends to hand a training loop the
same addresses every iteration), then one kernel copies every part.

Ordering: the upload and the kernel go on the caller's current stream, as a copy would.
Before the table is rewritten, the host waits for the event recorded after the last
kernel that read it (so a fill on another stream never races an earlier one), and so
it does before the table and its pinned memory are given back (``close``: the buckets'
rebuild, or the Reducer's end).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DistBackendError

__all__ = ["BucketGather"]

_UNITS = ((16, "u128"), (8, "u64"), (4, "u32"), (2, "u16"), (1, "u8"))
_MAX_GRID_X = 1024
_MAX_GRID_Y = 65535
_BLOCK = 256


class BucketGather:
    """Copies the parts of one bucket (``flat``, whose part ``k`` starts at element
    ``offsets[k]`` and holds ``sizes[k]`` elements) in with one kernel launch.

    ``fill`` returns False (nothing done) where the kernel cannot take the parts: one of
    another dtype or not C-contiguous, or no compiled kernel here; the caller copies
    them another way.
    """

    def __init__(self, flat: Any, offsets: list[int], sizes: list[int]) -> None:
        import cupy

        self._cupy = cupy
        n = len(sizes)
        self.n = n
        self.dtype = flat.dtype
        self.ptr = int(flat.data.ptr)
        self.device = int(flat.device.id)
        itemsize = flat.dtype.itemsize
        bounds = [o * itemsize for o in offsets] + [(offsets[-1] + sizes[-1]) * itemsize]
        # what constrains the copy unit besides the parts' addresses: the bucket's own
        # address, and every part's offset and length in bytes
        low = self.ptr
        for b in bounds:
            low |= b
        self._low = low
        self._largest = max(sizes) * itemsize
        self._pinned = cupy.cuda.alloc_pinned_memory((2 * n + 1) * 8)
        self._host = np.frombuffer(self._pinned, np.uint64, 2 * n + 1)
        self._host[n:] = bounds
        self._table = cupy.empty(2 * n + 1, cupy.uint64)
        self._last: list[int] | None = None  # the addresses the device table holds
        self._done: Any = None  # recorded after the last kernel that read the table
        self.launches = 0
        self._broken = False

    def fill(self, parts: list[Any]) -> bool:
        if self._broken:
            return False
        cupy = self._cupy
        ptrs = []
        low = self._low
        dtype = self.dtype
        for g in parts:
            if g.dtype != dtype or not g.flags.c_contiguous:
                return False
            p = g.data.ptr
            ptrs.append(p)
            low |= p
        unit, name = next(u for u in _UNITS if low % u[0] == 0)
        try:
            kernel = _kernel(name, self.device)
        except Exception:  # noqa: BLE001 - no NVRTC here: the caller copies the parts itself
            self._broken = True
            return False
        try:
            self._launch(cupy, kernel, ptrs, unit)
        except Exception as exc:
            raise DistBackendError(f"Reducer: copying {self.n} gradients into their bucket on GPU {self.device} "
                                   f"failed ({type(exc).__name__}: {exc})") from exc
        self.launches += 1
        return True

    def _launch(self, cupy: Any, kernel: Any, ptrs: list[int], unit: int) -> None:
        stream = cupy.cuda.get_current_stream()
        if ptrs != self._last:
            if self._done is not None:
                self._done.synchronize()  # the last kernel that read the table (and its upload) is over
            self._host[:self.n] = ptrs
            # the whole table (the offsets behind the addresses are uploaded with them)
            cupy.cuda.runtime.memcpyAsync(self._table.data.ptr, self._host.ctypes.data, self._host.nbytes, 1,
                                          stream.ptr)
            self._last = ptrs
        grid_x = min(_MAX_GRID_X, max(1, -(-self._largest // (unit * _BLOCK))))
        kernel((grid_x, min(self.n, _MAX_GRID_Y)), (_BLOCK,),
               (np.uint64(self._table.data.ptr), np.uint64(self.ptr), np.int32(self.n)))
        if self._done is None:
            self._done = cupy.cuda.Event(block=False, disable_timing=True)
        self._done.record(stream)

    def close(self) -> None:
        """Wait for the last kernel that read the table (and the upload before it): the
        table and the pinned memory go back to CuPy's pools, which may hand them to the
        next allocation at once."""
        done, self._done = self._done, None
        if done is not None:
            done.synchronize()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone
            pass


def _kernel(name: str, device: int) -> Any:
    from .._backends.nccl import kernel_loader

    return kernel_loader.get_kernel(f"gpucoll_gather_{name}", device, module="gather")

"""BucketGather (gpucoll/_ddp/gather.py), the one-launch fill of a CuPy bucket, without a
GPU: a CuPy stand-in whose "device" memory is host memory, whose memcpyAsync is a
memmove, and whose kernel launch runs kernels/gather.cu compiled as host C++ over the
launch's whole grid. What it checks is what the GPU would see: the table the kernel
reads (addresses and offsets) uploaded before it is read, uploaded again only when the
addresses change, and a unit of copy that every address, offset and length allows."""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

import numpy as np
import pytest

from _host_kernels import host_library, run_grid


class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Flags:
    def __init__(self, c: bool) -> None:
        self.c_contiguous = c


class HostArray:
    """A 'device' array over host memory: what BucketGather reads of a cupy.ndarray."""

    def __init__(self, nd: np.ndarray) -> None:
        self.nd = nd
        self.dtype = nd.dtype
        self.size = nd.size
        self.flags = _Flags(bool(nd.flags.c_contiguous))
        self.data = _Ptr(nd.ctypes.data)
        self.device = types.SimpleNamespace(id=0)


class FakeCupyForGather:
    """Just enough of CuPy: pinned memory, empty, memcpyAsync, streams, events, and the
    kernel launches (recorded, then run on the host)."""

    uint64 = np.uint64

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int, int]] = []
        self.launches: list[tuple[str, tuple[int, int], tuple[int, ...]]] = []
        self.keep: list[Any] = []
        self.events: list[str] = []
        fake = self

        class _Runtime:
            @staticmethod
            def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
                fake.copies.append((dst, src, size, kind))
                ctypes.memmove(dst, src, size)

        class _Event:
            def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
                pass

            def record(self, stream: Any = None) -> None:
                fake.events.append("record")

            def synchronize(self) -> None:
                fake.events.append("synchronize")

        self.cuda = types.SimpleNamespace(
            runtime=_Runtime, Event=_Event,
            alloc_pinned_memory=lambda n: fake._keep(bytearray(n)),
            get_current_stream=lambda: types.SimpleNamespace(ptr=0))

    def _keep(self, x: Any) -> Any:
        self.keep.append(x)
        return x

    def empty(self, n: int, dtype: Any) -> HostArray:
        return HostArray(self._keep(np.zeros(n, dtype)))


def _launcher(fake: FakeCupyForGather) -> Any:
    def kernel_for(name: str, device: int) -> Any:
        lib = host_library("gather")
        fn = getattr(lib, f"gpucoll_gather_{name}")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]

        def launch(grid: tuple[int, int], block: tuple[int], args: tuple[Any, ...]) -> None:
            fake.launches.append((name, grid, tuple(int(a) for a in args)))
            run_grid(lib, fn, tuple(int(a) for a in args), grid, 2)  # 2 threads a block: the loops stride
        return launch
    return kernel_for


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCupyForGather:
    from gpucoll._ddp import gather

    f = FakeCupyForGather()
    monkeypatch.setitem(sys.modules, "cupy", f)
    monkeypatch.setattr(gather, "_kernel", _launcher(f))
    return f


def _bucket(sizes: list[int], dtype: Any = np.float32) -> tuple[HostArray, list[int]]:
    offsets = [int(x) for x in np.cumsum([0, *sizes[:-1]])]
    nd = np.full(sum(sizes) + 8, -1, dtype)  # 8 guard elements after the bucket
    return HostArray(nd[:sum(sizes)]), offsets


def test_the_first_fill_uploads_the_whole_table_then_copies_every_part(fake: FakeCupyForGather) -> None:
    from gpucoll._ddp.gather import BucketGather

    sizes = [12, 4, 0, 20, 8]
    flat, offsets = _bucket(sizes)
    g = BucketGather(flat, offsets, sizes)
    rng = np.random.default_rng(0)
    parts = [HostArray(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    assert g.fill(parts)
    np.testing.assert_array_equal(flat.nd, np.concatenate([p.nd for p in parts]))
    assert flat.nd.base is not None and (flat.nd.base[sum(sizes):] == -1).all()  # nothing past the bucket
    (dst, _, nbytes, kind), = fake.copies
    assert kind == 1 and nbytes == (2 * len(sizes) + 1) * 8  # addresses and offsets: the whole table
    # the same arrays, new values: no upload, the kernel reads the same addresses
    for p in parts:
        p.nd[...] = p.nd * 3 + 1
    assert g.fill(parts)
    assert len(fake.copies) == 1 and len(fake.launches) == 2 and g.launches == 2
    np.testing.assert_array_equal(flat.nd, np.concatenate([p.nd for p in parts]))
    # other arrays: the addresses go up again
    others = [HostArray(rng.standard_normal(n).astype(np.float32)) for n in sizes]
    assert g.fill(others)
    assert len(fake.copies) == 2
    np.testing.assert_array_equal(flat.nd, np.concatenate([p.nd for p in others]))


@pytest.mark.parametrize("sizes,dtype,unit", [([4, 8, 12], np.float32, "u128"), ([2, 4, 6], np.float32, "u64"),
                                              ([3, 5, 1], np.float32, "u32"), ([3, 5], np.float16, "u16"),
                                              ([3, 5, 7], np.int8, "u8"), ([2, 6], np.float64, "u128")])
def test_the_unit_of_copy_is_the_widest_every_part_allows(fake: FakeCupyForGather, sizes: list[int], dtype: Any,
                                                          unit: str) -> None:
    from gpucoll._ddp.gather import BucketGather

    flat, offsets = _bucket(sizes, dtype)
    assert flat.data.ptr % 16 == 0 or unit != "u128"
    g = BucketGather(flat, offsets, sizes)
    # parts 16-byte aligned (as CuPy's allocations are), so their lengths and offsets decide
    parts = []
    for n in sizes:
        raw = np.zeros(n * np.dtype(dtype).itemsize + 16, np.uint8)
        at = -raw.ctypes.data % 16
        nd = raw[at:at + n * np.dtype(dtype).itemsize].view(dtype)
        nd[...] = np.arange(n) + 1
        parts.append(HostArray(nd))
    assert g.fill(parts)
    assert fake.launches[-1][0] == unit
    np.testing.assert_array_equal(flat.nd, np.concatenate([p.nd for p in parts]))
    # a part starting off the 16-byte grid narrows the unit to what its address allows
    if unit in ("u128", "u64"):
        raw = np.zeros(sizes[0] * np.dtype(dtype).itemsize + 32, np.uint8)
        at = (-raw.ctypes.data % 16) + np.dtype(dtype).itemsize
        odd = raw[at:at + sizes[0] * np.dtype(dtype).itemsize].view(dtype)
        odd[...] = 7
        assert g.fill([HostArray(odd), *parts[1:]])
        assert fake.launches[-1][0] == {4: "u32", 8: "u64"}[np.dtype(dtype).itemsize]
        np.testing.assert_array_equal(flat.nd[:sizes[0]], np.full(sizes[0], 7, dtype))


def test_parts_the_kernel_cannot_take_are_declined(fake: FakeCupyForGather) -> None:
    from gpucoll._ddp.gather import BucketGather

    flat, offsets = _bucket([4, 4])
    g = BucketGather(flat, offsets, [4, 4])
    good = HostArray(np.ones(4, np.float32))
    assert not g.fill([good, HostArray(np.ones(4, np.float64))])  # another dtype
    assert not g.fill([good, HostArray(np.ones(8, np.float32)[::2])])  # not contiguous
    assert fake.launches == [] and fake.copies == []
    assert (flat.nd == -1).all()


def test_the_table_is_rewritten_and_given_back_only_after_its_last_reader(fake: FakeCupyForGather) -> None:
    """New addresses wait for the kernel that read the old table; ``close`` (the buckets'
    rebuild, the Reducer's end) waits for the last one; a failed launch is a
    DistBackendError naming the fill."""
    from gpucoll._ddp import gather
    from gpucoll.errors import DistBackendError

    flat, offsets = _bucket([4, 4])
    g = gather.BucketGather(flat, offsets, [4, 4])
    a = [HostArray(np.ones(4, np.float32)), HostArray(np.ones(4, np.float32))]
    assert g.fill(a) and fake.events == ["record"]
    b = [HostArray(np.zeros(4, np.float32)), HostArray(np.zeros(4, np.float32))]
    assert g.fill(b) and fake.events == ["record", "synchronize", "record"]
    g.close()
    assert fake.events[-1] == "synchronize"

    def broken(name: str, device: int) -> Any:
        def launch(*args: Any) -> None:
            raise RuntimeError("cudaErrorLaunchFailure")
        return launch
    gather._kernel = broken  # type: ignore[assignment]  # (the fixture's monkeypatch restores it)
    with pytest.raises(DistBackendError, match=r"copying 2 gradients into their bucket on GPU 0 failed "
                                               r"\(RuntimeError: cudaErrorLaunchFailure\)"):
        g.fill(a)

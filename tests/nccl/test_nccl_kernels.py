"""The CUDA kernels of the NCCL backend: compiled as host C++ and checked against NumPy,
compiled to PTX by nvcc and by NVRTC where installed, every kernel a plan can name
present, launches passing the declared C types."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest

from gpucoll._buffer import DTYPES
from gpucoll._backends.nccl.plan import KTYPES, kernel_name, resolve_reduction
from gpucoll.errors import BackendUnavailableError

from _host_kernels import host_library, run_grid
from _reference import OPS
from _fake_gpu_world import DEFAULT_FEATURES, OLD_FEATURES, has_gpu


def test_every_kernel_a_plan_can_name_is_in_the_kernel_source() -> None:
    names = set()
    for dtype in DTYPES.values():
        for op in OPS:
            for features in (DEFAULT_FEATURES, OLD_FEATURES):
                for size in (1, 3):  # one rank: float8 AVG/PREMUL_SUM scale with a kernel
                    try:
                        red = resolve_reduction(dtype, op, size, features, True)
                    except TypeError:
                        continue
                    if red.op is None:
                        names.add(kernel_name("reduce", red.ktype, red.kop))
                    if red.divide:
                        names.add(kernel_name("avg_trunc", red.ktype))
                    if red.scale is not None:
                        names.add(kernel_name("scale", red.ktype))
    assert {"gpucoll_scale_f8e4m3", "gpucoll_scale_f8e5m2"} <= names
    lib = _host_kernels()
    missing = [n for n in sorted(names) if not hasattr(lib, n)]
    assert not missing
    from gpucoll._backends.nccl import kernel_loader as _kernels
    for n in names:
        assert _kernels.signature(n)


# ============================================================ the CUDA kernels, as host C++

def _host_kernels() -> ctypes.CDLL:
    return host_library("reduce")


def _launch_host(lib: ctypes.CDLL, name: str, n: int, args: tuple[Any, ...], grid: int = 2, block: int = 3) -> None:
    """Run kernel ``name`` as grid x block sequential 'threads' (the loops are grid-stride)."""
    from gpucoll._backends.nccl import kernel_loader as _kernels

    ctypes_of = {"p": ctypes.c_void_p, "q": ctypes.c_longlong, "i": ctypes.c_int, "d": ctypes.c_double}
    sig = _kernels.signature(name)
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [ctypes_of[t] for t in sig]
    dim = type(ctypes.c_uint * 3)
    for var in ("threadIdx", "blockIdx", "blockDim", "gridDim"):
        assert (ctypes.c_uint * 3).in_dll(lib, var) is not None
    block_dim = (ctypes.c_uint * 3).in_dll(lib, "blockDim")
    grid_dim = (ctypes.c_uint * 3).in_dll(lib, "gridDim")
    tid = (ctypes.c_uint * 3).in_dll(lib, "threadIdx")
    bid = (ctypes.c_uint * 3).in_dll(lib, "blockIdx")
    block_dim[0], grid_dim[0] = block, grid
    del dim
    for b in range(grid):
        for t in range(block):
            bid[0], tid[0] = b, t
            fn(*args)


@pytest.mark.parametrize("ktype", ["i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64"])
def test_integer_kernels_match_numpy(ktype: str) -> None:
    lib = _host_kernels()
    name = {v: k for k, v in KTYPES.items() if k != "bool"}[ktype]
    dt = np.dtype(name)
    info = np.iinfo(dt)
    rng = np.random.default_rng(1)
    nrows, n, stride = 3, 11, 13
    rows = rng.integers(info.min, info.max, size=(nrows, stride), dtype=dt, endpoint=True)
    rows[:, :3] = np.array([info.min, info.max, -1 if info.min < 0 else 7], dtype=dt)  # edges: wrap around
    for op, fn in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum), ("max", np.maximum),
                   ("band", np.bitwise_and), ("bor", np.bitwise_or), ("bxor", np.bitwise_xor)):
        r = rows.copy()
        out = np.zeros(n, dt)
        _launch_host(lib, f"gpucoll_reduce_{op}_{ktype}", n, (r.ctypes.data, out.ctypes.data, n, nrows, stride))
        assert np.array_equal(out, fn.reduce(rows[:, :n], axis=0, dtype=dt)), op
        # in place: out is one of the rows
        _launch_host(lib, f"gpucoll_reduce_{op}_{ktype}", n, (r.ctypes.data, r[1].ctypes.data, n, nrows, stride))
        assert np.array_equal(r[1, :n], fn.reduce(rows[:, :n], axis=0, dtype=dt)), op
    x = rows[0].copy()
    _launch_host(lib, f"gpucoll_avg_trunc_{ktype}", stride, (x.ctypes.data, stride, 3))
    want = [(abs(int(v)) // 3) * (1 if v >= 0 else -1) for v in rows[0]]
    assert x.tolist() == want
    x = rows[0].copy()
    _launch_host(lib, f"gpucoll_scale_{ktype}", stride, (x.ctypes.data, stride, -3))
    assert np.array_equal(x, np.multiply(rows[0], np.asarray(-3).astype(dt), dtype=dt))


def test_half_and_bfloat16_scale_kernels_round_like_numpy() -> None:
    import ml_dtypes

    lib = _host_kernels()
    every = np.arange(1 << 16, dtype=np.uint16)
    for ktype, np_type in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        for factor in (1.0, 3.0, 0.1, -1e-3, 1e5):
            x = every.copy()
            _launch_host(lib, f"gpucoll_scale_{ktype}", x.size, (x.ctypes.data, x.size, factor), grid=1, block=1)
            with np.errstate(all="ignore"):  # inf and nan inputs, overflow to inf: expected here
                want = (every.view(np_type).astype(np.float32) * np.float32(factor)).astype(np_type)
            got = x.view(np_type)
            nan = np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got.astype(np.float32)), nan), (ktype, factor)
            assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan]), (ktype, factor)
    for ktype, dt in (("f32", np.float32), ("f64", np.float64)):
        x = np.linspace(-3, 3, 17).astype(dt)
        want = x * dt(0.3)
        _launch_host(lib, f"gpucoll_scale_{ktype}", x.size, (x.ctypes.data, x.size, 0.3))
        assert np.array_equal(x, want)


def test_float8_scale_kernels_round_like_ml_dtypes_and_saturate() -> None:
    """Every float8 value times factors that are and are not float8 values: the factor
    rounded to the type first, the product rounded once to nearest even (ml_dtypes),
    out-of-range results saturated to the largest finite value (NCCL's __NV_SATFINITE),
    nan kept nan."""
    import ml_dtypes

    lib = _host_kernels()
    every = np.arange(256, dtype=np.uint8)
    for ktype, np_type in (("f8e4m3", ml_dtypes.float8_e4m3fn), ("f8e5m2", ml_dtypes.float8_e5m2)):
        big = np.float32(ml_dtypes.finfo(np_type).max)
        vals = every.view(np_type).astype(np.float32)
        for factor in (1.0, 0.5, 3.0, 0.3, -1.75, 1e-3, 100.0, 1e9, -1e9):
            x = every.copy()
            _launch_host(lib, f"gpucoll_scale_{ktype}", x.size, (x.ctypes.data, x.size, factor), grid=1, block=1)
            k = np.float32(np.clip(np.float32(factor), -big, big)).astype(np_type).astype(np.float32)
            with np.errstate(all="ignore"):
                prod = vals * k
            want = np.where(np.isnan(prod), prod, np.clip(prod, -big, big)).astype(np_type)
            got = x.view(np_type)
            nan = np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got.astype(np.float32)), nan), (ktype, factor)
            assert np.array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan]), (ktype, factor)
    # Rounding of the product: ties go to even, just below a tie goes down.
    x = np.array([0x38, 0x39], np.uint8)  # e4m3fn 1.0 and 1.125
    _launch_host(lib, "gpucoll_scale_f8e4m3", 2, (x.ctypes.data, 2, 1.0625), grid=1, block=1)
    # 1.0625 rounds (tie) to 1.0 in e4m3; so the values stay as they are
    assert x.view(ml_dtypes.float8_e4m3fn).astype(np.float32).tolist() == [1.0, 1.125]


def test_kernels_compile_to_ptx_with_nvcc() -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    import tempfile

    from gpucoll._backends.nccl import kernel_loader as _kernels

    out = os.path.join(tempfile.mkdtemp(prefix="gpucoll-ptx-"), "reduce.ptx")
    proc = subprocess.run([nvcc, "-ptx", "-arch=compute_80", "-o", out, str(_kernels.KERNEL_DIR / "reduce.cu")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with open(out) as f:
        entries = [line.split()[2].split("(")[0] for line in f if line.startswith(".visible .entry")]
    assert len(entries) == 8 * 9 + 4 + 2 and "gpucoll_scale_f8e5m2" in entries


def _reduce_entries(entries: set[str]) -> None:
    assert len(entries) == 8 * 9 + 4 + 2 and "gpucoll_scale_f8e5m2" in entries


def _gather_entries(entries: set[str]) -> None:
    assert entries == {f"gpucoll_gather_{u}" for u in ("u8", "u16", "u32", "u64", "u128")}


@pytest.mark.parametrize("module,check", [("reduce", _reduce_entries), ("gather", _gather_entries)])
def test_kernels_compile_with_nvrtc_as_cupy_compiles_them(module: str, check: Any) -> None:
    # CuPy compiles kernels/<module>.cu with NVRTC on the GPU; NVRTC itself needs no
    # GPU, so CI (which installs the extra's NVRTC wheel) compiles the same source.
    try:
        from cupy_backends.cuda.libs import nvrtc

        version = nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"no NVRTC here ({type(exc).__name__}: {exc}); the cuda12/cuda13 extras install it")
    from gpucoll._backends.nccl import kernel_loader as _kernels

    name = _kernels.MODULES[module]
    prog = nvrtc.createProgram(_kernels.source(module), name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-arch=compute_90"])
        except Exception as exc:
            log = nvrtc.getProgramLog(prog)
            pytest.fail(f"NVRTC {version} rejected kernels/{name}: {exc}\n{log!r}")
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    entries = {line.split()[2].split("(")[0] for line in text.splitlines() if line.startswith(".visible .entry")}
    check(entries)
    for entry in entries:
        assert _kernels.signature(entry)  # every compiled kernel has a launch signature
    if module == "gather":
        assert all(_kernels.signature(e) == "ppi" for e in entries)


@pytest.mark.skipif(has_gpu(), reason="a usable GPU is present")
def test_compiling_kernels_without_a_gpu_is_a_clear_backend_error() -> None:
    from gpucoll._backends.nccl import kernel_loader as _kernels

    with pytest.raises(BackendUnavailableError, match="NVRTC"):
        _kernels.get_kernel("gpucoll_reduce_bxor_u8", 0)


def test_kernel_launch_passes_the_declared_c_types(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucoll._backends.nccl import kernel_loader as _kernels

    seen: list[Any] = []

    class Kernel:
        def __call__(self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
            seen.append((grid, block, args))

    class Stream:
        entered = 0

        def __enter__(self) -> None:
            Stream.entered += 1

        def __exit__(self, *exc: Any) -> None:
            pass

    monkeypatch.setattr(_kernels, "get_kernel", lambda name, device: Kernel())
    _kernels.launch("gpucoll_reduce_bxor_u16", 1000, (1 << 40, 2 << 40, 1000, 3, 1001), Stream(), 0)
    _kernels.launch("gpucoll_scale_bf16", 5, (1 << 40, 5, 0.5), Stream(), 0)
    _kernels.launch("gpucoll_scale_i64", 5, (1 << 40, 5, -3.0), Stream(), 0)
    _kernels.launch("gpucoll_avg_trunc_i8", 0, (1 << 40, 0, 3), Stream(), 0)  # nothing to do: no launch
    assert Stream.entered == 3 and len(seen) == 3
    (grid, block, args), (_, _, scale), (_, _, iscale) = seen
    assert grid == (4,) and block == (_kernels.BLOCK,)
    assert [type(a) for a in args] == [np.uint64, np.uint64, np.int64, np.int32, np.int64]
    assert [type(a) for a in scale] == [np.uint64, np.int64, np.float64] and scale[2] == 0.5
    assert type(iscale[2]) is np.int64 and iscale[2] == -3
    with pytest.raises(ValueError, match="takes 3 arguments"):
        _kernels.launch("gpucoll_scale_f32", 5, (1, 2), Stream(), 0)


# ============================================================ the gather kernel (kernels/gather.cu)

@pytest.mark.parametrize("unit,name", [(1, "u8"), (2, "u16"), (4, "u32"), (8, "u64"), (16, "u128")])
def test_the_gather_kernel_copies_every_part_into_place(unit: int, name: str) -> None:
    """Parts of many lengths (an empty one too) land at their offsets, in units of
    ``unit`` bytes, whatever the grid: fewer rows than parts (grid-stride in y) and fewer
    threads than a part's units (grid-stride in x); bytes outside the parts untouched."""
    from gpucoll._backends.nccl import kernel_loader as _kernels

    lib = host_library("gather")
    fn = getattr(lib, f"gpucoll_gather_{name}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    assert _kernels.signature(f"gpucoll_gather_{name}") == "ppi"
    rng = np.random.default_rng(unit)
    lengths = [3, 0, 17, 1, 40, 5, 9]  # in units
    parts = [rng.integers(0, 256, n * unit, dtype=np.uint8) for n in lengths]
    offsets = [int(x) for x in np.cumsum([0] + [p.size for p in parts])]
    table = np.array([p.ctypes.data for p in parts] + offsets, np.uint64)
    guard = 32  # bytes before and after the bucket, which no part may touch
    buf = np.zeros(guard + offsets[-1] + guard + 16, np.uint8)
    start = guard + (-(buf.ctypes.data + guard) % 16)  # the bucket 16-byte aligned, as CuPy's are
    want = np.full(buf.size, 0xAB, np.uint8)
    want[start:start + offsets[-1]] = np.concatenate(parts)
    dst = buf
    for grid_y, grid_x, block in ((1, 1, 1), (3, 2, 4), (len(parts), 5, 3)):
        dst[:] = 0xAB
        run_grid(lib, fn, (table.ctypes.data, dst.ctypes.data + start, len(parts)), (grid_x, grid_y), block)
        np.testing.assert_array_equal(dst, want, err_msg=f"grid {grid_x}x{grid_y}, block {block}")

"""The NCCL backend's reductions on the fake GPU (tests/_nccl_fake.py): every op x dtype
at world sizes 1-4, the fallbacks of older NCCL versions, the kernel path, checked
against the one NumPy oracle (tests/_reference.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpucoll._buffer import DTYPES
from gpucoll._backends.nccl.plan import Planner
from gpucoll._backends.nccl.backend import NCCLBackend
from gpucoll._reduce_op import ReduceOp, make_premul_sum

from _nccl_fake import FakeRuntime, read
from _reference import DTYPE_NAMES, OPS, close, defined, make_input, np_dtype, reference
from _fake_gpu_world import DEFAULT_FEATURES, OLD_FEATURES, FakeDeviceArray, dev, run_fake_gpu_worlds, run_world


# ============================================================ reductions against NumPy

def _reduction_sweep(be: NCCLBackend, rt: FakeRuntime, rank: int, *, fp8: bool = True,
                     names: list[str] = DTYPE_NAMES, ops: list[Any] = OPS, n: int = 7) -> list[str]:
    size = be.size
    bad: list[str] = []
    for name in names:
        dt = np_dtype(name)
        for op in ops:
            ins = [make_input(name, n, r) for r in range(size)]
            ok = defined(name, op, fp8)
            want = reference(ins, name, op, size) if ok else None
            for coll in ("all_reduce", "all_reduce_into", "reduce", "reduce_scatter_single", "reduce_scatter",
                         "coalesced"):
                what = f"{coll} {name} {op}"
                try:
                    if coll == "all_reduce":
                        buf = dev(rt, ins[rank], name)
                        be.all_reduce(buf, op).synchronize()
                        got, expect = read(rt, buf, dt), want
                    elif coll == "all_reduce_into":
                        inp = dev(rt, ins[rank], name)
                        out = dev(rt, np.zeros(n, dt), name)
                        be.all_reduce_into(out, inp, op).synchronize()
                        got, expect = read(rt, out, dt), want
                        if not np.array_equal(read(rt, inp, dt).view(np.uint8), ins[rank].view(np.uint8)):
                            bad.append(f"{what}: the input was modified")
                    elif coll == "reduce":
                        buf = dev(rt, ins[rank], name)
                        dst = size - 1
                        be.reduce(buf, dst, op).synchronize()
                        got = read(rt, buf, dt)
                        expect = want if rank == dst else ins[rank]  # non-roots unchanged
                    elif coll == "coalesced":
                        a, b = dev(rt, ins[rank], name), dev(rt, ins[rank][::-1].copy(), name)
                        want_b = reference([x[::-1].copy() for x in ins], name, op, size) if ok else None
                        be.all_reduce_coalesced([a, b], op).synchronize()
                        got = np.concatenate([read(rt, a, dt), read(rt, b, dt)])
                        expect = np.concatenate([want, want_b]) if ok else None
                    else:
                        chunks = [make_input(name, n, r, salt=j) for j in range(size) for r in [rank]]
                        all_chunks = [[make_input(name, n, r, salt=j) for j in range(size)] for r in range(size)]
                        out = dev(rt, np.zeros(n, dt), name)
                        if coll == "reduce_scatter_single":
                            inp = dev(rt, np.concatenate(chunks), name)
                            be.reduce_scatter_single(out, inp, op).synchronize()
                        else:
                            inputs = [dev(rt, c, name) for c in chunks]  # separate allocations
                            be.reduce_scatter(out, inputs, op).synchronize()
                        got = read(rt, out, dt)
                        expect = reference([all_chunks[r][rank] for r in range(size)], name, op, size) if ok else None
                except TypeError as exc:
                    if ok:
                        bad.append(f"{what}: unexpected TypeError {exc}")
                    continue
                if not ok:
                    bad.append(f"{what}: no TypeError for an undefined reduction")
                elif expect is None or not (close(got, expect, name) or _close_stepwise(got, expect, name, ins, op)):
                    bad.append(f"{what}: got {got!r}, want {expect!r}")
    return bad


def _close_stepwise(got: np.ndarray, want: np.ndarray, name: str, ins: list[np.ndarray], op: Any) -> bool:
    """NCCL rounds fp16/bf16/fp8 after every step of the fold (``__hadd`` in
    reduce_kernel.h), where the oracle rounds once: each of the size-1 steps may add
    half an ulp of a partial result, so the bound is absolute, in the inputs' scale."""
    if name not in ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return False
    factor = abs(float(getattr(op, "factor", 1.0) or 1.0))
    scale = max(float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0 for x in ins) * max(factor, 1.0)
    tol = {"float16": 1e-2, "bfloat16": 2e-2, "float8_e4m3fn": 0.13, "float8_e5m2": 0.26}[name]
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return bool(np.all(err <= tol * len(ins) * scale + tol))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_reduction_op_and_dtype_matches_numpy(size: int) -> None:
    results = run_world(size, lambda be, rt, rank: _reduction_sweep(be, rt, rank))
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:30])


def test_reductions_on_an_older_nccl_use_the_fallbacks() -> None:
    # No PreMulSum (scale kernels), no float8 types, no ncclAlltoAll/Gather/Scatter.
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        bad = _reduction_sweep(be, rt, rank, fp8=False, names=[n for n in DTYPE_NAMES if "float8" not in n],
                               ops=[ReduceOp.SUM, ReduceOp.AVG, ReduceOp.BXOR, make_premul_sum(0.5),
                                    make_premul_sum(-2.0)])
        assert any(k.startswith("gpucoll_scale_f") for k in rt.kernels_launched)
        return bad
    results = run_world(3, body, features=OLD_FEATURES)
    bad = [b for r in results for b in r]
    assert not bad, "\n".join(bad[:30])


def test_kernel_path_with_arrays_that_divide_evenly_and_not() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> list[str]:
        bad = []
        for n in (0, 1, 3, 12, 13):
            bad += _reduction_sweep(be, rt, rank, names=["int16", "uint64", "bool"],
                                    ops=[ReduceOp.BXOR, ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX], n=n)
        return bad
    for features in (DEFAULT_FEATURES, OLD_FEATURES):
        bad = [b for r in run_world(3, body, features=features) for b in r]
        assert not bad, "\n".join(bad[:30])


def _one_rank_fp8(x: np.ndarray, op: Any) -> np.ndarray:
    """What a one-rank float8 AVG / PREMUL_SUM gives on NCCL's multi-rank kernels (and so
    must give on one rank): AVG is the input itself; PREMUL_SUM multiplies by the factor
    rounded to the element type (ncclRedOpCreatePreMulSum takes it in that type), the
    product rounded once to the element type."""
    if op is ReduceOp.AVG:
        return x.copy()
    f = np.asarray(op.factor).astype(x.dtype).astype(np.float32)
    out: np.ndarray = (x.astype(np.float32) * f).astype(x.dtype)
    return out


FP8_ONE_RANK_OPS = [ReduceOp.AVG, make_premul_sum(0.5), make_premul_sum(3.0), make_premul_sum(0.3),
                    make_premul_sum(-1.75)]


def test_float8_avg_and_premul_sum_on_one_rank_subgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL refuses float8 AVG/PREMUL_SUM on a communicator of one rank (the fake as
    NCCL 2.28.9 and 2.32.3 on an H200): a subgroup of one rank does them itself, bit for
    bit what NCCL's kernels compute, the input of an out-of-place op left alone."""
    import gpucoll

    def body(w: Any, rt: FakeRuntime, rank: int) -> list[str]:
        sub, _ = gpucoll.new_subgroups(1)
        assert sub.size() == 1
        bad: list[str] = []
        for name in ("float8_e4m3fn", "float8_e5m2"):
            dt = np_dtype(name)
            x = make_input(name, 13, rank)
            for op in FP8_ONE_RANK_OPS:
                want = _one_rank_fp8(x, op)
                a = FakeDeviceArray(rt, x)
                gpucoll.all_reduce(a, op=op, group=sub)
                b = FakeDeviceArray(rt, x)
                gpucoll.reduce(b, dst=rank, op=op, group=sub)
                inp, out = FakeDeviceArray(rt, x), FakeDeviceArray(rt, np.zeros(13, dt))
                gpucoll.reduce_scatter_single(out, inp, op=op, group=sub)
                for what, arr in (("all_reduce", a), ("reduce", b), ("reduce_scatter_single", out)):
                    got = arr.get()
                    if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                        bad.append(f"{what} {name} {op}: got {got!r}, want {want!r}")
                if not np.array_equal(inp.get().view(np.uint8), x.view(np.uint8)):
                    bad.append(f"reduce_scatter_single {name} {op}: the input was modified")
        return bad
    bad = [b for r in run_fake_gpu_worlds(2, body, monkeypatch) for b in r]
    assert not bad, "\n".join(bad[:30])


def test_float8_reductions_need_sm90() -> None:
    def body(be: NCCLBackend, rt: FakeRuntime, rank: int) -> str:
        buf = dev(rt, np.zeros(4, np.uint8), "float8_e4m3fn")
        with pytest.raises(TypeError, match="compute capability >= 9.0") as info:
            be.all_reduce(buf, ReduceOp.SUM)
        be.broadcast(buf, 0).synchronize()  # data movement works everywhere
        return str(info.value)
    msg = run_world(2, body, cc=(8, 0))[0]
    assert "float8_e4m3fn" in msg


def test_integer_premul_needs_an_integral_factor() -> None:
    planner = Planner(0, 2, DEFAULT_FEATURES, True, lambda n: 0)
    with pytest.raises(TypeError, match="integral factor"):
        planner.reduction(DTYPES["int32"], make_premul_sum(0.5))

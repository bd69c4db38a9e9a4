"""The NCCL backend follows the conformance suite's semantics (tests/conformance/,
CATALOGUE.md), on the fake GPU of tests/_nccl_fake.py: torch's all_gather_coalesced
layout, gather/scatter roots defaulting to rank 0, reduce_scatter with chunks of
per-rank sizes, per-rank PREMUL_SUM factors, complex arrays gathered as real views,
and ValueError (torch's type) for dtype mismatches. Expected values come from NumPy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds

import gpucoll


def _val(r: int, n: int, k: int = 0) -> np.ndarray:
    return (np.arange(n) + 10 * r + 100 * k + 1).astype(np.float32)


@pytest.mark.parametrize("size", [2, 3])
def test_nccl_follows_torch_layouts_and_defaults(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
        dev = lambda a: FakeDeviceArray(rt, np.ascontiguousarray(a))  # noqa: E731
        out: dict[str, Any] = {}
        # all_gather_coalesced: output_tensor_lists[r][k] is rank r's input k (shapes differ per k)
        ins = [dev(_val(rank, 1, 0)), dev(_val(rank, 3, 1))]
        outs = [[dev(np.zeros(1, np.float32)), dev(np.zeros(3, np.float32))] for _ in range(size)]
        gpucoll.all_gather_coalesced(outs, ins)
        out["agc"] = [[o.get().tolist() for o in row] for row in outs]
        # gather / scatter without dst / src: rank 0
        g = [dev(np.zeros(2, np.float32)) for _ in range(size)] if rank == 0 else None
        gpucoll.gather(dev(_val(rank, 2)), g)
        out["gather"] = [a.get().tolist() for a in g] if g else None
        t = dev(np.zeros(2, np.float32))
        gpucoll.scatter(t, [dev(_val(j, 2, 5)) for j in range(size)] if rank == 0 else None)
        out["scatter"] = t.get().tolist()
        # reduce_scatter, chunk j of rank j's own size (j + 1 elements)
        chunks = [dev(_val(rank, j + 1, j)) for j in range(size)]
        mine = dev(np.zeros(rank + 1, np.float32))
        gpucoll.reduce_scatter(mine, chunks)
        out["rs_uneven"] = mine.get().tolist()
        # PREMUL_SUM: each rank scales its own contribution by its own factor
        x = dev(_val(rank, 4))
        gpucoll.all_reduce(x, op=gpucoll.make_premul_sum(float(rank + 1)))
        out["premul"] = x.get().tolist()
        # complex input gathered into real views
        c = (np.array([1 + 2j, 3 + 4j], np.complex64) * (rank + 1))
        views = [dev(np.zeros((2, 2), np.float32)) for _ in range(size)]
        gpucoll.all_gather(views, dev(c))
        out["complex"] = [v.get().tolist() for v in views]
        # mismatched dtypes between arguments: ValueError, as torch
        try:
            gpucoll.all_gather([dev(np.zeros(2, np.float64)) for _ in range(size)], dev(np.zeros(2, np.float32)))
            out["dtype_error"] = "accepted"
        except ValueError as exc:
            out["dtype_error"] = f"ValueError: {exc}"
        out["backend"] = gpucoll.get_backend()
        return out

    results = run_fake_gpu_worlds(size, body, monkeypatch)
    for rank, out in enumerate(results):
        assert out["agc"] == [[_val(r, 1, 0).tolist(), _val(r, 3, 1).tolist()] for r in range(size)]
        if rank == 0:
            assert out["gather"] == [_val(r, 2).tolist() for r in range(size)]
        assert out["scatter"] == _val(rank, 2, 5).tolist()
        ref = sum(_val(r, rank + 1, rank) for r in range(size))
        np.testing.assert_allclose(out["rs_uneven"], ref)
        np.testing.assert_allclose(out["premul"], sum((r + 1) * _val(r, 4) for r in range(size)))
        for r in range(size):
            c = np.array([1 + 2j, 3 + 4j], np.complex64) * (r + 1)
            assert out["complex"][r] == np.stack([c.real, c.imag], -1).tolist()
        # torch's words lead ("Invalid usage of tensors with different dtypes"), then which arrays
        assert out["dtype_error"].startswith("ValueError: Invalid usage of tensors with different dtypes: "
                                             "tensor_list[0] has dtype float64"), out["dtype_error"]
        assert out["backend"] == "nccl"


def test_nccl_uneven_reduce_scatter_premul_and_emulated_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(w: Any, rt: Any, rank: int) -> tuple[list[float], str]:
        dev = lambda a: FakeDeviceArray(rt, np.ascontiguousarray(a))  # noqa: E731
        chunks = [dev(np.full(j + 1, j + 1.0, np.float32)) for j in range(2)]
        mine = dev(np.zeros(rank + 1, np.float32))
        gpucoll.reduce_scatter(mine, chunks, op=gpucoll.make_premul_sum(float(rank + 2)))
        ints = [dev(np.full(j + 1, 7, np.int32)) for j in range(2)]
        try:
            gpucoll.reduce_scatter(dev(np.zeros(rank + 1, np.int32)), ints, op=gpucoll.ReduceOp.BAND)
            msg = "accepted"
        except ValueError as exc:
            msg = str(exc)
        return mine.get().tolist(), msg

    for rank, (got, msg) in enumerate(run_fake_gpu_worlds(2, body, monkeypatch)):
        assert got == [(2.0 + 3.0) * (rank + 1)] * (rank + 1)  # sum_r factor_r * chunk value
        assert "chunks of different sizes" in msg and "BAND" in msg, msg

"""One matrix: every array kind gpucoll accepts, through every kind of op.

Host kinds (NumPy, the buffer protocol as ``array.array`` and ``bytearray``, an object that
speaks only DLPack, torch CPU tensors, JAX arrays) run in one CPU world of 3 ranks; device
kinds (``__cuda_array_interface__`` v3 and v2, gpucoll's own Buffer) run in one world on
the fake GPU. Each (kind, op) is checked against NumPy on the same values, so a kind that
one op handles and another mishandles shows up as one failing cell.
"""

from __future__ import annotations

import array as pyarray
from typing import Any, Callable

import numpy as np
import pytest

from gpucoll.testing import run_spmd

from _fake_arrays import skip_without_jax

N = 3
HOST_KINDS = ["numpy", "array.array", "bytearray", "dlpack-only", "torch", "jax"]
IN_PLACE_OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single", "send_recv"]
FUNCTIONAL_OPS = ["F.all_reduce", "F.broadcast", "F.all_gather"]


def _values(rank: int, count: int = 6) -> np.ndarray:
    """Rank ``rank``'s input: small integers, exact in every dtype of the matrix."""
    return ((np.arange(count) * 2 + rank * 3) % 11).astype(np.float64)


class DLPackOnly:
    """An array that speaks only DLPack (no buffer protocol, no ``__array__``)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._a.__dlpack_device__()


def _host_kind(kind: str) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray], bool]:
    """(make from float64 values, read back as float64, writable) for one host kind."""
    if kind == "numpy":
        return (lambda v: v.astype(np.float32)), (lambda x: np.asarray(x, np.float64)), True
    if kind == "array.array":
        return ((lambda v: pyarray.array("i", v.astype(np.int32).tolist())),
                (lambda x: np.frombuffer(x, np.int32).astype(np.float64)), True)
    if kind == "bytearray":
        return (lambda v: bytearray(v.astype(np.uint8).tobytes())), (lambda x: np.frombuffer(x, np.uint8) * 1.0), True
    if kind == "dlpack-only":
        return (lambda v: DLPackOnly(v.astype(np.float64))), (lambda x: np.array(x._a, np.float64)), True
    if kind == "torch":
        import torch

        return (lambda v: torch.tensor(v, dtype=torch.float32)), (lambda x: x.numpy().astype(np.float64)), True
    if kind == "jax":
        import jax.numpy as jnp

        return (lambda v: jnp.asarray(v, jnp.float32)), (lambda x: np.asarray(x, np.float64)), False
    raise AssertionError(kind)


def _in_place(op: str, make: Callable[[np.ndarray], Any], read: Callable[[Any], np.ndarray]) -> tuple[Any, Any]:
    """(got, want) for one in-place op of the torch-style API on this rank."""
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    mine = _values(r)
    if op == "all_reduce":
        x = make(mine)
        gpucoll.all_reduce(x)
        return read(x), sum(_values(i) for i in range(n))
    if op == "broadcast":
        x = make(mine)
        gpucoll.broadcast(x, src=1 % n)
        return read(x), _values(1 % n)
    if op == "all_gather":
        outs = [make(np.zeros(6)) for _ in range(n)]
        gpucoll.all_gather(outs, make(mine))
        return [read(o).tolist() for o in outs], [_values(i).tolist() for i in range(n)]
    if op == "reduce_scatter":
        out = make(np.zeros(2))
        gpucoll.reduce_scatter(out, [make(_values(r, 2 * n)[2 * j:2 * j + 2]) for j in range(n)])
        return read(out), sum(_values(i, 2 * n) for i in range(n))[2 * r:2 * r + 2]
    if op == "all_to_all_single":
        out = make(np.zeros(2 * n))
        gpucoll.all_to_all_single(out, make(_values(r, 2 * n)))
        return read(out), np.concatenate([_values(i, 2 * n)[2 * r:2 * r + 2] for i in range(n)])
    if op == "send_recv":
        out = make(np.zeros(6))
        works = [gpucoll.isend(make(mine), (r + 1) % n), gpucoll.irecv(out, (r - 1) % n)]
        for w in works:
            w.wait()
        return read(out), _values((r - 1) % n)
    raise AssertionError(op)


def _functional(op: str, make: Callable[[np.ndarray], Any], read: Callable[[Any], np.ndarray],
                x_type: type) -> tuple[Any, Any]:
    """(got, want) for one op of gpucoll.functional; the result must be the caller's kind
    where that kind is an array type (NumPy, torch, JAX)."""
    import gpucoll
    import gpucoll.functional as F

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    x = make(_values(r))
    if op == "F.all_reduce":
        y, want = F.all_reduce(x), sum(_values(i) for i in range(n))
    elif op == "F.broadcast":
        y, want = F.broadcast(x, src=n - 1), _values(n - 1)
    elif op == "F.all_gather":
        y, want = F.all_gather(x), np.concatenate([_values(i) for i in range(n)])
    else:
        raise AssertionError(op)
    if x_type.__module__.split(".")[0] in ("numpy", "torch", "jaxlib", "jax"):
        assert isinstance(y, x_type), f"{op} returned {type(y).__name__} for a {x_type.__name__}"
        got = read(y)
    else:
        got = np.asarray(y, np.float64)
    return got, want


def _host_matrix() -> dict[str, Any]:
    import gpucoll

    cells: dict[str, Any] = {}
    for kind in HOST_KINDS:
        make, read, writable = _host_kind(kind)
        for op in IN_PLACE_OPS:
            if not writable:
                continue
            got, want = _in_place(op, make, read)
            cells[f"{kind} {op}"] = (np.asarray(got).tolist(), np.asarray(want).tolist())
        if not writable:  # an immutable array in an in-place op: a clear error, nothing sent
            try:
                gpucoll.all_reduce(make(_values(0)))
            except (TypeError, ValueError) as exc:
                cells[f"{kind} in-place refused"] = str(exc)
            else:
                cells[f"{kind} in-place refused"] = None
        x_type = type(make(_values(0)))
        for op in FUNCTIONAL_OPS:
            got, want = _functional(op, make, read, x_type)
            cells[f"{kind} {op}"] = (np.asarray(got).tolist(), np.asarray(want).tolist())
    return cells


def test_every_host_array_kind_through_every_kind_of_op() -> None:
    skip_without_jax()
    pytest.importorskip("torch")
    results = run_spmd(_host_matrix, N, start_method="spawn", timeout=240, env={"JAX_PLATFORMS": "cpu"})
    wrong = []
    for rank, cells in enumerate(results):
        want_cells = {f"{k} {op}" for k in HOST_KINDS if k != "jax" for op in IN_PLACE_OPS}
        want_cells |= {f"{k} {op}" for k in HOST_KINDS for op in FUNCTIONAL_OPS} | {"jax in-place refused"}
        assert set(cells) == want_cells, f"rank {rank} ran {sorted(set(cells) ^ want_cells)} unexpectedly"
        for cell, value in cells.items():
            if cell.endswith("refused"):
                if not value or "read-only" not in value:
                    wrong.append(f"rank {rank} {cell}: {value!r}")
            elif value[0] != value[1]:
                wrong.append(f"rank {rank} {cell}: got {value[0]}, want {value[1]}")
    assert not wrong, "\n".join(wrong)


DEVICE_KINDS = ["cai-v3", "cai-v2", "gpucoll Buffer"]


def test_every_device_array_kind_through_every_kind_of_op(monkeypatch: pytest.MonkeyPatch) -> None:
    from _fake_gpu_world import FakeDeviceArray, run_fake_gpu_worlds
    from _nccl_fake import read_on_stream

    import gpucoll

    class CAIv2(FakeDeviceArray):
        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            d = dict(super().__cuda_array_interface__)
            d["version"] = 2
            del d["stream"]
            return d

    def kind(name: str, rt: Any) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
        if name == "cai-v3":
            return (lambda v: FakeDeviceArray(rt, v.astype(np.float32))), (lambda x: x.get().astype(np.float64))
        if name == "cai-v2":
            return (lambda v: CAIv2(rt, v.astype(np.float32))), (lambda x: x.get().astype(np.float64))

        def make_buffer(v: np.ndarray) -> Any:
            return FakeDeviceArray(rt, v.astype(np.float32)).buf

        def read_buffer(b: Any) -> np.ndarray:
            return read_on_stream(rt, b, np.float32).get(timeout=10).astype(np.float64)
        return make_buffer, read_buffer

    def body(w: Any, rt: Any, rank: int) -> dict[str, Any]:
        cells: dict[str, Any] = {}
        for name in DEVICE_KINDS:
            make, read_back = kind(name, rt)
            for op in IN_PLACE_OPS:
                got, want = _in_place(op, make, read_back)
                cells[f"{name} {op}"] = (np.asarray(got).tolist(), np.asarray(want).tolist())
        return cells

    results = run_fake_gpu_worlds(N, body, monkeypatch)
    wrong = [f"rank {rank} {cell}: got {got}, want {want}"
             for rank, cells in enumerate(results) for cell, (got, want) in cells.items() if got != want]
    assert len(results[0]) == len(DEVICE_KINDS) * len(IN_PLACE_OPS)
    assert not wrong, "\n".join(wrong)
    assert gpucoll.is_initialized() is False  # the fake worlds leave this process's world alone

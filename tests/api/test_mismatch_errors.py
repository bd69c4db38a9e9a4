"""Ranks that issue different collectives: every rank raises (roots included), never a
wrong or partial result, and the CPU backend's error names what differs with each
rank's value — without any debug level (docs/cpu-backend.md, "Cross-rank checks").
Also the bad ``src``/``dst``/``tag`` arguments that could hide such a mismatch."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import gpucoll
from gpucoll.testing import run_spmd


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except gpucoll.DistBackendError as exc:
        return f"raised: {exc}"
    return "returned"


def _mismatch_body() -> dict[str, Any]:
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {}

    def fresh() -> Any:
        return gpucoll.new_group(list(range(n)), timeout=8.0)  # a mismatch breaks its group only

    g = fresh()
    x = np.full(4, float(rank + 1), np.float32)
    out["op"] = _outcome(lambda: gpucoll.broadcast(x, src=0, group=g) if rank == 0
                         else gpucoll.all_reduce(x, group=g))
    g = fresh()
    y = np.full(3, float(rank), np.float32)
    out["self_root"] = _outcome(lambda: gpucoll.broadcast(y, src=rank, group=g))
    out["self_root_data"] = y.tolist()
    g = fresh()
    # two roots named: ranks 0..n-2 say root 0, the last rank says root n-1
    out["two_roots"] = _outcome(lambda: gpucoll.broadcast(np.zeros(3, np.float32),
                                                          src=0 if rank < n - 1 else n - 1, group=g))
    g = fresh()
    out["dtype"] = _outcome(lambda: gpucoll.all_reduce(np.ones(4, np.float64 if rank == 0 else np.float32),
                                                       group=g))
    g = fresh()
    out["count"] = _outcome(lambda: gpucoll.all_reduce(np.ones(5 if rank == 0 else 7, np.float32), group=g))
    g = fresh()

    def gather_or_scatter() -> None:
        # rank 1 scatters from root 0 while the others gather to root 0
        if rank == 1:
            gpucoll.scatter(np.zeros(2, np.float32), None, src=0, group=g)
        else:
            outs = [np.zeros(2, np.float32) for _ in range(n)] if rank == 0 else None
            gpucoll.gather(np.ones(2, np.float32), outs, dst=0, group=g)

    out["gather_root"] = _outcome(gather_or_scatter)
    g = fresh()

    def after_repeats() -> None:
        # Every rank has issued this op before (its signature is remembered, not recomputed):
        # a mismatch is still caught, on every rank, with the fields named.
        for _ in range(3):
            gpucoll.all_reduce(np.ones(5, np.float32), group=g)
            gpucoll.reduce_scatter(np.zeros(2, np.float32), [np.ones(2, np.float32)] * n, group=g)
        gpucoll.all_reduce(np.ones(5 if rank == 0 else 7, np.float32), group=g)

    out["repeated"] = _outcome(after_repeats)
    g = fresh()
    z = np.full(2, float(rank + 1), np.float32)
    gpucoll.all_reduce(z, group=g)  # a fresh group still works
    out["after"] = z.tolist()
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_rank_raises_and_names_what_differs(transport: str) -> None:
    n = 3
    results = run_spmd(_mismatch_body, n, env={"GPUCOLL_CPU_TRANSPORT": transport}, timeout=120)
    for rank, out in enumerate(results):
        for case in ("op", "self_root", "two_roots", "dtype", "count", "gather_root", "repeated"):
            assert out[case].startswith("raised: "), (rank, case, out[case])
        assert out["self_root_data"] == [float(rank)] * 3  # nobody took anyone's data
        assert out["after"] == [6.0, 6.0]
    # The rank that detects a mismatch names each field that differs and both ranks' values;
    # a rank that hears of it from a peer's abort carries that peer's message.
    assert any("op (rank 0: broadcast, rank 1: all_reduce)" in o["op"] or
               "op (rank 0: broadcast, rank 2: all_reduce)" in o["op"] for o in results), results
    assert all("broadcast" in o["op"] and "all_reduce" in o["op"] for o in results), [o["op"] for o in results]
    assert any("dtype (rank 0: float64, rank 1: float32)" in o["dtype"] or
               "dtype (rank 0: float64, rank 2: float32)" in o["dtype"] for o in results), results
    assert all("float64" in o["dtype"] and "float32" in o["dtype"] for o in results)
    assert all("count" in o["count"] and "5" in o["count"] and "7" in o["count"] for o in results)
    assert any("count (rank 0: 5, rank 1: 7)" in o["repeated"] or
               "count (rank 0: 5, rank 2: 7)" in o["repeated"] for o in results), [o["repeated"] for o in results]
    assert all("5" in o["repeated"] and "7" in o["repeated"] for o in results), [o["repeated"] for o in results]
    assert all("root" in o["self_root"] for o in results), [o["self_root"] for o in results]


def _args_body() -> dict[str, str]:
    rank = gpucoll.get_rank()
    x = np.zeros(2, np.float32)
    out = {}
    for name, fn in {
        "src_float": lambda: gpucoll.broadcast(x, src=0.0),  # type: ignore[arg-type]
        "src_bool": lambda: gpucoll.broadcast(x, src=False),  # type: ignore[arg-type]
        "dst_float": lambda: gpucoll.reduce(x, dst=1.0),  # type: ignore[arg-type]
        "group_src_bool": lambda: gpucoll.scatter(x, None, group_src=True),  # type: ignore[arg-type]
        "pg_src_float": lambda: gpucoll.GroupMember.WORLD.broadcast(x, 0.0),  # type: ignore[union-attr, arg-type]
    }.items():
        try:
            fn()
            out[name] = "accepted"
        except TypeError as exc:
            out[name] = f"TypeError: {exc}"
        except Exception as exc:  # noqa: BLE001 - the test reports the wrong type
            out[name] = f"{type(exc).__name__}: {exc}"
    try:
        if rank == 0:
            gpucoll.send(x, dst=1, tag=2**40)
        else:
            gpucoll.recv(x, src=0, tag=2**40)
        out["tag"] = "accepted"
    except ValueError as exc:
        out["tag"] = f"ValueError: {exc}"
    return out


def test_src_dst_must_be_ints_and_tags_in_range() -> None:
    for out in run_spmd(_args_body, 2, timeout=60):
        for name in ("src_float", "src_bool", "dst_float", "group_src_bool", "pg_src_float"):
            assert out[name].startswith("TypeError: ") and "must be an int" in out[name], (name, out[name])
        assert "src" in out["src_float"] and "0.0" in out["src_float"]
        assert "group_src" in out["group_src_bool"] and "True" in out["group_src_bool"]
        assert out["tag"].startswith("ValueError: tag=1099511627776 is out of range"), out["tag"]
        assert "[0, 2147483647]" in out["tag"]

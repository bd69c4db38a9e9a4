"""The shared-memory small all_reduce bound to one kind (``cpu/shm_small.py``): the
second and later all_reduce of a NumPy kind that fits a slot and folds with a plain ufunc
runs a function made once for that kind. What it must keep, checked through the public
API on the path it takes (the test asserts that the bound function is the one in use):

- results: many ops of each kind back to back (both slot parities, in place, synchronous
  and async), several dtypes and ops, sizes from one element to a full slot, match NumPy's
  rank-order fold (tests/_reference.py) at world sizes 2 (one peer: the loop-free form)
  and 3;
- mismatches: a rank whose op differs in its ReduceOp, count or dtype from a bound op on
  its peer fails on every rank with "differ across ranks", never a wrong result;
- a peer that never comes: the bound op fails at the group's timeout naming that rank.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from _reference import make_input, np_dtype, reference
from gpucoll.testing import run_spmd

# (complex64: a format a memoryview does not take, so the op copies into its slot with NumPy)
CASES = [("float32", "SUM"), ("int64", "MAX"), ("float64", "PRODUCT"), ("int32", "MIN"), ("uint8", "BXOR"),
         ("complex64", "SUM")]
COUNTS = (1, 2, 1000)  # and a full 256 KiB slot of float32 below


def _bound(pg: Any, x: np.ndarray, opname: str) -> bool:
    """Whether ``x``'s kind runs the kind-bound small all_reduce."""
    import inspect

    fast = pg._host_runs.get((x.dtype, x.shape, opname))
    if fast is None:
        return False
    if fast.run.__qualname__.startswith("_one_peer."):  # one peer: issuing and protocol in one function
        return True
    fn = inspect.getclosurevars(fast.run).nonlocals.get("fn")  # (issue.bound's transport function)
    return getattr(fn, "__qualname__", "").startswith("small_all_reduce")


def results_body() -> list[str]:
    import gpucoll
    from gpucoll._collectives import _world
    from gpucoll._reduce_op import ReduceOp

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = _world._WORLD.default
    bad: list[str] = []
    cases = [(name, opname, count) for name, opname in CASES for count in COUNTS] + [("float32", "SUM", 65536)]
    for name, opname, count in cases:
        op = ReduceOp[opname]
        for k in range(7):  # the first plans the kind, the second binds it; odd and even op numbers
            x = make_input(name, count, r, salt=k)
            async_op = k % 3 == 2
            w = gpucoll.all_reduce(x, op=op, async_op=async_op)
            if async_op:
                assert w is not None
                w.wait()
            want = reference([make_input(name, count, q, salt=k) for q in range(n)], name, op)
            if not np.array_equal(x, want):
                bad.append(f"{name} {opname} x{count} #{k}: {x[:4]} != {want[:4]}")
        if not _bound(pg, np.zeros(count, np_dtype(name)), opname):
            bad.append(f"{name} {opname} x{count}: not on the bound path")
    # A 2-D array of a bound kind's bytes, and kinds interleaved (their op numbers alternate).
    a, b = np.zeros((4, 8), np.float32), np.zeros(5, np.int64)
    for k in range(6):
        a[...] = r + k
        b[...] = r * k
        gpucoll.all_reduce(a)
        gpucoll.all_reduce(b, op=ReduceOp.MAX)
        if not (a == sum(q + k for q in range(n))).all() or not (b == (n - 1) * k).all():
            bad.append(f"interleaved #{k}: {a[0, 0]} {b[0]}")
    if not _bound(pg, a, "SUM"):
        bad.append("the 2-D kind is not on the bound path")
    # np.longlong equals int64 as a dtype (the same kind) but exports its buffer as 'q', not
    # the int64 slot's 'l': the op's copy into the slot falls back to NumPy's, same result.
    for k in range(6):
        c = np.full(5, r * 10 + k, np.int64 if k % 2 else np.longlong)
        gpucoll.all_reduce(c)
        if not (c == sum(q * 10 + k for q in range(n))).all():
            bad.append(f"longlong #{k}: {c[0]}")
    if not _bound(pg, np.zeros(5, np.longlong), "SUM"):
        bad.append("the longlong kind is not on the bound path")
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_bound_small_all_reduce_matches_numpy(world: int) -> None:
    for r, bad in enumerate(run_spmd(results_body, world, timeout=240)):
        assert bad == [], (world, r, bad[:5])


def faults_body() -> dict[str, str]:
    import gpucoll
    from gpucoll._reduce_op import ReduceOp

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, str] = {}

    def bound_group(x: np.ndarray, op: Any = ReduceOp.SUM) -> Any:
        g = gpucoll.new_group(list(range(n)), timeout=4.0)  # a failed op breaks its group only
        for _ in range(3):  # plan, bind, run bound
            gpucoll.all_reduce(x, op=op, group=g)
        assert _bound(g, x, op._name_)
        return g

    def outcome(fn: Any) -> str:
        try:
            fn()
        except gpucoll.DistBackendError as exc:
            return f"raised: {exc}"
        return "returned"

    x = np.ones(4, np.float32)
    g = bound_group(x)
    out["op"] = outcome(lambda: gpucoll.all_reduce(x, op=ReduceOp.SUM if r == 0 else ReduceOp.MAX, group=g))
    g = bound_group(x)
    out["count"] = outcome(lambda: gpucoll.all_reduce(x if r == 0 else np.ones(5, np.float32), group=g))
    g = bound_group(x)
    out["dtype"] = outcome(lambda: gpucoll.all_reduce(x if r == 0 else np.ones(4, np.int32), group=g))
    g = bound_group(x)
    if r == 0:  # rank 1 never comes to this op
        t0 = time.monotonic()
        out["absent"] = outcome(lambda: gpucoll.all_reduce(x, group=g))
        out["absent_after"] = str(time.monotonic() - t0)  # the group's timeout (4 s), from the op's first wait
    gpucoll.barrier()
    return out


def test_bound_small_all_reduce_mismatch_and_absent_peer() -> None:
    res = run_spmd(faults_body, 2, timeout=120)
    for r, out in enumerate(res):
        for case in ("op", "count", "dtype"):
            assert out[case].startswith("raised:") and "differ across ranks" in out[case], (r, case, out[case])
    assert res[0]["absent"].startswith("raised:") and "rank 1" in res[0]["absent"], res[0]["absent"]
    assert "timed out" in res[0]["absent"] or "timeout" in res[0]["absent"], res[0]["absent"]
    assert 3.9 <= float(res[0]["absent_after"]) <= 30.0, res[0]["absent_after"]

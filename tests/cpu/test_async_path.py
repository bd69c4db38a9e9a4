"""The CPU backend's async path: a small ``async_op=True`` op starts on the caller's thread
through the Work-less path; when every peer is there it completes there and returns a Work
complete from birth, else the backend's worker thread finishes it and the call returns at
once (an async op never waits for its peers on the caller's thread). What that must keep:

- never blocking: an async op (all_reduce planned or first of its kind, out of place,
  broadcast, all_gather_into_tensor) issued by one rank while its peers are busy returns
  within moments, and completes, with the right result, once they join (world sizes 2-4);

- results: batches of async all_reduce (in place, out of place, several dtypes and ops),
  broadcast and all_gather_single, issued back to back and waited at the end, match
  NumPy's reduction (tests/_reference.py) at world sizes 1-4;
- the Work: complete on return at world size 1, ``wait()`` True, ``result()`` the caller's array,
  ``info()`` numbered in issue order, a future already resolved;
- order: a small async op issued behind a large one (which the worker thread runs) waits
  its turn, and completes after it;
- errors surface on ``wait()``, not at the call: a mismatched op, and every op after it
  (the group is then unusable); an op whose peer never comes fails at the timeout, on
  ``wait()``, naming the peer;
- with a completion hook registered, every async op's hook fires, off the caller's thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from _reference import make_input, np_dtype, reference
from gpucoll.testing import run_spmd

CASES = [("float32", "SUM"), ("int64", "MAX"), ("float64", "AVG"), ("int32", "PRODUCT"), ("uint8", "BXOR")]
BATCH = 12


def results_body() -> list[str]:
    import gpucoll
    from gpucoll.bench.ops import Call, get_op
    from gpucoll._reduce_op import ReduceOp

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    bad: list[str] = []
    out_of_place = get_op("all_reduce").out_of_place  # the path gpucoll-bench times
    assert out_of_place is not None
    for name, opname in CASES:
        op = ReduceOp[opname]
        for count in (1, 7):
            # Twice: the first op of a kind plans it (Work path), later ones take the lean path.
            for rep in range(2):
                xs = [make_input(name, count, r, salt=k + rep) for k in range(BATCH)]
                works = [gpucoll.all_reduce(x, op=op, async_op=True) for x in xs]
                ins = [make_input(name, count, r, salt=k + rep) for k in range(BATCH)]
                outs = [np.zeros(count, np_dtype(name)) for _ in range(BATCH)]
                works += [w for i, o in zip(ins, outs)
                          for w in out_of_place(Call(i, o, op, 0, r, n, True))]
                for w in works:
                    if w.wait() is not True:
                        bad.append(f"{name} {opname}: wait() gave {w.wait()!r}")
                for k in range(BATCH):
                    want = reference([make_input(name, count, q, salt=k + rep) for q in range(n)], name, op)
                    if not np.array_equal(xs[k], want):
                        bad.append(f"in place {name} {opname} x{count} #{k}: {xs[k]} != {want}")
                    if not np.array_equal(outs[k], want):
                        bad.append(f"out of place {name} {opname} x{count} #{k}: {outs[k]} != {want}")
                    if not np.array_equal(ins[k], make_input(name, count, r, salt=k + rep)):
                        bad.append(f"out of place {name} {opname}: the input changed")
    for rep in range(3):
        ys = [np.full(5, r * 10 + k, np.float32) for k in range(n)]
        bw = [gpucoll.broadcast(ys[k], src=k, async_op=True) for k in range(n)]
        outs = [np.empty(3 * n, np.int32) for _ in range(4)]
        gw = [gpucoll.all_gather_into_tensor(o, np.arange(3, dtype=np.int32) + 100 * r + k, async_op=True)
              for k, o in enumerate(outs)]
        for w in bw + gw:
            assert w is not None
            w.wait()
        for k in range(n):
            if not np.array_equal(ys[k], np.full(5, k * 10 + k, np.float32)):
                bad.append(f"broadcast from {k}: {ys[k]}")
        for k, o in enumerate(outs):
            want = np.concatenate([np.arange(3, dtype=np.int32) + 100 * q + k for q in range(n)])
            if not np.array_equal(o, want):
                bad.append(f"all_gather #{k}: {o} != {want}")
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_async_batches_match_numpy(world: int) -> None:
    for r, bad in enumerate(run_spmd(results_body, world, timeout=180)):
        assert bad == [], (world, r, bad[:5])


def work_body() -> dict[str, Any]:
    import gpucoll
    from gpucoll._world import default_group

    pg = default_group()
    x = np.ones(4, np.float32)
    gpucoll.all_reduce(x)
    gpucoll.all_reduce(x)  # planned: later ones of this kind take the lean path
    start_seq = pg._issuer.seq
    ws = [gpucoll.all_reduce(x, async_op=True) for _ in range(5)]
    got: dict[str, Any] = {
        "complete_on_return": [w.is_completed() for w in ws],
        "waits": [w.wait() for w in ws],
        "success": [w.is_success() for w in ws],
        "exception": [w.exception() for w in ws],
        "result_is_x": [w.result()[0] is x for w in ws],
        "seqs": [w.info().seq - start_seq for w in ws],
        "ops": sorted({w.info().op_type for w in ws}),
        "group": sorted({w.info().group_name for w in ws}),
        "times_ordered": all(w.info().time_finished >= w.info().time_started for w in ws),
        "future": [w.get_future().result(timeout=0)[0] is x for w in ws],
        "x": x.tolist(),
    }
    got["next_seq"] = pg._issuer.seq - start_seq
    return got


def test_an_async_work_completes_and_is_numbered_in_issue_order() -> None:
    for n in (1, 2, 3):
        for res in run_spmd(work_body, n, timeout=120):
            if n == 1:  # no peer to wait for: always complete on return
                assert res["complete_on_return"] == [True] * 5
            assert res["success"] == [True] * 5 and res["exception"] == [None] * 5
            assert res["waits"] == [True] * 5 and res["result_is_x"] == [True] * 5
            assert res["seqs"] == [1, 2, 3, 4, 5] and res["next_seq"] == 5
            assert res["ops"] == ["all_reduce"] and res["group"] != [""]
            assert res["times_ordered"] and res["future"] == [True] * 5
            assert res["x"] == [float(n ** 7)] * 4  # two sync ops, then five async ones, each multiplies by n


def order_body() -> dict[str, Any]:
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    small = np.full(3, float(r + 1), np.float64)
    for _ in range(2):
        gpucoll.all_reduce(small)  # planned: the next one would run at once if nothing were queued
    small[:] = r + 1
    big = np.full(1 << 18, float(r), np.float64)  # 2 MiB: the worker thread runs it
    order: list[str] = []
    wb = gpucoll.all_reduce(big, async_op=True)
    ws = gpucoll.all_reduce(small, async_op=True)
    assert wb is not None and ws is not None
    wb.get_future().add_done_callback(lambda f: order.append("big"))
    ws.get_future().add_done_callback(lambda f: order.append("small"))
    ws.wait()
    big_done_when_small_waited = wb.is_completed()
    wb.wait()
    return {"order": order, "big_first": big_done_when_small_waited,
            "big": bool(np.all(big == sum(range(n)))), "small": small.tolist()}


def test_a_small_async_op_behind_a_large_one_waits_its_turn() -> None:
    for n in (2, 3):
        for res in run_spmd(order_body, n, timeout=120):
            assert res["big_first"], res
            assert res["order"] == ["big", "small"], res
            assert res["big"] and res["small"] == [float(sum(range(1, n + 1)))] * 3, res


def mismatch_body() -> dict[str, Any]:
    import gpucoll

    r = gpucoll.get_rank()
    a = np.ones(5, np.float32)
    b = np.ones(7, np.float32)
    for _ in range(2):  # both kinds planned on every rank
        gpucoll.all_reduce(a)
        gpucoll.all_reduce(b)
    raised_at_call: list[str] = []
    works = []
    for x in ([a if r == 0 else b] + [a, a]):  # the first op differs across ranks
        try:
            works.append(gpucoll.all_reduce(x, async_op=True))
        except Exception as exc:  # an async op must not raise at the call
            raised_at_call.append(f"{type(exc).__name__}: {exc}")
    errors = []
    for w in works:
        assert w is not None
        done = w.is_completed()
        try:
            w.wait()
            errors.append(("ok", done, ""))
        except gpucoll.DistBackendError as exc:
            errors.append((type(exc).__name__, done, str(exc)))
    return {"raised_at_call": raised_at_call, "errors": errors}


def test_errors_surface_on_wait_for_the_failed_op_and_every_later_one() -> None:
    for res in run_spmd(mismatch_body, 2, timeout=120):
        assert res["raised_at_call"] == []
        kinds = [e[0] for e in res["errors"]]
        assert kinds == ["DistBackendError"] * 3, res["errors"]
        assert "differ" in res["errors"][0][2], res["errors"][0]


def timeout_body(pg_timeout: float) -> dict[str, Any]:
    import gpucoll

    r = gpucoll.get_rank()
    x = np.ones(4, np.float32)
    for _ in range(2):
        gpucoll.all_reduce(x)
    if r == 1:
        time.sleep(pg_timeout + 3.0)  # alive, but never joins rank 0's op
        return {}
    t0 = time.monotonic()
    w = gpucoll.all_reduce(x, async_op=True)
    returned = time.monotonic() - t0
    assert w is not None
    try:
        w.wait()
        return {"error": None}
    except gpucoll.DistBackendError as exc:
        return {"error": str(exc), "returned_after": returned, "waited": time.monotonic() - t0}


def test_an_async_op_whose_peer_never_comes_fails_on_wait_at_the_timeout() -> None:
    res = run_spmd(timeout_body, 2, args=(1.0,), pg_timeout=1.0, timeout=60)[0]
    assert res["error"] is not None, res
    assert "rank 1" in res["error"], res["error"]
    assert res["returned_after"] < 0.5, res  # the call returned at once; the error waited for wait()
    assert 1.0 <= res["waited"] < 20.0, res


def hook_body() -> dict[str, Any]:
    import gpucoll
    from gpucoll._world import default_group

    pg = default_group()
    me = threading.get_ident()
    seen: list[tuple[str, int, bool]] = []
    lock = threading.Lock()

    def hook(info: Any) -> None:
        with lock:
            seen.append((str(info.op_type), threading.get_ident(), bool(info.success)))

    x = np.ones(3, np.float32)
    for _ in range(2):
        gpucoll.all_reduce(x)
    pg.register_on_completion_hook(hook)
    ws = [gpucoll.all_reduce(x, async_op=True) for _ in range(6)]
    for w in ws:
        assert w is not None
        w.wait()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        with lock:
            if len(seen) >= 6:
                break
        time.sleep(0.01)
    return {"ops": [s[0] for s in seen], "on_caller": sum(s[1] == me for s in seen),
            "success": all(s[2] for s in seen), "x": x.tolist()}


def test_hooks_fire_for_every_async_op_off_the_callers_thread() -> None:
    for n in (1, 2):
        for res in run_spmd(hook_body, n, timeout=120):
            assert res["ops"] == ["all_reduce"] * 6, res
            assert res["on_caller"] == 0, res
            assert res["success"] and res["x"] == [float(n ** 8)] * 3, res


def alone_body(delay: float) -> dict[str, Any]:
    import gpucoll
    from gpucoll.bench.ops import Call, get_op
    from gpucoll._reduce_op import ReduceOp

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out_of_place = get_op("all_reduce").out_of_place
    assert out_of_place is not None
    x = np.zeros(4, np.float32)
    y = np.zeros(6, np.int64)
    g = np.zeros(3 * n, np.int32)
    mid = np.zeros(1 << 16, np.float64)  # 512 KiB: past a shared-memory slot, within inline_max
    for _ in range(2):  # every kind below planned (the lean path), but the "new" all_reduce
        gpucoll.all_reduce(x)
        gpucoll.all_reduce(mid)
        gpucoll.broadcast(y, src=n - 1)
        gpucoll.all_gather_into_tensor(g, np.zeros(3, np.int32))
    x[:] = r + 1
    mid[:] = r + 4
    y[:] = 10 * r + np.arange(6)
    new = np.full(5, float(r + 2), np.float64)  # a kind not run before: the Work path
    oop_in, oop_out = np.full(4, float(3 * r), np.float32), np.zeros(4, np.float32)
    gpucoll.barrier()
    if r != 0:
        time.sleep(delay)  # busy: rank 0's ops find no peer
        got: dict[str, Any] = {}
    t0 = time.monotonic()
    works = [gpucoll.all_reduce(x, async_op=r == 0), gpucoll.all_reduce(new, async_op=r == 0),
             *out_of_place(Call(oop_in, oop_out, ReduceOp.SUM, 0, r, n, r == 0)),
             gpucoll.broadcast(y, src=n - 1, async_op=r == 0),
             gpucoll.all_gather_into_tensor(g, np.arange(3, dtype=np.int32) + 100 * r, async_op=r == 0),
             gpucoll.all_reduce(mid, async_op=r == 0)]
    returned = time.monotonic() - t0
    if r == 0:
        done_early = [w is not None and w.is_completed() for w in works]
        for w in works:
            assert w is not None
            w.wait()
        got = {"returned": returned, "waited": time.monotonic() - t0, "done_early": done_early,
               "count": len(works)}
    got.update(mid=bool(np.all(mid == sum(q + 4 for q in range(n)))), x=x.tolist(), new=new.tolist(), oop=oop_out.tolist(), y=y.tolist(), g=g.tolist())
    return got


@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_async_op_issued_alone_returns_at_once_and_completes_when_the_peers_join(world: int) -> None:
    delay = 1.5
    res = run_spmd(alone_body, world, args=(delay,), timeout=120)
    n = world
    first = res[0]
    assert first["count"] == 6, first
    # Six async calls on rank 0 while every peer sleeps: none waited for them.
    assert first["returned"] < 0.3, first
    assert first["done_early"] == [False] * 6, first
    assert first["waited"] >= delay * 0.9, first
    for r, got in enumerate(res):
        assert got["mid"], (r, got)
        assert got["x"] == [float(sum(q + 1 for q in range(n)))] * 4, (r, got)
        assert got["new"] == [float(sum(q + 2 for q in range(n)))] * 5, (r, got)
        assert got["oop"] == [float(sum(3 * q for q in range(n)))] * 4, (r, got)
        assert got["y"] == (10 * (n - 1) + np.arange(6)).tolist(), (r, got)
        assert got["g"] == np.concatenate([np.arange(3) + 100 * q for q in range(n)]).tolist(), (r, got)


ASYNC_KINDS = ["reduce", "reduce_scatter", "reduce_scatter_single", "all_gather", "gather", "scatter", "all_to_all",
               "all_to_all_single", "barrier", "all_reduce_coalesced", "coalescing_block"]


def _issue_kind(kind: str, r: int, n: int, async_op: bool) -> tuple[Any, Any]:
    """Issue one small collective of ``kind`` with rank-dependent inputs; (its Work or
    None, a function giving what this rank must hold afterwards and what it holds)."""
    import gpucoll

    if kind == "reduce":
        x = np.full(3, float(r + 1))
        w = gpucoll.reduce(x, dst=0, async_op=async_op)
        return w, lambda: (x.tolist(), [float(sum(range(1, n + 1)))] * 3 if r == 0 else x.tolist())
    if kind == "reduce_scatter":
        out = np.zeros(2)
        w = gpucoll.reduce_scatter(out, [np.full(2, float(r + 10 * j)) for j in range(n)], async_op=async_op)
        return w, lambda: (out.tolist(), [float(sum(range(n)) + 10 * r * n)] * 2)
    if kind == "reduce_scatter_single":
        out = np.zeros(2)
        inp = np.repeat(np.arange(n, dtype=np.float64) * 10 + r, 2)
        w = gpucoll.reduce_scatter_tensor(out, inp, async_op=async_op)
        return w, lambda: (out.tolist(), [float(sum(range(n)) + 10 * r * n)] * 2)
    if kind == "all_gather":
        outs = [np.zeros(2, np.int64) for _ in range(n)]
        w = gpucoll.all_gather(outs, np.full(2, r, np.int64), async_op=async_op)
        return w, lambda: ([o.tolist() for o in outs], [[q, q] for q in range(n)])
    if kind == "gather":
        outs = [np.zeros(2, np.int64) for _ in range(n)] if r == 0 else None
        w = gpucoll.gather(np.full(2, r, np.int64), outs, dst=0, async_op=async_op)
        return w, lambda: ([o.tolist() for o in outs] if outs else None, [[q, q] for q in range(n)] if r == 0 else None)
    if kind == "scatter":
        out = np.zeros(2, np.int64)
        ins = [np.full(2, 5 * q, np.int64) for q in range(n)] if r == 0 else None
        w = gpucoll.scatter(out, ins, src=0, async_op=async_op)
        return w, lambda: (out.tolist(), [5 * r] * 2)
    if kind == "all_to_all":
        outs = [np.zeros(1, np.int64) for _ in range(n)]
        w = gpucoll.all_to_all(outs, [np.array([10 * r + q]) for q in range(n)], async_op=async_op)
        return w, lambda: ([int(o[0]) for o in outs], [10 * q + r for q in range(n)])
    if kind == "all_to_all_single":
        out = np.zeros(n, np.int64)
        w = gpucoll.all_to_all_single(out, np.arange(n, dtype=np.int64) + 10 * r, async_op=async_op)
        return w, lambda: (out.tolist(), [10 * q + r for q in range(n)])
    if kind == "all_reduce_coalesced":
        xs = [np.full(2, float(r)), np.full(3, float(2 * r))]
        w = gpucoll.all_reduce_coalesced(xs, async_op=async_op)
        total = float(sum(range(n)))
        return w, lambda: ([x.tolist() for x in xs], [[total] * 2, [2 * total] * 3])
    if kind == "coalescing_block":
        a, b = np.full(2, float(r)), np.full(3, float(r * r))
        with gpucoll.coalescing(async_ops=async_op) as cm:
            gpucoll.all_reduce(a, async_op=async_op)
            gpucoll.all_reduce(b, async_op=async_op)
        return (cm if async_op else None), lambda: ((a.tolist(), b.tolist()),
                                                    ([float(sum(range(n)))] * 2, [float(sum(q * q for q in range(n)))] * 3))
    assert kind == "barrier"
    w = gpucoll.barrier(async_op=async_op)
    return w, lambda: (None, None)


def async_then_send_body(kinds: list[str]) -> dict[str, Any]:
    """Rank 0 issues a small async collective, then sends to rank 1, which receives that
    message before it joins the collective (valid with torch, whose async ops return at
    once). A call that waited for its peers would wait for rank 1 until the timeout."""
    import gpucoll

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {}
    for kind in kinds:
        for _ in range(2):  # the second time, a kind run before (planned)
            gpucoll.barrier()
            note = np.zeros(1, np.int64)
            if r == 0:
                t0 = time.monotonic()
                w, check = _issue_kind(kind, r, n, True)
                returned = time.monotonic() - t0
                gpucoll.send(np.array([7], np.int64), dst=1)
                assert w is not None
                w.wait()
                out[kind] = returned
            else:
                if r == 1:
                    gpucoll.recv(note, src=0)
                    assert note[0] == 7
                _, check = _issue_kind(kind, r, n, False)
            got, want = check()
            assert got == want, (kind, r, got, want)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_small_async_collectives_return_before_their_peers_join(world: int) -> None:
    res = run_spmd(async_then_send_body, world, args=(ASYNC_KINDS,), timeout=120, pg_timeout=8.0)
    assert set(res[0]) == set(ASYNC_KINDS), res[0]
    slow = {k: t for k, t in res[0].items() if t > 1.0}
    assert not slow, slow

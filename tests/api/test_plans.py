"""The issue path's plans: a repeated op looks its checked reduction and backend up by
(op, dtype, shape, device, reduction/root) instead of deciding them again. A plan is
never served to a call that differs in any of these, or to another group; every check
that is not part of the key (writability, coalescing blocks, a bool root, an op invalid
for the dtype) still runs on every call; destroying a group drops its plans and its
NumPy runners (HostRun: a kind run before is bound to the backend's runner). Results are
checked against NumPy on every rank (values are functions of the rank)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpucoll.testing import run_spmd


def _expect_sum(n: int, shape: tuple[int, ...], dtype: Any) -> Any:
    return np.full(shape, sum(range(1, n + 1)), dtype)


def plans_body() -> dict[str, Any]:
    import gpucoll
    from gpucoll._world import default_group

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = default_group()
    out: dict[str, Any] = {}
    bad: list[str] = []

    def check(name: str, got: Any, want: Any) -> None:
        if got.dtype != np.asarray(want).dtype or got.shape != np.asarray(want).shape or not np.array_equal(got, want):
            bad.append(f"{name}: got {got!r}, want {want!r}")

    # Same op, then a changed dtype, shape, op: each result as NumPy computes it.
    for _ in range(3):
        x = np.full(4, r + 1, np.float32)
        gpucoll.all_reduce(x)
        check("sum f32 (4,)", x, _expect_sum(n, (4,), np.float32))
    x = np.full(4, r + 1, np.float64)
    gpucoll.all_reduce(x)
    check("sum f64 (4,)", x, _expect_sum(n, (4,), np.float64))
    for shape in ((5,), (2, 2), (1,)):
        x = np.full(shape, r + 1, np.float32)
        gpucoll.all_reduce(x)
        check(f"sum f32 {shape}", x, _expect_sum(n, shape, np.float32))
    for op, ref in ((gpucoll.ReduceOp.MAX, np.max), (gpucoll.ReduceOp.MIN, np.min),
                    (gpucoll.ReduceOp.PRODUCT, np.prod), (gpucoll.ReduceOp.SUM, np.sum)):
        for _ in range(2):
            x = np.full(4, r + 2, np.int64)
            gpucoll.all_reduce(x, op=op)
            check(f"{op.name} i64", x, np.full(4, ref(np.arange(2, n + 2)), np.int64))
    keys = len(pg._plans)
    out["plans_grew"] = keys >= 8  # one per distinct (dtype, shape, op) above
    # NumPy arrays of a kind run twice are bound to the CPU backend's runner (HostRun).
    out["host_runs"] = len(pg._host_runs)
    # Behind a queued op the runner cannot run now: the op goes the Work way, in order.
    big = np.full(1 << 20, r + 1, np.float32)  # 4 MiB: queued for the backend's worker
    work = gpucoll.all_reduce(big, async_op=True)
    x = np.full(4, r + 1, np.float32)
    gpucoll.all_reduce(x)
    work.wait()
    check("sum f32 (4,) behind a queued op", x, _expect_sum(n, (4,), np.float32))
    check("the queued op", big[:3], _expect_sum(n, (3,), np.float32))

    # Checks outside the key still run on a planned kind.
    x = np.full(4, 1.0, np.float32)
    gpucoll.all_reduce(x, op=gpucoll.ReduceOp.MAX)  # plans (float32, (4,), MAX)
    try:
        gpucoll.all_reduce(np.ones(4, np.float32), op=gpucoll.ReduceOp.BAND)
        out["band_on_float"] = "returned"
    except TypeError as exc:
        out["band_on_float"] = "TypeError" if "BAND" in str(exc) else str(exc)
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    try:
        gpucoll.all_reduce(ro)
        out["read_only"] = "returned"
    except (TypeError, ValueError) as exc:
        out["read_only"] = type(exc).__name__
    y = np.full(3, float(r), np.float32)
    for _ in range(2):
        gpucoll.broadcast(y, src=1 % n)
    check("broadcast src 1", y, np.full(3, float(1 % n), np.float32))
    try:
        gpucoll.broadcast(y, src=True)
        out["bool_root"] = "returned"
    except TypeError:
        out["bool_root"] = "TypeError"
    y = np.full(3, float(r), np.float32)
    gpucoll.broadcast(y, src=0)
    check("broadcast src 0 after src 1", y, np.zeros(3, np.float32))

    # A coalescing block defers even a planned kind: both arrays reduced, one op.
    a, b = np.full(4, r + 1, np.float32), np.full(4, r + 1, np.float32)
    seq = pg.get_sequence_number()
    with gpucoll.coalescing():
        gpucoll.all_reduce(a)
        gpucoll.all_reduce(b)
    check("coalesced a", a, _expect_sum(n, (4,), np.float32))
    check("coalesced b", b, _expect_sum(n, (4,), np.float32))
    out["coalesced_ops"] = pg.get_sequence_number() - seq

    # Another group (here: the last two ranks, or all when n < 3) has plans of its own.
    members = list(range(n))[-2:] if n >= 3 else list(range(n))
    sub = gpucoll.new_group(members)
    if r in members:
        z = np.full(4, r + 1, np.float32)
        gpucoll.all_reduce(z, group=sub)
        check("subgroup sum", z, np.full(4, sum(m + 1 for m in members), np.float32))
        out["own_plans"] = sub._plans is not pg._plans and len(sub._plans) == 1
    else:
        out["own_plans"] = True
    gpucoll.barrier()

    # destroy drops the plans; a new default group starts with none and computes right.
    gpucoll.destroy_process_group()
    out["destroyed_plans"] = len(pg._plans) + len(pg._host_runs)
    gpucoll.init_process_group("cpu", timeout=30.0)
    fresh = default_group()
    out["fresh_plans"] = len(fresh._plans) + len(fresh._host_runs)
    x = np.full(4, r + 1, np.float32)
    gpucoll.all_reduce(x)
    check("sum after re-init", x, _expect_sum(n, (4,), np.float32))
    out["bad"] = bad
    return out


def test_plans_are_never_stale() -> None:
    for n in (3, 2):
        for r, res in enumerate(run_spmd(plans_body, n, timeout=120)):
            assert res["bad"] == [], (n, r, res["bad"])
            assert res["plans_grew"], (n, r)
            assert res["host_runs"] >= 6, res  # f32 (4,) SUM and each i64 op
            assert res["band_on_float"] == "TypeError", res
            assert res["read_only"] in ("TypeError", "ValueError"), res
            assert res["bool_root"] == "TypeError", res
            assert res["coalesced_ops"] == 1, res
            assert res["own_plans"], res
            assert res["destroyed_plans"] == 0 and res["fresh_plans"] == 0, res


def workless_body() -> dict[str, Any]:
    """broadcast and all_gather_single: a repeated synchronous host op takes the CPU
    backend's Work-less path (no Work: the backend's Work-making call is never reached),
    and still falls back to a Work where one is needed (async, a hook, a large op); a
    changed dtype, size or root is never served a stale plan; the checks the key settles
    (dtypes, sizes) still fail a call that differs."""
    import gpucoll
    from gpucoll._world import default_group

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = default_group()
    cpu = pg._cpu
    bad: list[str] = []
    made: dict[str, int] = {"broadcast": 0, "all_gather_single": 0}
    for name in made:  # count the Work path's calls (each makes a Work)
        real = getattr(cpu, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            made[_name] += 1
            return _real(*args)
        setattr(cpu, name, counted)

    def check(name: str, got: Any, want: Any) -> None:
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            bad.append(f"{name}: got {got!r}, want {want!r}")

    for dtype in (np.float32, np.int32, np.float64):  # float32 and int32: same bytes, another plan
        for src in range(n):
            for _ in range(2):
                y = np.full(5, r * 10 + 1, dtype)
                gpucoll.broadcast(y, src=src)
                check(f"broadcast {dtype.__name__} from {src}", y, np.full(5, src * 10 + 1, dtype))
        for count in (1, 3, 3, 7):
            out = np.empty(n * count, dtype)
            gpucoll.all_gather_into_tensor(out, np.arange(count, dtype=dtype) + r * 100)
            check(f"all_gather {dtype.__name__} x{count}", out,
                  np.concatenate([np.arange(count, dtype=dtype) + q * 100 for q in range(n)]))
    # In place: the input is this rank's chunk of the output.
    out = np.zeros(n * 4, np.float32)
    out[r * 4:(r + 1) * 4] = r + 0.5
    for _ in range(2):
        gpucoll.all_gather_into_tensor(out, out[r * 4:(r + 1) * 4])
    check("all_gather in place", out, np.repeat(np.arange(n, dtype=np.float32) + 0.5, 4))
    workless = dict(made)
    # The flight recorder shows each Work-less broadcast's root, as it does a Work's.
    entries = pg._recorder.snapshot()["entries"] if pg._recorder is not None else []
    roots = [e["peer"] for e in entries if e["op_type"] == "broadcast"]
    if n > 1 and roots[-2:] != [n - 1, n - 1]:  # the last kind above broadcast from every root in turn
        bad.append(f"broadcast roots in the flight recorder: {roots[-6:]}")
    if any(e["state"] != "completed" for e in entries[-8:]):
        bad.append(f"flight recorder states: {[e['state'] for e in entries[-8:]]}")

    # A small async broadcast runs Work-less too: complete on return when every peer was
    # there (always at world size 1); else the backend finishes it and wait() waits.
    y = np.full(5, float(r), np.float32)
    w = gpucoll.broadcast(y, src=0, async_op=True)
    assert w is not None
    if n == 1 and not w.is_completed():
        bad.append("a small async broadcast at world size 1 was not complete on return")
    w.wait()
    if not w.is_completed():
        bad.append("a small async broadcast was not complete after wait()")
    check("async broadcast", y, np.zeros(5, np.float32))
    # Where a Work is needed, the Work path, with the right results.
    big = np.full(1 << 19, float(r), np.float32)  # 2 MiB: past what runs on the caller's thread
    gpucoll.broadcast(big, src=n - 1)
    check("large broadcast", big[:4], np.full(4, float(n - 1), np.float32))
    seen: list[str] = []
    pg.register_on_completion_hook(lambda info: seen.append(str(info.op_type)))
    out = np.empty(n * 3, np.float32)
    gpucoll.all_gather_into_tensor(out, np.full(3, float(r), np.float32))
    check("all_gather with a hook", out, np.repeat(np.arange(n, dtype=np.float32), 3))
    fallback = dict(made)

    # The key's checks still fail a call that differs from a planned one.
    errors = []
    for o, i in ((np.empty(n * 3, np.float32), np.zeros(3, np.int32)),   # dtypes differ
                 (np.empty(n * 3 + 1, np.float32), np.zeros(3, np.float32))):  # sizes differ
        try:
            gpucoll.all_gather_into_tensor(o, i)
            errors.append("returned")
        except ValueError:
            errors.append("ValueError")
    gpucoll.barrier()
    return {"bad": bad, "workless": workless, "fallback": fallback, "errors": errors}


def test_broadcast_and_all_gather_take_the_workless_path_and_are_never_stale() -> None:
    for n in (1, 2, 3, 4):
        for r, res in enumerate(run_spmd(workless_body, n, timeout=120)):
            assert res["bad"] == [], (n, r, res["bad"])
            if n > 1:  # (a group of one runs everything locally, no backend op)
                assert res["workless"] == {"broadcast": 0, "all_gather_single": 0}, (n, r, res)
                # 2 MiB broadcast, all_gather with a hook: a Work each (a small async one: none).
                assert res["fallback"] == {"broadcast": 1, "all_gather_single": 1}, (n, r, res)
            assert res["errors"] == ["ValueError", "ValueError"], res

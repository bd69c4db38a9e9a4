"""A shared-memory group with more ranks than CPUs (``ShmSegment.wait``'s yield phase):
a rank waiting for a peer first hands its CPU over with ``sched_yield`` (the peer may be
queued behind it), before it spins or sleeps. Checked through the public API on ranks
pinned to one CPU: the group takes the yield phase (a group with a CPU per rank, its
ranks bound to one CPU each or not, does not), waits do yield, results match NumPy's,
and a peer that never comes still fails the op at the group's timeout, naming it."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from gpucoll.testing import run_spmd


def crowded_body(pin: bool) -> dict[str, Any]:
    if pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import gpucoll
    from gpucoll._collectives import _world

    gpucoll.init_process_group("cpu", timeout=3)
    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    seg = _world._WORLD.default._cpu._coll.seg
    yields = [0]
    real = os.sched_yield

    def counted() -> None:
        yields[0] += 1
        real()

    os.sched_yield = counted
    bad = []
    try:
        for k in range(300):
            for count in (2, 1024, 70000):  # the bound small path, and a bulk op
                x = np.full(count, r + k, np.float32)
                gpucoll.all_reduce(x)
                if not (x == sum(q + k for q in range(n))).all():
                    bad.append(f"#{k} x{count}: {x[:2]}")
        gpucoll.barrier()
        late = ""
        if r == 0:
            try:  # rank 1 does not take part: the op fails at the timeout, naming it
                gpucoll.all_reduce(np.ones(2, np.float32))
            except gpucoll.DistBackendError as exc:
                late = str(exc)
        else:
            time.sleep(6)  # alive, not taking part, until rank 0's op timed out
    finally:
        os.sched_yield = real
    return {"phase": len(seg._yields), "yields": yields[0], "bad": bad, "late": late}


def test_more_ranks_than_cpus_yield_first() -> None:
    res = run_spmd(crowded_body, 2, args=(True,), timeout=180, init=False)
    for r, got in enumerate(res):
        assert got["bad"] == [], (r, got["bad"][:3])
        assert got["phase"] > 0, r
    assert sum(got["yields"] for got in res) > 0
    assert "rank 1" in res[0]["late"] and "timed out" in res[0]["late"], res[0]["late"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("bind_to", ["none", "core"])
def test_a_cpu_per_rank_does_not_yield(bind_to: str) -> None:
    # "core": each rank may run on one CPU only, but they are different CPUs: the group
    # has a CPU per rank (beside a busy process, a yield would hand it the CPU).
    for got in run_spmd(crowded_body, 2, args=(False,), timeout=180, init=False, bind_to=bind_to):
        assert got["phase"] == 0 and got["bad"] == []

"""Peer death (SIGKILL) and stall (SIGSTOP) in every kind of op: every survivor raises a
DistError naming the op (and the peer) within the group timeout + 5 s, never hangs,
never returns a wrong result; no shared-memory segment or temporary file is left.

Worlds are started once per configuration (transport x world size); each case is a
fresh group formed by forked children (see ``_faultkit``), about a second each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from _faultkit import OPS, PG_TIMEOUT, run_cases
from _launch_jobs import shm_left
from gpucoll.testing import run_spmd

ALL_OPS = list(OPS)

# configuration -> (world size, extra environment, cases as (op, victim, how))
WORLDS: dict[str, tuple[int, dict[str, str], list[tuple[str, int, str]]]] = {
    "w3": (3, {}, [(op, 1, "kill") for op in ALL_OPS]
           + [(op, 0, "kill") for op in ("all_reduce", "broadcast", "gather", "scatter", "all_gather_object")]
           + [("jit_all_reduce", 1, "kill"), ("jit_first_all_reduce", 1, "kill")]),
    "w3-tcp": (3, {"GPUCOLL_CPU_TRANSPORT": "tcp"}, [
        (op, 1, "kill") for op in ("all_reduce", "all_reduce_big", "all_gather", "broadcast_from_victim",
                                   "all_to_all", "barrier", "recv", "recv_streaming", "send_to_dead",
                                   "all_gather_object")]),
    "w2": (2, {}, [("all_reduce", 1, "kill"), ("all_reduce", 0, "kill"), ("recv_streaming", 1, "kill"),
                   ("broadcast_object_list", 1, "kill"), ("jit_all_reduce", 0, "kill")]),
    "w4": (4, {}, [("all_reduce", 3, "kill"), ("all_to_all", 3, "kill"), ("reduce_scatter", 3, "kill"),
                   ("barrier", 3, "kill"), ("all_gather", 0, "kill")]),
    "w3-stop": (3, {}, [("all_reduce", 1, "stop"), ("all_reduce_big", 1, "stop"), ("recv", 1, "stop"),
                        ("jit_all_reduce", 1, "stop"), ("jit_first_all_reduce", 1, "stop")]),
}

# Survivors whose result does not depend on the victim may complete, with a right result.
_MAY_COMPLETE = {
    "broadcast": lambda r, n, v: True, "scatter": lambda r, n, v: True,
    "reduce": lambda r, n, v: r != (0 if v != 0 else n - 1),
    "gather": lambda r, n, v: r != (0 if v != 0 else n - 1),
    # The victim dies 2 ms into its own all_reduce: on a busy machine its data may all have
    # gone out by the time the kill lands, and the op may complete (with the right sum).
    "all_reduce_big": lambda r, n, v: True,
}

KNOWN: dict[tuple[str, str, int], str] = {}
"""Cases expected to fail, by (world, op, victim), with the bug's name: none at present."""

_RESULTS: dict[str, list[list[dict[str, Any]]]] = {}


def _world(name: str, tmp: Path) -> list[list[dict[str, Any]]]:
    """Run configuration ``name`` once; ``[case][rank] -> report``."""
    if name not in _RESULTS:
        n, env, cases = WORLDS[name]
        scratch = tmp / f"tmp-{name}"
        scratch.mkdir()
        env = dict(env, TMPDIR=str(scratch), GPUCOLL_FLIGHT_RECORDER_DIR=str(tmp / f"fr-{name}"))
        out = run_spmd(run_cases, n, args=(cases,), init=False, env=env,
                       timeout=len(cases) * (PG_TIMEOUT + 12) + 60)
        by_case = [[out[r][i] for r in range(n)] for i in range(len(cases))]
        pids = [rep["pid"] for case in by_case for rep in case if "pid" in rep]
        leaks = shm_left(pids)
        for case in by_case:
            for rep in case:
                rep["shm_left"] = leaks
                rep["tmp_left"] = sorted(os.listdir(scratch))
        _RESULTS[name] = by_case
    return _RESULTS[name]


def _params() -> list[Any]:
    out = []
    for name, (n, _, cases) in WORLDS.items():
        for i, (op, victim, how) in enumerate(cases):
            reason = KNOWN.get((name, op, victim))
            marks = [pytest.mark.xfail(strict=False, reason=reason)] if reason else []
            out.append(pytest.param(name, i, id=f"{name}-{op}-{how}-rank{victim}", marks=marks))
    return out


@pytest.mark.parametrize("world, index", _params())
def test_every_survivor_raises_a_dist_error_in_time(world: str, index: int,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    n, _, cases = WORLDS[world]
    op, victim, how = cases[index]
    reports = _world(world, tmp_path_factory.mktemp("faults", numbered=True))[index]
    op_name = OPS[op][0]
    for r, rep in enumerate(reports):
        if r == victim:
            assert rep["status"] == -9, f"the victim ended with {rep['status']}"
            continue
        assert not rep.get("hung"), f"rank {r} hung in {op} (killed after {PG_TIMEOUT + 20} s)"
        assert "setup_error" not in rep, f"rank {r}: {rep['setup_error']}"
        if rep["raised"] is None:
            assert _MAY_COMPLETE.get(op, lambda *a: False)(r, n, victim), \
                f"rank {r}: {op} returned (in {rep['elapsed']:.2f} s) although rank {victim} was {how}ped"
            assert rep["correct"] in (True, None), f"rank {r}: {op} returned a wrong result"
            continue
        assert rep["dist"], f"rank {r}: {op} raised {rep['raised']}, not a DistError: {rep['msg']}"
        assert rep["elapsed"] < PG_TIMEOUT + 5, f"rank {r}: {op} took {rep['elapsed']:.2f} s to fail"
        assert op_name in rep["msg"], f"rank {r}: the error does not name {op_name}: {rep['msg']}"
        assert f"rank {victim}" in rep["msg"] or f"[{victim}]" in rep["msg"], \
            f"rank {r}: the error does not name rank {victim}: {rep['msg']}"
        if how == "stop":
            assert rep["elapsed"] > PG_TIMEOUT - 0.5, f"rank {r} gave up on a stalled peer early"
    assert reports[0]["shm_left"] == [], f"shared-memory segments left: {reports[0]['shm_left']}"
    assert reports[0]["tmp_left"] == [], f"files left in TMPDIR: {reports[0]['tmp_left']}"

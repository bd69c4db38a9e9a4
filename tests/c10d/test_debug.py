"""Debug levels (torch's DebugLevel, GPUCOLL_DEBUG / TORCH_DISTRIBUTED_DEBUG), DETAIL's
cross-rank check on the CPU backend, group_desc, sequence numbers and call sites in
the flight recorder."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

import gpucoll
from gpucoll import DebugLevel
from gpucoll.testing import run_spmd


@pytest.fixture(autouse=True)
def _clean_level(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("GPUCOLL_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    yield
    gpucoll.set_debug_level(None)


def test_levels_and_environment_match_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch", reason="torch's DebugLevel is the reference")
    tdist = torch.distributed
    assert [m for m in DebugLevel.__members__] == list(tdist.DebugLevel.__members__)
    assert [int(m) for m in DebugLevel] == [int(m) for m in tdist.DebugLevel.__members__.values()]
    for value in ("off", "INFO", "Detail"):
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", value)
        tdist.set_debug_level_from_env()
        assert gpucoll.get_debug_level().name == tdist.get_debug_level().name == value.upper()
    tdist.set_debug_level(tdist.DebugLevel.OFF)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "bogus")
    with pytest.raises(ValueError, match="The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, or DETAIL; got 'bogus'"):
        gpucoll.get_debug_level()
    # ours wins over torch's when both are set
    monkeypatch.setenv("GPUCOLL_DEBUG", "info")
    assert gpucoll.get_debug_level() is DebugLevel.INFO
    gpucoll.set_debug_level("DETAIL")
    assert gpucoll.get_debug_level() is DebugLevel.DETAIL
    gpucoll.set_debug_level(DebugLevel.OFF)
    assert gpucoll.get_debug_level() is DebugLevel.OFF
    monkeypatch.setenv("GPUCOLL_DEBUG", "detail")
    gpucoll.set_debug_level_from_env()
    assert gpucoll.get_debug_level() is DebugLevel.DETAIL
    with pytest.raises(ValueError, match="level must be"):
        gpucoll.set_debug_level("loud")


def _detail_body() -> dict[str, Any]:
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    out: dict[str, Any] = {}

    def caught(fn: Any) -> str:
        try:
            fn()
        except gpucoll.DistBackendError as exc:
            return str(exc)
        return "not caught"

    # rank 1 passes a longer array: the CPU backend would fail obscurely or hang
    out["shape"] = caught(lambda: gpucoll.all_reduce(np.ones(4 * (1 + (rank == 1)), np.float32)))
    out["dtype"] = caught(lambda: gpucoll.all_reduce(np.ones(4, np.float64 if rank == n - 1 else np.float32)))
    out["op"] = caught(lambda: gpucoll.broadcast(np.ones(4), src=0) if rank == 0 else gpucoll.all_reduce(np.ones(4)))
    out["root"] = caught(lambda: gpucoll.broadcast(np.ones(2), src=rank))
    x = np.full(3, rank + 1.0)
    gpucoll.all_reduce(x)  # matching calls still run
    out["after"] = x.tolist()
    out["seq"] = gpucoll.GroupMember.WORLD.get_sequence_number()  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_detail_checks_cpu_collectives_and_names_what_differs(n: int) -> None:
    results = run_spmd(_detail_body, n, env={"GPUCOLL_DEBUG": "DETAIL"}, timeout=90)
    for rank, out in enumerate(results):
        assert "they differ in shape (rank 0: (4,), rank 1: (8,)" in out["shape"], out["shape"]
        assert "rank 0: op=all_reduce seq=1 dtype=float32 shape=(4,) reduce op=SUM" in out["shape"]
        assert "'default' (default_pg)" in out["shape"]
        other = ", ".join(f"rank {r}: float32" for r in range(n - 1))
        assert f"differ in dtype ({other}, rank {n - 1}: float64)" in out["dtype"], out["dtype"]
        assert "differ in op (rank 0: broadcast, rank 1: all_reduce" in out["op"], out["op"]
        roots = ", ".join(f"rank {r}: {r}" for r in range(n))
        assert f"root ({roots})" in out["root"], out["root"]
        assert out["after"] == [n * (n + 1) / 2] * 3
        assert out["seq"] == 5  # four refused ops took numbers too, on every rank alike


def _desc_body(tmp: str) -> dict[str, Any]:
    rank, n = gpucoll.get_rank(), gpucoll.get_world_size()
    evens = gpucoll.new_group([r for r in range(n) if r % 2 == 0], group_desc="evens")
    mine = gpucoll.split_group(split_ranks=[list(range(n))], group_desc="whole")
    out: dict[str, Any] = {"repr": repr(mine)}
    assert mine is not None
    seqs = []
    for _ in range(3):
        gpucoll.all_reduce(np.ones(2), group=mine)  # the line recorded below
        seqs.append(mine.get_sequence_number())
    out["seqs"] = seqs
    dump = json.loads(mine.dump_flight_recorder())
    out["desc"] = dump["group_desc"]
    out["where"] = dump["entries"][-1]["where"]
    if isinstance(evens, gpucoll.ProcessGroup):
        out["evens"] = repr(evens)
        path = os.path.join(tmp, f"evens{rank}.json")
        evens.dump_flight_recorder(path)
        with open(path) as f:
            saved = json.load(f)
        out["saved_desc"] = saved["group_desc"]
        out["has_stacks"] = any("_desc_body" in s for s in saved["stacks"].values())
    with pytest.raises(TypeError, match="group_desc must be a str"):
        gpucoll.new_group([0], group_desc=3)  # type: ignore[arg-type]
    return out


def test_group_desc_sequence_numbers_and_call_sites(tmp_path: Any) -> None:
    results = run_spmd(_desc_body, 3, args=(str(tmp_path),), env={"GPUCOLL_DEBUG": "INFO"}, timeout=90)
    for rank, out in enumerate(results):
        assert "desc='whole'" in out["repr"] and out["desc"] == "whole"
        assert out["seqs"] == [1, 2, 3]
        assert out["where"].endswith("(_desc_body)") and "test_debug.py:" in out["where"]
        if rank % 2 == 0:
            assert "desc='evens'" in out["evens"] and out["saved_desc"] == "evens" and out["has_stacks"]

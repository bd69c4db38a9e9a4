"""NCCL plans: every rank issues the same collectives whatever its memory layout."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpucoll._buffer import DTYPES, Buffer, Device
from gpucoll._backends.nccl.plan import Planner
from gpucoll._reduce_op import ReduceOp

from _fake_gpu_world import DEFAULT_FEATURES, OLD_FEATURES


# ============================================================ plans: every rank issues the same collectives

def _collective_signature(plan: list[Any]) -> list[tuple[Any, ...]]:
    sig = []
    for _, calls, _ in plan:
        group = []
        for step in calls:
            if step[0] in ("send", "recv"):
                continue
            shared = tuple(x for i, x in enumerate(step[3:], 3) if not (step[0] in ("all_reduce", "reduce", "reduce_scatter") and i == 5))
            group.append((step[0],) + shared)
        sig.append(tuple(group))
    return sig


def test_plans_issue_the_same_collectives_on_every_rank_whatever_the_memory_layout() -> None:
    rng = np.random.default_rng(0)
    for features in (DEFAULT_FEATURES, OLD_FEATURES):
        for size in (1, 2, 3, 5):
            for name in ("int16", "float32", "bool", "uint8"):
                isz = DTYPES[name].itemsize
                n = int(rng.integers(0, 20))
                sigs: dict[str, set[Any]] = {}
                for rank in range(size):
                    planner = Planner(rank, size, features, True, lambda nbytes: 1 << 40)

                    def b(numel: int, ptr: int | None = None) -> Buffer:
                        return Buffer(int(rng.integers(1, 1 << 30)) * 64 if ptr is None else ptr,
                                      numel * isz, DTYPES[name], (numel,), Device("cuda", 0))
                    base = 1 << 20
                    lists = {  # adjacent on even ranks, scattered on odd ones
                        "adjacent": [b(n, base + j * n * isz) for j in range(size)],
                        "scattered": [b(n) for _ in range(size)],
                    }["adjacent" if rank % 2 == 0 else "scattered"]
                    plans = {
                        "all_gather": planner.all_gather(lists, b(n)),
                        "reduce_scatter": planner.reduce_scatter(b(n), lists, ReduceOp.MAX),
                        "gather": planner.gather(lists if rank == 0 else None, b(n), 0),
                        "scatter": planner.scatter(b(n), lists if rank == 0 else None, 0),
                        "bxor": planner.all_reduce(b(n), ReduceOp.BXOR) if name != "float32" else [],
                        "reduce": planner.reduce(b(n), size - 1, ReduceOp.MIN),
                    }
                    for key, plan in plans.items():
                        sigs.setdefault(key, set()).add(repr(_collective_signature(plan)))
                assert all(len(v) == 1 for v in sigs.values()), {k: v for k, v in sigs.items() if len(v) > 1}

"""The Python bytecode that a small synchronous NumPy all_reduce runs in gpucoll's own
files, counted so that a later change that adds to it fails here (no time is measured:
the timings are ``bench/cpu_collectives_bench.py``'s, the instruction counts
``bench/cpu_small_cost.py --callgrind``'s, and the bytecode by line
``bench/cpu_small_cost.py --opcodes``').

At 2 ranks on shared memory (the one-peer runner), a 4 KiB float32 array, sum, the
kind bound to its runner: ``sys.settrace``'s opcode events in gpucoll's files only, per
op, the fewest over the ops counted (an op whose peer is not there yet spins or waits,
and runs more; the fewest is the op that did not). The ceilings are CPython 3.11's
counts of ``gpucoll.all_reduce(x)`` (the module's function, the group's host path,
``Issuer.run_host``, the one-peer runner): 310 bytecode instructions (336 before the
module's function tested the NumPy kind run last itself and called ``Issuer.run_host``,
sparing ``ProcessGroup.all_reduce``'s frame, and both tested an array's flags with one
look-up, ``flags.carray``; 326 before the
module's function tested for a CuPy array it ran before, 10 of them; 353 before the
group's host path read one derived dict, ``ProcessGroup._host_open``, in place of four
checks and the flight recorder handed out its entries with one call; 4 of the 326 are
two calls made apart from their look-ups, ``take = recorder.take`` and ``run =
fast.run``, which cost more bytecode and fewer instructions, as CPython 3.11 does not
specialize a method-call look-up of an attribute that is not a method); and with
``ProcessGroup.all_reduce`` called directly, 305 (310 before ``flags.carray``). A frame, a check or a call more
per op fails. Another CPython may need the ceilings moved, by a run there, never by
guessing.

The test also checks that the ops it counts gave the right sums (the path counted is
the path that works) and took the bound path (the one-peer runner).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gpucoll.testing import run_spmd

OPS = 200
CEILING_MODULE = 310  # gpucoll.all_reduce(x)
CEILING_GROUP = 305  # ProcessGroup.all_reduce(x, op, False)


def opcodes_body() -> dict[str, Any]:
    import numpy as np

    import gpucoll
    from gpucoll._collectives import _world

    from _opcodes import Opcodes

    r, n = gpucoll.get_rank(), gpucoll.get_world_size()
    pg = _world._WORLD.default
    x = np.zeros(1024, np.float32)
    op = gpucoll.ReduceOp.SUM
    calls = {"module": lambda: gpucoll.all_reduce(x), "group": lambda: pg.all_reduce(x, op, False)}
    counter = Opcodes()
    fewest: dict[str, float] = {}
    wrong = 0
    for name, call in calls.items():
        for k in range(OPS + 3):  # the first plans the kind, the second binds it
            x[...] = r + k
            if k < 3:
                call()
            else:
                before = counter.count
                with counter:
                    call()
                fewest[name] = min(fewest.get(name, float("inf")), counter.count - before)
            if not (x == sum(q + k for q in range(n))).all():
                wrong += 1
    fast = pg._host_runs.get((x.dtype, x.shape, "SUM"))
    bound = fast is not None and fast.run.__qualname__.startswith("_one_peer.")
    return {"fewest": fewest, "wrong": wrong, "bound": bound}


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the ceilings are CPython 3.11's counts")
def test_small_all_reduce_bytecode_ceiling() -> None:
    results = run_spmd(opcodes_body, world_size=2, backend="cpu", timeout=120)
    for rank, res in enumerate(results):
        assert res["wrong"] == 0, f"rank {rank}: {res['wrong']} ops gave a wrong sum"
        assert res["bound"], f"rank {rank}: the kind is not on the one-peer runner"
    # Rank 0's and rank 1's counts are the same path's; either may have waited on every op
    # (its peer slower under tracing), so the fewer of the two is compared.
    module = min(res["fewest"]["module"] for res in results)
    group = min(res["fewest"]["group"] for res in results)
    assert module <= CEILING_MODULE, f"gpucoll.all_reduce runs {module} bytecode instructions per op; " \
                                     f"the ceiling is {CEILING_MODULE}"
    assert group <= CEILING_GROUP, f"ProcessGroup.all_reduce runs {group} bytecode instructions per op; " \
                                   f"the ceiling is {CEILING_GROUP}"

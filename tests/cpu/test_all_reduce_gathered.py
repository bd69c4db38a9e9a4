"""all_reduce_gathered: one all_reduce of the concatenation of several arrays, each divided
on the way in (what the Reducer runs per bucket), against NumPy and against the plain
all_reduce of the divided concatenation, which it must equal bit for bit (a peer may
issue either: they are one collective).

One world per transport and size runs every check: shared memory at 1-4 ranks (through
the Reducer's tests in tests/ddp, and here at 3), TCP at 3.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from gpucoll._backends.cpu.backend import gathered_fill
from gpucoll.testing import run_spmd

# ----- the fill, alone -----

EDGES = np.array([0.0, -0.0, 1.0, -3.0, 1e-45, -1e-45, 1.4e-45 * 3, 1.17549435e-38, 3.4e38, -3.4e38,
                  np.inf, -np.inf, np.nan, 7.0, 1 / 3, 2.5e-39], np.float64)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64])
@pytest.mark.parametrize("divisor", [1, 2, 3, 4, 5, 7, 8, 64])
def test_the_fill_is_numpys_division_bit_for_bit(dtype: Any, divisor: int) -> None:
    rng = np.random.default_rng(divisor)
    with np.errstate(over="ignore", invalid="ignore"):
        parts = [EDGES.astype(dtype), rng.standard_normal(1000).astype(dtype), np.empty(0, dtype),
                 (rng.standard_normal(37) * 1e-40).astype(dtype), np.empty(0, dtype), rng.standard_normal(5).astype(dtype)]
        whole = np.concatenate(parts)
        want = np.divide(whole, divisor)
    fill = gathered_fill(parts, divisor)
    # every window, across part boundaries and empty parts
    for lo, hi in [(0, whole.size), (0, 1), (3, 20), (15, 16), (16, 1016), (10, 1050), (1015, 1017), (1053, whole.size)]:
        out = np.full(hi - lo, 99, dtype)
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            fill(lo, hi, out)
        assert out.tobytes() == want[lo:hi].astype(dtype).tobytes(), (lo, hi)


def test_the_fill_casts_as_numpy_does_into_the_bucket_dtype() -> None:
    parts = [np.arange(10, dtype=np.int64), np.linspace(0, 1, 7)]  # int and float64 into a float32 bucket
    out = np.empty(17, np.float32)
    gathered_fill(parts, 3)(0, 17, out)
    want = np.empty(17, np.float32)
    np.divide(parts[0], 3, out=want[:10])
    np.divide(parts[1], 3, out=want[10:])
    assert out.tobytes() == want.tobytes()


# ----- in a world -----

def data(rank: int, sizes: list[int], dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(rank + 17)
    return [rng.standard_normal(n).astype(dtype) for n in sizes]


def reference(world: int, sizes: list[int], dtype: Any = np.float32) -> np.ndarray:
    """The sum over ranks, in rank order, of each rank's divided concatenation."""
    with np.errstate(under="ignore"):
        per_rank = [np.divide(np.concatenate(data(r, sizes, dtype)), world).astype(dtype) for r in range(world)]
        out = per_rank[0].copy()
        for p in per_rank[1:]:
            out += p
    return out


def avg_reference(world: int, sizes: list[int]) -> np.ndarray:
    """The sum over ranks, in rank order, of each rank's concatenation, divided once."""
    out = np.concatenate(data(0, sizes))
    for r in range(1, world):
        out += np.concatenate(data(r, sizes))
    return np.divide(out, np.float32(world))


# sizes: small (one slot), large with parts across the 1 MiB staging blocks, empty parts
LAYOUTS = [[5, 0, 300, 1], [100_000, 0, 250_001, 3, 700_000], [1 << 20]]


def gathered_checks() -> str:
    import gpucoll
    from gpucoll._collectives import _pg
    from gpucoll._group.gathered import all_reduce_gathered

    pg = _pg(None)
    r, w = gpucoll.get_rank(), gpucoll.get_world_size()
    for sizes in LAYOUTS:
        want = reference(w, sizes)
        parts = data(r, sizes)
        out = np.full(sum(sizes), np.nan, np.float32)
        assert all_reduce_gathered(pg, out, parts, w) is None
        assert out.tobytes() == want.tobytes(), sizes
        # the parts are read, never written
        assert all(p.tobytes() == q.tobytes() for p, q in zip(parts, data(r, sizes)))
        # in place: the out array is its own single part
        own = np.concatenate(data(r, sizes))
        all_reduce_gathered(pg, own, [own], w)
        assert own.tobytes() == want.tobytes(), sizes
        # one collective: odd ranks issue the plain all_reduce of the divided concatenation
        mixed = np.full(sum(sizes), np.nan, np.float32)
        if r % 2:
            np.divide(np.concatenate(parts), w, out=mixed)
            gpucoll.all_reduce(mixed)
        else:
            all_reduce_gathered(pg, mixed, parts, w)
        assert mixed.tobytes() == want.tobytes(), sizes
        # async: a Work; the parts stay untouched until it completes
        out2 = np.full(sum(sizes), np.nan, np.float32)
        work = all_reduce_gathered(pg, out2, parts, w, async_op=True)
        assert work is not None
        work.wait()
        assert out2.tobytes() == want.tobytes(), sizes
        # op=AVG: the average of the concatenations (summed in rank order, divided once);
        # to a peer the all_reduce AVG of it
        mean = avg_reference(w, sizes)
        avg = np.full(sum(sizes), np.nan, np.float32)
        if r % 2:
            avg[...] = np.concatenate(parts)
            gpucoll.all_reduce(avg, op=gpucoll.ReduceOp.AVG)
        else:
            assert all_reduce_gathered(pg, avg, parts, 1, op=gpucoll.ReduceOp.AVG) is None
        assert avg.tobytes() == mean.tobytes(), sizes
    with pytest.raises(ValueError, match="op must be SUM or AVG"):
        all_reduce_gathered(pg, out, parts, w, op=gpucoll.ReduceOp.MAX)

    # an async one never waits for a late peer on the caller's thread
    sizes = LAYOUTS[1]
    parts, out = data(r, sizes), np.empty(sum(sizes), np.float32)
    gpucoll.barrier()
    if r == 0 and w > 1:
        t0 = time.perf_counter()
        work = all_reduce_gathered(pg, out, parts, w, async_op=True)
        assert work is not None
        returned = time.perf_counter() - t0
        work.wait()
        if os.environ["GPUCOLL_DEBUG"] != "DETAIL":  # (DETAIL compares each op across the ranks first)
            assert returned < 0.5, f"the async op returned after {returned:.2f} s: it waited for its peers"
    else:
        time.sleep(1.0)
        work = all_reduce_gathered(pg, out, parts, w, async_op=True)
        assert work is not None
        work.wait()
    assert out.tobytes() == reference(w, sizes).tobytes()

    # with a completion hook (the Work path): the same bits, and the hook sees an all_reduce
    infos: list[Any] = []
    pg.register_on_completion_hook(infos.append)
    sizes = LAYOUTS[0]
    out = np.empty(sum(sizes), np.float32)
    all_reduce_gathered(pg, out, data(r, sizes), w)
    assert out.tobytes() == reference(w, sizes).tobytes()
    deadline = time.monotonic() + 10
    while not infos and time.monotonic() < deadline:
        time.sleep(0.01)
    assert infos and infos[-1].op_type == "all_reduce", infos

    # bad input: parts that do not add up
    with pytest.raises(ValueError, match="the parts hold 3 elements; out holds 4"):
        all_reduce_gathered(pg, np.empty(4, np.float32), [np.ones(3, np.float32)], w)

    # a different op on a peer is a named error, not a wrong result
    if w > 1:
        x = np.ones(1000, np.float32)
        with pytest.raises(gpucoll.DistBackendError, match="all_reduce"):
            if r == 0:
                all_reduce_gathered(pg, x, [x], w)
            else:
                gpucoll.all_reduce(x[:999])
    return "ok"


@pytest.mark.parametrize("transport,world_size,debug", [("shm", 3, "OFF"), ("tcp", 3, "OFF"), ("shm", 1, "OFF"),
                                                        ("shm", 2, "DETAIL")])
def test_all_reduce_gathered(transport: str, world_size: int, debug: str) -> None:
    got = run_spmd(gathered_checks, world_size, timeout=180, pg_timeout=20,
                   env={"GPUCOLL_CPU_TRANSPORT": transport, "GPUCOLL_DEBUG": debug})
    assert got == ["ok"] * world_size
